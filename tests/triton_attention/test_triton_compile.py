"""Each kernel compiled for sm_80 and sm_90 with Triton's own compiler on the CPU (through
PTX to cubin with the ptxas in the triton wheel), in a subprocess with TRITON_INTERPRET
unset. Catches kernels that do not compile or overflow shared memory at compile time; run
time behaviour on a GPU is the GPU check's job (python -m pagedjax.gpu_check)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# CI: the two kernels and the constexpr branches (splits + merge with the sizes jax-triton
# makes constant; window + soft cap)
# on both targets. The other variants run under -m slow.
FAST = [
    "decode batch 1, one page, 2 splits",
    "prefill fp16, window, soft cap, tree mask",  # USE_TREE: the row words and shifts
    "decode fp8_e4m3 pages, 4 splits",  # 8-bit pages: the integer fp8 decode, fp32 scales
]


def _compile(env: dict, capabilities: list[int], only: list[str] | None) -> list[dict]:
    code = (
        "import json, sys\n"
        "from pallas_kernels.triton import aot\n"
        "only = json.loads(sys.argv[1])\n"
        "variants = [v for v in aot.VARIANTS if only is None or v.name in only]\n"
        "for cap in json.loads(sys.argv[2]):\n"
        "    for v in variants:\n"
        "        try:\n"
        "            print(json.dumps({'ok': True, **aot.compile_variant(v, cap)}), flush=True)\n"
        "        except Exception as e:\n"
        "            print(json.dumps({'ok': False, 'variant': v.name, 'capability': cap,\n"
        "                              'error': repr(e)[-3000:]}), flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(only), json.dumps(capabilities)],
        capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _check(results: list[dict], expected: int) -> None:
    assert len(results) == expected, results
    for r in results:
        assert r["ok"], f"{r['variant']} does not compile for sm_{r['capability']}: {r['error']}"
        for k in r["kernels"]:
            assert k["cubin_bytes"] > 0 and k["ptx_chars"] > 0
            assert k["target"] == f"sm_{r['capability']}"
            # A100's per-block limit (sm_86/89 allow 99 KiB): the tables must leave margin.
            assert k["shared_bytes"] <= 99 * 1024, k


def test_compiles_for_sm80_and_sm90(subprocess_env):
    pytest.importorskip("triton")
    results = _compile(subprocess_env(interpret=False), [80, 90], FAST)
    _check(results, 2 * len(FAST))
    kernels = {k["name"] for r in results for k in r["kernels"]}
    assert kernels == {"paged_attention_kernel", "merge_splits_kernel"}


@pytest.mark.slow
def test_every_variant_compiles_for_every_table(subprocess_env):
    pytest.importorskip("triton")
    from pallas_kernels.triton import aot

    _check(_compile(subprocess_env(interpret=False), [80, 86, 89, 90], None), 4 * len(aot.VARIANTS))
