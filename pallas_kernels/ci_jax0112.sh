#!/usr/bin/env bash
# Runs the kernel tests under jax==0.11.2 in a torch/flax-free venv (created if missing).
# Usage: pallas_kernels/ci_jax0112.sh   (from anywhere; exits non-zero on failure)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JAX0112_VENV:-$repo/.venv-jax0112}"
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c 'import jax, sys; sys.exit(jax.__version__ != "0.11.2")'; then
  py="$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python"
  [[ -x "$py" ]] || py="$(command -v python3.12 || command -v python3)"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q "jax==0.11.2" numpy pytest hypothesis
fi
cd "$repo"
# -c /dev/null: do not load the main project's pytest config/plugins (torch/flax-free run);
# PYTHONPATH: import pallas_kernels from the checkout, not an installed copy.
PYTHONPATH="$repo" "$venv/bin/python" -m pytest tests/kernels -q -p no:cacheprovider \
  --rootdir "$repo" -c /dev/null "$@"
