#!/usr/bin/env bash
# Runs `python -m pagedjax.gpu_check` on a GPU machine whose Python has jax (CUDA)
# and triton but not jax-triton (the H200 image: jax 0.11.2, triton 3.6). Wheels carried
# in .wheels/ (git-ignored) are installed into .wheels/site first, without network.
#
# Prepare on a machine with network:  pip download --no-deps jax-triton==0.3.1 absl-py -d .wheels
# (about 0.2 MB), carry .wheels to the GPU machine, then there:
#   pallas_kernels/run_gpu_check.sh            # extra arguments go to gpu_check
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
if ! "$py" -c 'import jax_triton' 2>/dev/null && compgen -G "$repo/.wheels/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-deps --no-index --target "$repo/.wheels/site" "$repo"/.wheels/*.whl
  export PYTHONPATH="$repo/.wheels/site${PYTHONPATH:+:$PYTHONPATH}"
fi
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m pagedjax.gpu_check "$@"
