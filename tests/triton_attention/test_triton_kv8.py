"""The Triton kernels on 8-bit KV pools (docs/kv_quantization.md), in Triton's interpreter.

Two paths:

- engine path (subprocess, TRITON_INTERPRET=1): the pool quantized by the engine's own
  writer (``pagedjax.attention.kv_quant.quantize``, ``QuantizedPages``), read by the Triton
  backend's callable (``backends.with_8bit_pages(jax_binding.ragged_paged_attention)``,
  what ``select_attention_backend("triton")`` returns) under ``jax.jit`` with a traced
  layer and window, through a jax-triton stand-in that runs the kernel in the interpreter;
  compared with the XLA reference (``pagedjax.attention.reference``) on the *same*
  ``QuantizedPages``. fp8 layer-head scales are drawn in [0.5, 2] (not vLLM's 1.0) so a
  scale applied to the wrong head, layer or side shows.
- kernel path (the check_cases worker): the torch launcher on a pool quantized with numpy,
  against ``pallas_kernels.reference`` on the dequantized pool; and the binding's call
  layout (pool dtypes, scale arrays, scale strides).

Poisoning as in the float tests: every slot holding no token, the null block, the pages
behind garbage table tails and the other layer of the 2-layer pool are NaN (fp8: NaN bytes;
int8: NaN scales, int8 having no NaN), so a read of any of them gives NaN output.

Tolerances. Both sides read the same 8-bit values, so quantization error cancels; what is
left is the arithmetic. fp32 q: the kernel converts 8-bit values to fp32 exactly and
applies the scales in fp32 after the dot (the reference before it): rounding of fp32
sums, relative Frobenius error 1e-5 (as the float fp32 cases). fp16 q: every fp8 and int8
value is exact in fp16, but the probabilities (and int8's dequantized V rows) are rounded to
fp16 for ``tl.dot`` (relative 2^-11 each) and both outputs are rounded to fp16 (2^-11):
2e-3 (as the float fp16 cases), about 4x the sum of those unit roundoffs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8_per_token_head")
TOL = {"float16": 2e-3, "float32": 1e-5}

ENGINE_CASES = {
    # CI: decode at lengths 1 / bs-1 / bs+1, a prefill chunk of 6 at 40, a padding sequence
    # and padding tokens; GQA 4, pages of 16, a traced window of 24 and a soft cap; fp16
    "gqa4-b16-edges-prefill-window-softcap": dict(
        q_lens=[1, 1, 1, 6, 0], kv_lens=[1, 15, 17, 40, 0], num_tokens=10, hq=8, hkv=2,
        block_size=16, max_blocks=3, dtype="float16", window=24, soft_cap=5.0),
    # slow: prefill + decode + a padding sequence, MQA, pages of 8, window 20, fp32
    "mixed-mqa-window-fp32": dict(
        q_lens=[9, 1, 0], kv_lens=[40, 23, 0], num_tokens=12, hq=4, hkv=1, block_size=8,
        max_blocks=6, dtype="float32", window=20),
}  # fmt: skip
SLOW_ENGINE_CASES = {"mixed-mqa-window-fp32"}

SCRIPT = r"""
import json, os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.triton.check_cases import FakeJaxTriton
fake = FakeJaxTriton(callback=True)
sys.modules["jax_triton"] = fake
from pallas_kernels.cases import make_case
from pallas_kernels.triton import jax_binding
from pagedjax.attention import reference
from pagedjax.attention.backends import with_8bit_pages
from pagedjax.attention.kv_quant import FORMATS, QuantizedPages, quantize

triton_attention = with_8bit_pages(jax_binding.ragged_paged_attention)
LAYERS, LAYER, D = 2, 1, 32
for fmt_name, name, c in json.loads(sys.argv[1]):
    rng = np.random.default_rng(7)
    bs = c["block_size"]
    case = make_case(
        rng, q_lens=c["q_lens"], kv_lens=c["kv_lens"], num_tokens=c["num_tokens"],
        num_q_heads=c["hq"], num_kv_heads=c["hkv"], head_dim=D, block_size=bs,
        max_blocks=c["max_blocks"], num_blocks=sum(-(-n // bs) for n in c["kv_lens"]) + 3)
    fmt = FORMATS[fmt_name]
    pools = []
    for pages in (case.k_pages, case.v_pages):
        x = np.full((LAYERS, *pages.shape), np.nan, np.float32)
        x[LAYER] = pages
        x = jnp.asarray(x)
        if fmt.per_token:
            values, scale = quantize(x, fmt)
            # int8 has no NaN: poison the scales of every slot that holds no token
            scale = jnp.where(jnp.isnan(x[..., :1]), jnp.nan, scale)
            pools.append(QuantizedPages(values, scale, fmt))
        else:
            ls = tuple(tuple(float(s) for s in row)
                       for row in rng.uniform(0.5, 2.0, (LAYERS, c["hkv"])))
            values, _ = quantize(x, fmt, jnp.asarray(ls, jnp.float32)[:, None, :, None, None])
            pools.append(QuantizedPages(values, None, fmt, ls))
    q = jnp.asarray(case.q).astype(c["dtype"])
    window = jnp.int32(c.get("window") or 0)
    kw = dict(sm_scale=D ** -0.5, soft_cap=c.get("soft_cap"))
    tables, kv_lens, cu = (
        jnp.asarray(a) for a in (case.block_tables, case.kv_lens, case.cu_q_lens))

    def ref_fn(q, k, v, layer, window):
        return reference.ragged_paged_attention(q, k, v, tables, kv_lens, cu, layer=layer,
                                                sliding_window=window, **kw)

    def triton_fn(q, k, v, layer, window):
        return triton_attention(q, k, v, tables, kv_lens, cu, layer=layer,
                                sliding_window=window, **kw)

    n_calls = len(fake.calls)
    ref = np.asarray(jax.jit(ref_fn)(q, *pools, jnp.int32(LAYER), window), np.float32)
    out = np.asarray(jax.jit(triton_fn)(q, *pools, jnp.int32(LAYER), window), np.float32)
    live = int(case.cu_q_lens[-1])
    finite = bool(np.isfinite(out).all())
    err = float(np.linalg.norm(out[:live] - ref[:live]) / np.linalg.norm(ref[:live]))
    call = fake.calls[n_calls]
    print("RESULT " + json.dumps(dict(
        fmt=fmt_name, case=name, finite=finite, rel_err=err if finite else None,
        ref_finite=bool(np.isfinite(ref).all()),
        padding_max_abs=float(np.abs(out[live:]).max()) if out.shape[0] > live else 0.0,
        array_dtypes=call["array_dtypes"], array_shapes=call["array_shapes"],
        kv_format=call["constexprs"]["KV_FORMAT"])), flush=True)
"""


def _run_engine_cases(env: dict, names: list[str]) -> dict:
    """All formats x the named cases in one interpreter subprocess (one start-up)."""
    jobs = [(f, name, ENGINE_CASES[name]) for f in FORMATS for name in names]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(jobs)], capture_output=True, text=True,
        env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [x[len("RESULT ") :] for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return {(r["fmt"], r["case"]): r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def engine_results(subprocess_env):
    names = sorted(set(ENGINE_CASES) - SLOW_ENGINE_CASES)
    return _run_engine_cases(subprocess_env(interpret=True), names)


@pytest.fixture(scope="module")
def slow_engine_results(subprocess_env):
    return _run_engine_cases(subprocess_env(interpret=True), sorted(SLOW_ENGINE_CASES))


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_backend_equals_xla_reference_on_the_same_8bit_pool(engine_results, fmt):
    _check_engine_result(engine_results, fmt, "gqa4-b16-edges-prefill-window-softcap")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_backend_equals_xla_reference_mqa_fp32(slow_engine_results, fmt):
    _check_engine_result(slow_engine_results, fmt, "mixed-mqa-window-fp32")


def _check_engine_result(results: dict, fmt: str, case: str) -> None:
    r = results[(fmt, case)]
    assert r["ref_finite"] and r["finite"], "NaN leaked from a poisoned slot or scale"
    assert r["padding_max_abs"] == 0.0, "padding tokens must be exactly 0"
    assert r["rel_err"] < TOL[ENGINE_CASES[case]["dtype"]], r
    storage = "int8" if fmt.startswith("int8") else "uint8"
    # q, the whole 2-layer pool as its 8-bit values (never a slice), then the scales
    assert r["array_dtypes"][:5] == [ENGINE_CASES[case]["dtype"], storage, storage,
                                     "float32", "float32"], r  # fmt: skip
    assert r["array_shapes"][1][0] == 2
    hkv = ENGINE_CASES[case]["hkv"]
    want_scale = r["array_shapes"][1][:4] + [1] if storage == "int8" else [2, hkv]
    assert r["array_shapes"][3] == r["array_shapes"][4] == want_scale, r
    assert r["kv_format"] == ("int8" if storage == "int8" else fmt)


def kernel_case(q_lens, kv_lens, num_tokens, **kw):
    return dict(q_lens=list(q_lens), kv_lens=list(kv_lens), num_tokens=num_tokens, **kw)


KERNEL_CASES = [
    # wild table tails (ids far outside the pool), chunked prefill + decode, 2 splits
    kernel_case([5, 1, 3, 0], [40, 1, 64, 0], 12, block_size=16, max_blocks=5,
                wild_tail=True, num_splits=2),
    # GQA 3 (padded to 4), pages of 64 cut into 16-key steps, window + soft cap, fp32
    kernel_case([3, 1], [70, 64], 4, num_q_heads=6, num_kv_heads=2, block_size=64,
                max_blocks=2, tile_n=16, block_m=16, sliding_window=24, soft_cap=5.0,
                dtype="float32"),
]  # fmt: skip


@pytest.mark.parametrize("spec", [
    pytest.param(KERNEL_CASES[0], id="mixed-wildtail-split2"),  # poisoned tails: CI
    # The engine-level comparison above covers GQA / window / soft cap per format in CI.
    pytest.param(KERNEL_CASES[1], id="gqa3-window-fp32", marks=pytest.mark.slow),
])  # fmt: skip
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_torch_launcher_on_8bit_pages(interp_worker, kv_format, spec):
    r = interp_worker.run("case", dict(spec, kv_format=kv_format))
    assert r["finite"], "NaN or inf leaked from poisoned pages"
    assert r["padding_max_abs"] == 0.0
    assert r["rel_err"] < TOL[spec.get("dtype", "float16")], r


def test_binding_hands_jax_triton_the_bytes_and_scales(interp_worker):
    # pool [2 layers, 11 blocks, 2 heads, 16, 32] as int8, per-slot scales [2, 11, 2, 16, 1]
    spec = kernel_case([5, 1, 3, 0], [40, 1, 64, 0], 12, max_blocks=5, kv_format="int8")
    r = interp_worker.run("binding", spec)
    assert r["finite"] and r["rel_err"] < TOL["float16"], r
    (call,) = r["calls"]
    # int32: [layer, window], tables, kv_lens, cu_q_lens, the (unread) tree words
    assert call["array_dtypes"] == ["float16", "int8", "int8", "float32", "float32"] + [
        "int32"] * 5  # fmt: skip
    assert call["array_shapes"][3] == call["array_shapes"][4] == [2, 11, 2, 16, 1]
    # pool strides (11264, 1024, 512, 32), then the scales' (352, 32, 16, 1)
    assert call["scalars"][2:10] == [11264, 1024, 512, 32, 352, 32, 16, 1]
    assert call["constexprs"]["KV_FORMAT"] == "int8"
    fp8 = interp_worker.run("binding", dict(spec, kv_format="fp8_e5m2"))
    (call,) = fp8["calls"]
    assert call["array_shapes"][3] == [2, 2] and call["scalars"][6:10] == [2, 0, 1, 0]
    assert call["array_dtypes"][1:3] == ["uint8", "uint8"] and fp8["rel_err"] < TOL["float16"]
