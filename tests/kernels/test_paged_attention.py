"""Mosaic GPU paged attention kernels, run in the GPU interpreter (CPU) against the
dense-gather reference; plus a check that they lower to Mosaic GPU for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cases import make_case
from pallas_kernels.paged_attention import (
    default_interpret,
    paged_decode_attention,
    ragged_paged_attention,
)
from pallas_kernels.reference import (
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)


def _races_found() -> bool:
    # jax 0.12 raises on a race (on_race="raise"); 0.11.2 only sets this flag.
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    races = getattr(gpu_callbacks, "_races", None)
    return bool(races is not None and getattr(races, "races_found", False))


def _check(out: jax.Array, ref: jax.Array, live_tokens: int) -> None:
    o = np.asarray(out, np.float32)
    r = np.asarray(ref, np.float32)
    assert not np.isnan(o).any(), "NaN leaked from poisoned pages"
    assert not _races_found(), "GPU interpreter reported a race"
    np.testing.assert_array_equal(o[live_tokens:], 0.0)  # padding tokens
    err = np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-6)
    assert err < 1e-2, f"relative error {err}"


def _args(case, dtype):
    return (
        jnp.asarray(case.q, dtype),
        jnp.asarray(case.k_pages, dtype),
        jnp.asarray(case.v_pages, dtype),
        jnp.asarray(case.block_tables),
        jnp.asarray(case.kv_lens),
    )


DECODE = [
    # (Hq, Hkv, D, block_size, max_blocks, kv_lens, num_splits, dtype, extra)
    pytest.param(8, 2, 64, 16, 3, [1, 15, 16, 17], 1, jnp.bfloat16, {}, id="gqa4-b16-edges"),
    pytest.param(4, 1, 64, 8, 8, [7, 9, 0, 64], 2, jnp.bfloat16, {}, id="mqa-b8-pad-split2"),
    pytest.param(2, 2, 64, 128, 2, [129, 127], 1, jnp.float16, {}, id="mha-b128-fp16"),
    pytest.param(4, 2, 128, 32, 64, [2000], 4, jnp.bfloat16, {}, id="long2k-split4-d128"),
    pytest.param(
        4, 2, 64, 16, 4, [50, 3], 1, jnp.bfloat16,
        {"sliding_window": 20, "soft_cap": 5.0}, id="window-softcap",
    ),
]  # fmt: skip


@pytest.mark.parametrize("hq,hkv,d,bs,mb,kv_lens,splits,dtype,extra", DECODE)
def test_decode_matches_reference(hq, hkv, d, bs, mb, kv_lens, splits, dtype, extra):
    rng = np.random.default_rng(sum(kv_lens) + bs)
    need = sum(-(-n // bs) for n in kv_lens)
    case = make_case(
        rng, q_lens=[1 if n else 0 for n in kv_lens], kv_lens=kv_lens,
        num_tokens=len(kv_lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        block_size=bs, max_blocks=mb, num_blocks=need + 3,
    )  # fmt: skip
    args = _args(case, dtype)
    out = paged_decode_attention(
        *args, sm_scale=d**-0.5, num_splits=splits, interpret=default_interpret(), **extra
    )
    ref = paged_decode_attention_reference(*args, sm_scale=d**-0.5, **extra)
    _check(out, ref, len(kv_lens))
    dead = [i for i, n in enumerate(kv_lens) if n == 0]
    np.testing.assert_array_equal(np.asarray(out, np.float32)[dead], 0.0)


RAGGED = [
    # (Hq, Hkv, D, block_size, max_blocks, q_lens, kv_lens, num_tokens, dtype, extra)
    pytest.param(4, 2, 64, 16, 5, [5, 1, 3, 0], [40, 1, 64, 0], 12, jnp.bfloat16, {},
                 id="mixed-pad-tokens"),
    pytest.param(8, 2, 64, 8, 9, [20], [70], 20, jnp.bfloat16, {}, id="chunked-prefill-b8"),
    pytest.param(2, 2, 64, 32, 2, [33, 1], [33, 32], 40, jnp.float16, {}, id="prefill-fp16"),
    pytest.param(4, 1, 64, 16, 6, [17, 2], [90, 2], 19, jnp.bfloat16,
                 {"sliding_window": 24}, id="window-prefill"),
]  # fmt: skip


@pytest.mark.parametrize("hq,hkv,d,bs,mb,q_lens,kv_lens,t,dtype,extra", RAGGED)
def test_ragged_matches_reference(hq, hkv, d, bs, mb, q_lens, kv_lens, t, dtype, extra):
    rng = np.random.default_rng(sum(kv_lens) + 7 * bs)
    need = sum(-(-n // bs) for n in kv_lens)
    case = make_case(
        rng, q_lens=q_lens, kv_lens=kv_lens, num_tokens=t, num_q_heads=hq,
        num_kv_heads=hkv, head_dim=d, block_size=bs, max_blocks=mb, num_blocks=need + 2,
    )  # fmt: skip
    args = (*_args(case, dtype), jnp.asarray(case.cu_q_lens))
    out = ragged_paged_attention(
        *args, sm_scale=d**-0.5, num_splits=1, interpret=default_interpret(), **extra
    )
    ref = ragged_paged_attention_reference(*args, sm_scale=d**-0.5, **extra)
    _check(out, ref, sum(q_lens))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_random_lengths(seed):
    """Random q/kv lengths (drawn, on fixed shapes) and random page permutations."""
    rng = np.random.default_rng(100 + seed)
    bs, mb, num_seqs, t = 16, 6, 3, 16
    kv_lens = [int(x) for x in rng.integers(0, mb * bs + 1, num_seqs)]
    q_lens = [int(rng.integers(1, min(n, 8) + 1)) if n else 0 for n in kv_lens]
    case = make_case(
        rng, q_lens=q_lens, kv_lens=kv_lens, num_tokens=t, num_q_heads=4,
        num_kv_heads=2, head_dim=64, block_size=bs, max_blocks=mb, num_blocks=num_seqs * mb + 1,
    )  # fmt: skip
    args = (*_args(case, jnp.bfloat16), jnp.asarray(case.cu_q_lens))
    out = ragged_paged_attention(*args, sm_scale=0.125, num_splits=2, interpret=default_interpret())
    ref = ragged_paged_attention_reference(*args, sm_scale=0.125)
    _check(out, ref, sum(q_lens))


def test_rejects_bad_inputs():
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    pages = jnp.zeros((4, 2, 16, 64), jnp.bfloat16)
    bt, kv = jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="bf16/fp16"):
        paged_decode_attention(q.astype(jnp.float32), pages, pages, bt, kv, sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple of 64"):
        paged_decode_attention(q[..., :32], pages[..., :32], pages[..., :32], bt, kv, sm_scale=1.0)
    with pytest.raises(ValueError, match="block_size"):
        paged_decode_attention(q, pages[:, :, :4], pages[:, :, :4], bt, kv, sm_scale=1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, pages, pages, bt.astype(jnp.float32), kv, sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q[:, :3], pages, pages, bt, kv, sm_scale=1.0)


@pytest.mark.parametrize(
    "bs,t,s,extra",
    [(8, 4, 4, {}), (16, 24, 3, {"soft_cap": 30.0, "sliding_window": 64}), (128, 8, 2, {})],
)
def test_lowers_to_mosaic_gpu(bs, t, s, extra):
    """Cross-lowers for CUDA on the CPU: Mosaic GPU layout inference and lowering run
    (PTX compilation does not; that needs the GPU run)."""
    hq, hkv, d, m = 32, 8, 128, 4
    f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=d**-0.5, **extra))
    spec = jax.ShapeDtypeStruct
    lowered = f.trace(
        spec((t, hq, d), jnp.bfloat16),
        spec((16, hkv, bs, d), jnp.bfloat16),
        spec((16, hkv, bs, d), jnp.bfloat16),
        spec((s, m), jnp.int32),
        spec((s,), jnp.int32),
        spec((s + 1,), jnp.int32),
    ).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_stacked_pool_with_traced_layer_and_window():
    """The calling convention of the layer loop: the whole stacked pool [L, N, Hkv, B, D]
    with a traced layer index and a traced sliding window (0: none). Other layers hold NaN
    (poison), so reading the wrong layer shows; the result equals the 4-D case's."""
    rng = np.random.default_rng(5)
    bs, d, kv_lens, q_lens = 16, 64, [40, 3], [4, 1]
    case = make_case(
        rng, q_lens=q_lens, kv_lens=kv_lens, num_tokens=6, num_q_heads=4, num_kv_heads=2,
        head_dim=d, block_size=bs, max_blocks=4, num_blocks=8,
    )  # fmt: skip
    q, k4, v4, bt, kv = _args(case, jnp.bfloat16)
    cu = jnp.asarray(case.cu_q_lens)
    poison = jnp.full((3, *k4.shape), jnp.nan, k4.dtype)
    k5, v5 = poison.at[1].set(k4), poison.at[1].set(v4)

    @jax.jit
    def run(layer, window):
        return ragged_paged_attention(
            q, k5, v5, bt, kv, cu, layer=layer, sm_scale=d**-0.5, sliding_window=window,
            num_splits=1, interpret=default_interpret(),
        )  # fmt: skip

    for window, static in ((0, None), (20, 20)):
        out = run(jnp.int32(1), jnp.int32(window))
        ref = ragged_paged_attention_reference(
            q, k4, v4, bt, kv, cu, sm_scale=d**-0.5, sliding_window=static
        )
        _check(out, ref, sum(q_lens))
        ref5 = ragged_paged_attention_reference(
            q, k5, v5, bt, kv, cu, layer=1, sm_scale=d**-0.5, sliding_window=static
        )
        np.testing.assert_array_equal(np.asarray(ref5), np.asarray(ref))


def test_stacked_pool_lowers_to_mosaic_gpu():
    """The stacked-pool convention cross-lowers for CUDA too (layer and window traced)."""
    hq, hkv, d, bs, m, t, s = 32, 8, 128, 16, 4, 8, 2
    f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=d**-0.5))
    spec = jax.ShapeDtypeStruct
    pool = spec((3, 16, hkv, bs, d), jnp.bfloat16)
    lowered = f.trace(
        spec((t, hq, d), jnp.bfloat16), pool, pool, spec((s, m), jnp.int32),
        spec((s,), jnp.int32), spec((s + 1,), jnp.int32),
        layer=spec((), jnp.int32), sliding_window=spec((), jnp.int32),
    ).lower(lowering_platforms=("cuda",))  # fmt: skip
    assert "mosaic_gpu" in lowered.as_text()
