#!/usr/bin/env bash
# The GPU's share of vLLM 0.1.2's host cost per sequence per step (docs/experiments.md,
# "Known gaps", Fig. 13 Alpaca). experiments/vllm2023_host_cost.py on one machine, three
# ways, all with torch 2.0.1's multinomial (--multinomial-2023) and the API server's
# disconnect check:
#   1. on the CPU, 64-token vocabulary: the host's Python and dispatch work alone;
#   2. on the GPU, 64 tokens: plus each sequence's syncs and kernel launches;
#   3. on the GPU, 49,152 tokens (the tokenizer's; OPT's is 50,272): plus the kernels' time
#      on a real vocabulary row.
# The GPU's share is c(3) - c(1), both measured on the same CPU; the vllm2023
# calibration's 93.7 us (2023's software, this repository's CPU) plus that share is
# 2023's c. Then a count of the syncs per sequence on the GPU.
#
#   bash experiments/vllm2023_gpu_share.sh prepare       # a networked machine: .carry/vllm2023
#   bash experiments/vllm2023_gpu_share.sh run [OUTDIR]  # the GPU machine, no network: ~2 min
#
# With the device tool: command "bash experiments/vllm2023_gpu_share.sh run $OUT", carry
# [".carry/vllm2023"]. The GPU machine's python3 must have torch with CUDA and
# transformers (its image does); PYTHON=... picks another. PYVER (default 3.12) is that
# Python's version, for the wheels `prepare` fetches. GPU=cpu runs `run` on the CPU (a
# check of the script, not a measurement).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
carry="$root/.carry/vllm2023"
py=${PYTHON:-python3}
gpu=${GPU:-cuda}

case "${1:-}" in
prepare)
  mkdir -p "$carry/cache/pagedjax/tokenizers"
  # vLLM 0.1.2's sdist, sha256-checked by the harness's own fetch.
  XDG_CACHE_HOME="$carry/cache" "$py" -c "import sys; sys.path.insert(0, '$root/experiments')
import vllm2023_host_cost as h; h.fetch_sdist()"
  tok=$(ls "${XDG_CACHE_HOME:-$HOME/.cache}"/pagedjax/tokenizers/*.json 2>/dev/null | sort | head -1)
  if [ -z "$tok" ]; then
    echo "no tokenizer in pagedjax's cache: run the SmolLM2 model once (README) first" >&2
    exit 2
  fi
  cp "$tok" "$carry/cache/pagedjax/tokenizers/"
  # Starlette 0.27 / anyio 3.7 / uvicorn 0.22 as 2023's API server ran them.
  "$py" -m pip install --quiet --no-deps --target "$carry/asgi2023" \
    --python-version "${PYVER:-3.12}" --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    starlette==0.27.0 anyio==3.7.1 uvicorn==0.22.0 httptools==0.6.1 sniffio==1.3.1
  du -sh "$carry"
  ;;
run)
  out=${2:-.}
  mkdir -p "$out"
  if [ ! -d "$carry/asgi2023" ]; then
    echo "$carry is missing: run 'prepare' on a networked machine and carry it" >&2
    exit 2
  fi
  export XDG_CACHE_HOME="$carry/cache"
  harness=("$py" "$root/experiments/vllm2023_host_cost.py" --asgi-2023 "$carry/asgi2023"
           --multinomial-2023)
  {
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
    "${harness[@]}" --device cpu --vocab 64
    "${harness[@]}" --device "$gpu" --vocab 64
    "${harness[@]}" --device "$gpu" --vocab 49152
    "${harness[@]}" --device "$gpu" --vocab 49152 --count-device-work --batch-sizes 1 64 \
      --steps 20
  } 2>&1 | grep -v -E " INFO |^STAGE:|^USDT:" | tee "$out/vllm2023_gpu_share.txt"
  ;;
*)
  echo "usage: $0 prepare | run [OUTDIR]" >&2
  exit 2
  ;;
esac
