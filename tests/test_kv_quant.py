"""The 8-bit KV cache (pagedjax.attention.kv_quant): quantization bounds and saturation,
writes, and attention over 8-bit pages in the XLA reference and the native CPU kernel.

Three checks per attention case, each format (fp8_e4m3, fp8_e5m2, int8_per_token_head):

1. Exactness of the read path: attention over the 8-bit pool equals (fp32 rounding,
   atol 2e-5) the XLA reference run on a float pool holding the *dequantized* values
   (values x scale, computed here with numpy). The native kernel equals the reference on
   the same 8-bit pool. A backend that ignored a scale, read the wrong slot's scale, or
   read a poisoned slot fails this.
2. Distance to the unquantized attention, within a bound derived from the formats' error:
   with each key k_j stored as k_j + dk_j and each value as v_j + dv_j, the scores move by at
   most D_t = sm_scale * max_j |q_t . dk_j| (a soft cap is 1-Lipschitz, so still <= D_t),
   each probability by a factor in [exp(-2 D_t), exp(2 D_t)], hence
   |o_hat - o| <= max_j |dv_j| + (exp(2 D_t) - 1) * max_j |v_j|   (per output element; maxima
   over the sequence's keys, a superset of the visible ones), plus 1e-5 of fp32 rounding.
3. The element round trip itself: |dequant(quant(x)) - x| <= rel * |x| + abs * scale with
   (rel, abs) = half an ulp of the format (E4M3: 2^-4 and 2^-10 for subnormals; E5M2: 2^-3,
   2^-17; int8: 0 and 0.5), and saturation (no NaN/inf from a finite overflow).

Every case fills unused pages with NaN (fp8: NaN bytes; int8: NaN scales) and points the
block tables' tails at such pages, and covers GQA / MQA / MHA, sliding window, soft cap,
block sizes 8-128 and lengths at block edges.
"""

from __future__ import annotations

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.attention import kv_quant, native_cpu, ragged_paged_attention, write_kv
from pagedjax.attention.kv_quant import FORMATS, QuantizedPages

FMT_NAMES = tuple(FORMATS)
if shutil.which("g++"):
    assert native_cpu.available()[0], native_cpu.available()[1]


# ------------------------------------------------------------------ quantization itself


@pytest.mark.parametrize("name", FMT_NAMES)
def test_round_trip_error_bound_and_saturation(name):
    fmt = FORMATS[name]
    rng = np.random.default_rng(0)
    # Wide dynamic range, exact zeros, a zero token-head, subnormal-sized values.
    x = rng.normal(size=(64, 4, 32)) * np.exp(rng.uniform(-12, 4, size=(64, 4, 1)))
    x[0, 0] = 0.0
    x[1, :, :5] = 1e-7
    x = jnp.asarray(x, jnp.float32)
    layer_scale = jnp.asarray([1.0, 0.5, 2.0, 0.01], jnp.float32)[:, None]  # [Hkv, 1]
    values, token_scale = kv_quant.quantize(x, fmt, None if fmt.per_token else layer_scale)
    scale = token_scale if fmt.per_token else layer_scale
    back = np.asarray(kv_quant.dequantize(values, scale, fmt))
    xs, sc = np.asarray(x), np.broadcast_to(np.asarray(scale), x.shape)
    in_range = np.abs(xs) <= fmt.max_value * sc
    err = np.abs(back - xs)
    bound = fmt.rel_error * np.abs(xs) + fmt.abs_error * sc
    assert np.all(err[in_range] <= bound[in_range] * (1 + 1e-6)), float(
        np.max(err[in_range] / bound[in_range])
    )
    assert np.isfinite(back).all()
    if fmt.per_token:
        assert np.asarray(token_scale)[0, 0, 0] == 1.0 and (back[0, 0] == 0).all()
    # Saturation: values far past the range land on +-max (a bare cast gives NaN / inf).
    huge = jnp.asarray([[[1e30, -1e30, 1e6, -1e6]]], jnp.float32)
    v, s = kv_quant.quantize(huge, fmt, None if fmt.per_token else jnp.ones((1, 1)))
    got = np.asarray(kv_quant.dequantize(v, s, fmt))
    assert np.isfinite(got).all() and got[0, 0, 0] > 0 > got[0, 0, 1]
    if not fmt.per_token:
        assert np.all(np.abs(got) == fmt.max_value)


def test_names_and_bytes_per_token():
    assert kv_quant.resolve_kv_format("fp8") is FORMATS["fp8_e4m3"]
    assert kv_quant.resolve_kv_format("auto") is None
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.resolve_kv_format("int4")
    # Llama-2-7B: 32 layers x 32 heads x 128 dims; K and V.
    args = (32, 32, 128)
    assert kv_quant.kv_bytes_per_token(*args, "auto", jnp.float16) == 2 * 32 * 32 * 128 * 2
    assert kv_quant.kv_bytes_per_token(*args, "fp8", jnp.float16) == 2 * 32 * 32 * 128
    assert kv_quant.kv_bytes_per_token(*args, "int8_per_token_head", jnp.float16) == (
        2 * 32 * 32 * (128 + 4)
    )


# ------------------------------------------------------------------ attention cases

# name: (Hq, Hkv, block_size, head_dim, window, soft_cap, q_lens, kv_lens)
CASES = {
    "gqa_bs8_edges": (4, 2, 8, 16, None, None, (1, 8, 1, 5), (8, 16, 9, 17)),
    "mqa_bs16_window_cap": (4, 1, 16, 32, 5, 20.0, (1, 3, 16), (33, 31, 16)),
    "mha_bs128_edges": (2, 2, 128, 16, None, None, (1, 2), (128, 129)),
    "gqa_bs32_cap_window": (6, 2, 32, 16, 40, 30.0, (1, 7, 1), (64, 65, 1)),
}
LAYERS, LAYER = 2, 1


def _build(case, fmt_name, seed=0):
    """Random ragged case written into an 8-bit pool and a float32 pool (same slots)."""
    hq, hkv, bs, d, window, cap, q_lens, kv_lens = case
    rng = np.random.default_rng(seed)
    blocks_per = [-(-n // bs) for n in kv_lens]
    max_blocks = max(blocks_per) + 1  # one extra column: a poisoned tail entry for all
    nb = 2 + sum(blocks_per) + 2  # null block, data, two never-written poisoned blocks
    perm = rng.permutation(np.arange(1, nb - 2))  # data blocks in random order
    poisoned = [nb - 2, nb - 1]
    tables = np.zeros((len(kv_lens), max_blocks), np.int32)
    k_all, v_all, slots, used = [], [], [], 0
    for s, n in enumerate(kv_lens):
        ids = perm[used : used + blocks_per[s]]
        used += blocks_per[s]
        tables[s, : len(ids)] = ids
        tables[s, len(ids) :] = poisoned[s % 2]  # table tails -> poisoned pages
        k_all.append(rng.normal(size=(n, hkv, d)))
        v_all.append(rng.normal(size=(n, hkv, d)))
        pos = np.arange(n)
        slots.append(ids[pos // bs] * bs + pos % bs)
    k_new = jnp.asarray(np.concatenate(k_all), jnp.float32)
    v_new = jnp.asarray(np.concatenate(v_all), jnp.float32)
    slot_map = jnp.asarray(np.concatenate(slots), jnp.int32)
    shape = (LAYERS, nb, hkv, bs, d)
    fmt = FORMATS[fmt_name]
    layer_scale = None
    if not fmt.per_token:  # non-trivial per-(layer, head) scales
        layer_scale = tuple(tuple(0.5 + 0.25 * h + 0.1 * lyr for h in range(hkv))
                            for lyr in range(LAYERS))  # fmt: skip
    nan = float("nan")
    pools = [kv_quant.allocate_quantized_pages(shape, fmt, layer_scale=layer_scale,
                                               fill_value=nan) for _ in range(2)]  # fmt: skip
    kq, vq = write_kv(*pools, k_new, v_new, slot_map, jnp.int32(LAYER))
    kf = jnp.full(shape, jnp.nan, jnp.float32)
    kf, vf = write_kv(kf, kf, k_new, v_new, slot_map, jnp.int32(LAYER))
    q_total = sum(q_lens)
    q = jnp.asarray(rng.normal(size=(q_total + 3, hq, d)), jnp.float32)  # 3 padding rows
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = (jnp.asarray(tables), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu))
    return q, (kq, vq), (kf, vf), meta, (k_all, v_all)


def _dequantized_pool(pages: QuantizedPages) -> jax.Array:
    """float32 values x scale, computed with numpy (NaN where poisoned)."""
    vals = np.asarray(kv_quant.to_float(pages.values, pages.fmt))
    if pages.token_scale is not None:
        return jnp.asarray(vals * np.asarray(pages.token_scale))
    ls = np.asarray(pages.layer_scale, np.float32)[:, None, :, None, None]
    return jnp.asarray(vals * ls)


@functools.partial(jax.jit, static_argnames=("fn", "sm_scale", "window", "cap"))
def _attend(q, k, v, tables, kv_lens, cu, *, fn, sm_scale, window, cap):
    return fn(q, k, v, tables, kv_lens, cu, layer=jnp.int32(LAYER), sm_scale=sm_scale,
              sliding_window=window, soft_cap=cap)  # fmt: skip


def _error_bound(case, q, cu, quant, exact, k_hat, v_hat, sm_scale):
    """Per-element bound of test check 2 (module docstring), [T, Hq, D]."""
    hq, hkv, *_ = case
    group = hq // hkv
    q = np.asarray(q)
    bound = np.zeros(q.shape)
    for s in range(len(cu) - 1):
        k, v = exact[0][s], exact[1][s]  # [n, Hkv, D]
        dk, dv = k_hat[s] - k, v_hat[s] - v
        for h in range(hq):
            kv_h = h // group
            rows = q[cu[s] : cu[s + 1], h]  # [q_len, D]
            delta = sm_scale * np.max(np.abs(rows @ dk[:, kv_h].T), axis=1)  # [q_len]
            dv_max = np.max(np.abs(dv[:, kv_h]), axis=0)  # [D]
            v_max = np.max(np.abs(v[:, kv_h]), axis=0)
            bound[cu[s] : cu[s + 1], h] = dv_max + np.expm1(2 * delta)[:, None] * v_max
    return bound + 1e-5


# CI runs one pair per format (block sizes 8, 16, 128; GQA, MQA, MHA; window and soft cap
# among them), the other nine under -m slow (~5 s each on the 2-core box: three
# compilations per pair).
FAST = {
    ("gqa_bs8_edges", "int8_per_token_head"),
    ("mqa_bs16_window_cap", "fp8_e5m2"),
    ("mha_bs128_edges", "fp8_e4m3"),
}
PAIRS = [
    pytest.param(c, f, marks=() if (c, f) in FAST else pytest.mark.slow)
    for c in CASES
    for f in FMT_NAMES
]


@pytest.mark.parametrize(("case_name", "fmt_name"), PAIRS)
def test_attention_over_8bit_pages(case_name, fmt_name):
    case = CASES[case_name]
    hq, hkv, bs, d, window, cap, q_lens, kv_lens = case
    sm_scale = d**-0.5
    q, (kq, vq), (kf, vf), meta, exact = _build(case, fmt_name)
    opts = dict(sm_scale=sm_scale, window=window, cap=cap)
    ref_fn = ragged_paged_attention
    got = np.asarray(_attend(q, kq, vq, *meta, fn=ref_fn, **opts))
    # 1. the read path is exact: same as a float pool holding the dequantized values.
    kd, vd = _dequantized_pool(kq), _dequantized_pool(vq)
    want_dq = np.asarray(_attend(q, kd, vd, *meta, fn=ref_fn, **opts))
    np.testing.assert_allclose(got, want_dq, atol=2e-5, rtol=1e-5)
    assert np.isfinite(got).all() and (got[sum(q_lens) :] == 0).all()
    if native_cpu.available()[0]:
        nat = np.asarray(_attend(q, kq, vq, *meta, fn=native_cpu.ragged_paged_attention, **opts))
        np.testing.assert_allclose(nat, got, atol=2e-5, rtol=1e-5)
    # 2. against the unquantized attention, within the format-derived bound.
    exact_out = np.asarray(_attend(q, kf, vf, *meta, fn=ref_fn, **opts))
    tables, cu = np.asarray(meta[0]), np.asarray(meta[2])
    k_hat, v_hat = [], []
    for s, n in enumerate(kv_lens):
        pos = np.arange(n)
        blk, off = tables[s, pos // bs], pos % bs
        k_hat.append(np.asarray(kd)[LAYER, blk, :, off])
        v_hat.append(np.asarray(vd)[LAYER, blk, :, off])
    bound = _error_bound(case, q, cu, kq, exact, k_hat, v_hat, sm_scale)
    err = np.abs(got - exact_out)[: cu[-1]]
    assert np.all(err <= bound[: cu[-1]]), float(np.max(err - bound[: cu[-1]]))
    assert float(np.max(err)) > 0  # it is quantized: a bit-equal result would be suspicious


@pytest.mark.skipif(not native_cpu.available()[0], reason="no native kernel")
@pytest.mark.parametrize("fmt_name", ["fp8_e4m3", "fp8_e5m2"])
def test_native_fp8_byte_table_matches_jax_for_every_byte(fmt_name):
    """One key per sequence: the output is its value row, so the kernel's byte -> float table
    (cpu_kernel.cc) must reproduce JAX's fp8 -> fp32 conversion for all 256 bytes, NaN and
    inf included (NaN-equal comparison)."""
    fmt = FORMATS[fmt_name]
    d = 256
    byte_values = jnp.arange(256, dtype=jnp.uint8)  # fp8 pages are stored as their bytes
    shape = (1, 2, 1, 8, d)
    k = QuantizedPages(jnp.zeros(shape, jnp.uint8), None, fmt, ((1.0,),))
    v = QuantizedPages(jnp.zeros(shape, jnp.uint8).at[0, 1, 0, 0].set(byte_values), None, fmt,
                       ((2.0,),))  # fmt: skip
    q = jnp.ones((1, 1, d), jnp.float32)
    args = (q, k, v, jnp.asarray([[1]], jnp.int32), jnp.asarray([1], jnp.int32),
            jnp.asarray([0, 1], jnp.int32))  # fmt: skip
    got = np.asarray(native_cpu.ragged_paged_attention(*args, layer=jnp.int32(0), sm_scale=1.0))
    want = np.asarray(jax.lax.bitcast_convert_type(byte_values, fmt.element), np.float32) * 2
    np.testing.assert_array_equal(got[0, 0], want)


def test_write_saturates_and_padding_writes_nowhere():
    fmt = FORMATS["fp8_e4m3"]
    shape = (1, 3, 1, 4, 8)
    pools = [kv_quant.allocate_quantized_pages(shape, fmt) for _ in range(2)]
    x = jnp.full((2, 1, 8), 1e9, jnp.float32)
    from pagedjax.attention import PAD_SLOT

    k, v = write_kv(*pools, x, -x, jnp.asarray([5, PAD_SLOT], jnp.int32), jnp.int32(0))
    assert k.values.dtype == jnp.uint8  # fp8 stored as bytes
    kv_vals = np.asarray(kv_quant.to_float(k.values, fmt))
    assert (kv_vals[0, 1, 0, 1] == 448.0).all()  # slot 5 = block 1, offset 1: saturated
    assert np.count_nonzero(kv_vals) == 8 and np.isfinite(kv_vals).all()
    assert (np.asarray(kv_quant.to_float(v.values, fmt))[0, 1, 0, 1] == -448.0).all()
    with pytest.raises(ValueError, match="quantized or both plain"):
        write_kv(pools[0], jnp.zeros(shape), x, x, jnp.asarray([1, 2], jnp.int32), 0)


def test_block_copy_moves_scales_with_values():
    """copy_blocks over the pool's leaves (copy-on-write, apply_cow) carries int8 scales."""
    from pagedjax.engine.model_runner import apply_cow

    fmt = FORMATS["int8_per_token_head"]
    shape = (2, 4, 2, 4, 8)
    pools = tuple(kv_quant.allocate_quantized_pages(shape, fmt) for _ in range(2))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 2, 8)) * 3, jnp.float32)
    pools = write_kv(*pools, x, x, jnp.arange(4, 8, dtype=jnp.int32), jnp.int32(1))
    out = apply_cow(pools, jnp.asarray([1], jnp.int32), jnp.asarray([3], jnp.int32),
                    jnp.asarray([True]))  # fmt: skip
    for a in jax.tree.leaves(out):
        np.testing.assert_array_equal(np.asarray(a)[:, 3], np.asarray(a)[:, 1])
    assert float(np.asarray(out[0].token_scale)[1, 3].max()) > 0.02  # the written scales


# ------------------------------------------------------------------ the layer loop


@pytest.mark.parametrize(
    ("fmt_name", "backend"),
    [
        ("int8_per_token_head", "native_cpu"),
        pytest.param("fp8_e4m3", "reference", marks=pytest.mark.slow),
    ],
)
def test_layer_loop_never_copies_an_8bit_pool_or_a_layer_of_it(fmt_name, backend):
    """As tests/test_layer_loop.py for the float pool: the 8-bit values and the int8 scales
    are carried through the layer loop and updated in place, no pool-sized copy and no
    array of one layer's page shape (of any dtype) in the optimized HLO."""
    import dataclasses
    import re

    from pagedjax.model import allocate_kv_cache, dummy_input, preset_arch, random_params
    from pagedjax.model.forward import forward

    arch = dataclasses.replace(preset_arch("tiny-llama"), num_layers=3, layer_windows=())
    nb, bs = 1024, 16
    fn = {"native_cpu": native_cpu.ragged_paged_attention,
          "reference": ragged_paged_attention}[backend]  # fmt: skip
    params = jax.eval_shape(lambda: random_params(arch, dtype=jnp.float32))
    kv = jax.eval_shape(lambda: allocate_kv_cache(arch, nb, bs, kv_cache_dtype=fmt_name))
    step = jax.jit(functools.partial(forward, arch=arch, attention_fn=fn), donate_argnums=1)
    compiled = step.lower(params, kv, dummy_input(32, 4, 8)).compile()
    hlo = compiled.as_text()
    page = f"{nb},{arch.num_kv_heads},{bs}"
    pool = rf"\w+\[{arch.num_layers},{page},(\d+)\]"
    layer = rf"= \w+\[(1,)?{page},(\d+)\]\{{"
    bad = [ln.strip()[:160] for ln in hlo.splitlines()
           if re.search(rf"= {pool}\{{[^}}]*\}} copy\(", ln) or re.search(layer, ln)]  # fmt: skip
    assert "while" in hlo and bad == []
    mem = compiled.memory_analysis()
    pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kv))
    assert mem.alias_size_in_bytes >= pool_bytes  # values (and scales) updated in place
    assert mem.temp_size_in_bytes < nb * arch.num_kv_heads * bs * arch.head_dim


@pytest.mark.slow  # the kernel suite (tests/kernels) checks it against the dense reference
def test_pallas_kernel_equals_the_xla_reference_on_the_same_8bit_pool():
    """The Pallas Mosaic GPU kernel (GPU interpreter, race detection on), reached through
    the backend switch with the engine's QuantizedPages pool, against the XLA reference on
    that same pool: relative error under 1e-2 (the kernel rounds pages and P to bf16)."""
    from pagedjax.attention import select_attention_backend
    from pallas_kernels.paged_attention import default_interpret

    case = (4, 2, 16, 64, None, None, (1, 5, 1), (17, 40, 1))
    q, (kq, vq), _, meta, _ = _build(case, "int8_per_token_head", seed=3)
    q = q.astype(jnp.bfloat16)
    pallas = select_attention_backend("pallas").ragged_paged_attention
    got = pallas(q, kq, vq, *meta, layer=jnp.int32(LAYER), sm_scale=0.125, num_splits=1,
                 interpret=default_interpret())  # fmt: skip
    want = ragged_paged_attention(q, kq, vq, *meta, layer=jnp.int32(LAYER), sm_scale=0.125)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
