"""The Mosaic GPU kernels on 8-bit pages (fp8 E4M3 / E5M2 bytes with per layer-head scales,
int8 with per-slot scales), in the GPU interpreter with race detection, against the dense
reference run on the *same* pool dequantized (values x scale, in numpy). Quantization here
is plain numpy / jnp (this suite imports nothing from pagedjax): fp8 saturates and keeps
NaN; int8 rows holding NaN get a NaN scale, so every poisoned slot stays poisoned.

The kernel converts each page to bf16/fp16 before wgmma, so the tolerance is the suite's
usual relative 1e-2 (bf16 rounding of the dequantized values and of P)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cases import make_case
from pallas_kernels.paged_attention import (
    KV_FORMATS,
    default_interpret,
    ragged_paged_attention,
)
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.kernels.test_paged_attention import _check

LAYERS, LAYER = 2, 1
MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}


def quantize_pool(pages: np.ndarray, kv_format: str, layer_scale: np.ndarray):
    """pages float32 [N, Hkv, B, D] (NaN = poison) -> (stored [L, N, Hkv, B, D], scale,
    dequantized float32 [N, Hkv, B, D]); layer LAYER holds the data, the other layer NaN /
    garbage, so a wrong layer index shows."""
    storage, element, per_token = KV_FORMATS[kv_format]
    if per_token:
        with np.errstate(invalid="ignore"):
            amax = np.max(np.abs(pages), axis=-1, keepdims=True)
            scale = np.where(amax > 0, amax / MAX[kv_format], 1.0).astype(np.float32)
            q = np.clip(np.round(np.nan_to_num(pages / scale)), -127, 127).astype(np.int8)
        deq = q.astype(np.float32) * scale
        stored = np.stack([np.full_like(q, 7), q]).astype(np.int8)
        scales = np.stack([np.full_like(scale, np.nan), scale])
        return jnp.asarray(stored), jnp.asarray(scales), deq
    s = layer_scale[LAYER][None, :, None, None]
    y = jnp.asarray(np.clip(pages / s, -MAX[kv_format], MAX[kv_format])).astype(element)
    deq = np.asarray(y.astype(jnp.float32)) * s
    data = jax.lax.bitcast_convert_type(y, storage)
    poison = jax.lax.bitcast_convert_type(jnp.full(y.shape, jnp.nan, element), storage)
    return jnp.stack([poison, data]), jnp.asarray(layer_scale, jnp.float32), deq


CASES = [
    # (kv_format, Hq, Hkv, block_size, max_blocks, q_lens, kv_lens, num_tokens, extra)
    pytest.param("int8", 8, 2, 16, 3, [1, 1, 1, 1], [1, 15, 16, 17], 4, {}, id="int8-decode-edges"),
    pytest.param("fp8_e4m3", 4, 2, 16, 5, [5, 1, 3, 0], [40, 1, 64, 0], 12, {},
                 id="e4m3-mixed-pad"),
    pytest.param("fp8_e5m2", 4, 1, 8, 8, [3, 1], [50, 9], 6,
                 {"sliding_window": 20, "soft_cap": 5.0}, id="e5m2-mqa-window-cap"),
]  # fmt: skip


@pytest.mark.parametrize("kv_format,hq,hkv,bs,mb,q_lens,kv_lens,t,extra", CASES)
def test_8bit_pages_match_the_reference_on_the_same_pool(
    kv_format, hq, hkv, bs, mb, q_lens, kv_lens, t, extra
):
    d = 64
    rng = np.random.default_rng(sum(kv_lens) + bs)
    need = sum(-(-n // bs) for n in kv_lens)
    case = make_case(
        rng, q_lens=q_lens, kv_lens=kv_lens, num_tokens=t, num_q_heads=hq,
        num_kv_heads=hkv, head_dim=d, block_size=bs, max_blocks=mb, num_blocks=need + 3,
    )  # fmt: skip
    layer_scale = 0.5 + rng.random((LAYERS, hkv))
    k8, ks, kd = quantize_pool(case.k_pages, kv_format, layer_scale)
    v8, vs, vd = quantize_pool(case.v_pages, kv_format, layer_scale + 0.25)
    q = jnp.asarray(case.q, jnp.bfloat16)
    meta = (jnp.asarray(case.block_tables), jnp.asarray(case.kv_lens),
            jnp.asarray(case.cu_q_lens))  # fmt: skip
    out = ragged_paged_attention(
        q, k8, v8, *meta, layer=jnp.int32(LAYER), sm_scale=d**-0.5, num_splits=1,
        interpret=default_interpret(), kv_format=kv_format, k_scale=ks, v_scale=vs, **extra,
    )  # fmt: skip
    ref = ragged_paged_attention_reference(
        q, jnp.asarray(kd), jnp.asarray(vd), *meta, sm_scale=d**-0.5, **extra
    )
    _check(out, ref, sum(q_lens))


def test_8bit_inputs_are_checked():
    q = jnp.zeros((1, 4, 64), jnp.bfloat16)
    pages = jnp.zeros((1, 2, 2, 16, 64), jnp.uint8)
    args = (q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
            jnp.asarray([0, 1], jnp.int32))  # fmt: skip
    ok = jnp.ones((1, 2), jnp.float32)
    with pytest.raises(ValueError, match="kv_format"):
        ragged_paged_attention(*args, layer=0, sm_scale=1.0, kv_format="int4", k_scale=ok,
                               v_scale=ok)  # fmt: skip
    with pytest.raises(ValueError, match="int8 pages"):
        ragged_paged_attention(*args, layer=0, sm_scale=1.0, kv_format="int8", k_scale=ok,
                               v_scale=ok)  # fmt: skip
    with pytest.raises(ValueError, match="k_scale"):
        ragged_paged_attention(*args, layer=0, sm_scale=1.0, kv_format="fp8_e4m3",
                               k_scale=ok[:, :1], v_scale=ok)  # fmt: skip


@pytest.mark.parametrize("kv_format", sorted(KV_FORMATS))
def test_8bit_pages_lower_to_mosaic_gpu(kv_format):
    """Cross-lowers for CUDA on the CPU (layout inference and lowering; PTX needs a GPU)."""
    import functools

    storage, _, per_token = KV_FORMATS[kv_format]
    hq, hkv, d, bs, m, t, s = 32, 8, 128, 16, 4, 8, 2
    f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=d**-0.5, kv_format=kv_format))
    spec = jax.ShapeDtypeStruct
    pool = spec((3, 16, hkv, bs, d), storage)
    scale = spec((3, 16, hkv, bs, 1) if per_token else (3, hkv), jnp.float32)
    lowered = f.trace(
        spec((t, hq, d), jnp.bfloat16), pool, pool, spec((s, m), jnp.int32),
        spec((s,), jnp.int32), spec((s + 1,), jnp.int32),
        layer=spec((), jnp.int32), k_scale=scale, v_scale=scale,
    ).lower(lowering_platforms=("cuda",))  # fmt: skip
    assert "mosaic_gpu" in lowered.as_text()
