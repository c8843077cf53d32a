"""The jax-triton binding (pallas_kernels.triton.jax_binding) against stand-ins for
jax-triton's triton_call: what it hands jax-triton (arrays, their order, scalar strides,
grid, zeroed outputs, constexprs) and, through a stand-in that runs the call in Triton's
interpreter the way jax-triton lays it out, the numbers it gets back. Real lowering and
execution happen only in the GPU check."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")


def test_single_split_call_layout_and_numerics(interp_worker):
    # T=12 tokens of S=4 sequences (one padding sequence, 3 padding tokens), Hq 4 / Hkv 2,
    # D 32, pages of 16, tables of 5, pool [2 layers, 11 blocks, 2, 16, 32], layer 1.
    spec = dict(q_lens=[5, 1, 3, 0], kv_lens=[40, 1, 64, 0], num_tokens=12, max_blocks=5)
    r = interp_worker.run("binding", spec)
    assert r["finite"] and r["padding_max_abs"] == 0.0 and r["rel_err"] < 2e-3, r
    assert r["out_shape"] == [12, 4, 32] and r["out_dtype"] == "float16"
    (call,) = r["calls"]
    assert call["kernel"] == "paged_attention_kernel"
    # prefill tiles on sm_80: block_m 64 -> 32 tokens of the GQA group of 2 per tile;
    # 12 // 32 + 4 = 4 query tiles, 2 KV heads, 1 split
    assert call["grid"] == [4, 2, 1]
    # q, the pools, the (unread) scale buffers of a float pool, [layer, window], tables,
    # kv_lens, cu_q_lens, the (unread) tree words
    assert call["array_shapes"] == [
        [12, 4, 32], [2, 11, 2, 16, 32], [2, 11, 2, 16, 32], [1], [1], [2], [4, 5], [4], [5],
        [1],
    ]  # fmt: skip
    assert call["array_dtypes"] == ["float16"] * 3 + ["float32"] * 2 + ["int32"] * 5
    assert call["constexprs"]["USE_TREE"] is False
    # q strides (128, 32); pool (11264, 1024, 512, 32); scales (0, 0, 0, 0): none read;
    # table row 5; out (0, 128, 32); lse unused (0, 0); S = 4; M = 5
    assert call["scalars"] == [128, 32, 11264, 1024, 512, 32, 0, 0, 0, 0, 5, 0, 128, 32, 0, 0,
                               4, 5]  # fmt: skip
    assert call["constexprs"]["KV_FORMAT"] == "none"
    assert call["out_shapes"] == [[12, 4, 32], [1]]
    assert call["zeroed_outputs"] == [0], "padding tokens are never written: output zeroed"
    c = call["constexprs"]
    assert (c["GROUP"], c["GROUP_PAD"], c["BLOCK_Q"], c["NUM_SPLITS"]) == (2, 2, 32, 1)
    assert c["SM_SCALE"] == pytest.approx(32**-0.5) and c["HEAD_DIM_PAD"] == 32


def test_split_decode_call_layout_and_numerics(interp_worker):
    spec = dict(q_lens=[1, 1, 1, 1], kv_lens=[1, 15, 16, 17], num_tokens=4, num_q_heads=8,
                num_kv_heads=2, max_blocks=3, num_splits=2, dtype="float32")  # fmt: skip
    r = interp_worker.run("binding", spec)
    assert r["finite"] and r["rel_err"] < 1e-5, r
    attend, merge = r["calls"]
    assert attend["kernel"] == "paged_attention_kernel"
    assert attend["grid"] == [4 // 4 + 4, 2, 2]  # decode tiles: block_m 16 / group 4
    assert attend["out_shapes"] == [[2, 4, 8, 32], [2, 4, 8]]  # fp32 partials and lse
    assert attend["scalars"][11:16] == [1024, 256, 32, 32, 8]  # partial and lse strides
    assert attend["zeroed_outputs"] == []
    assert merge["kernel"] == "merge_splits_kernel"
    assert merge["grid"] == [4, 8]
    assert merge["array_shapes"] == [[2, 4, 8, 32], [2, 4, 8], [5]]
    assert merge["scalars"] == [1024, 256, 32, 32, 8, 256, 32, 4]
    assert merge["out_shapes"] == [[4, 8, 32]]
    assert merge["constexprs"]["NUM_SPLITS"] == 2 and merge["constexprs"]["SPLITS_PAD"] == 2


def _recording_module(spelling: str, calls: list) -> types.ModuleType:
    """A jax_triton stand-in whose triton_call only records and returns zeros."""

    def zeros(shapes):
        return [jnp.zeros(s.shape, s.dtype) for s in shapes]

    if spelling == "out_shape":  # jax-triton 0.3.x

        def triton_call(*args, kernel, out_shape, grid, **kw):
            calls.append(dict(args=args, grid=grid, kw=kw))
            return zeros(out_shape)
    else:  # 0.4.x

        def triton_call(*args, kernel, out_type, grid, **kw):
            calls.append(dict(args=args, grid=grid, kw=kw))
            return zeros(out_type)

    mod = types.ModuleType("jax_triton")
    mod.triton_call = triton_call
    return mod


def _inputs(layers=3, blocks=6, seqs=2, tokens=2):
    q = jnp.ones((tokens, 8, 64), jnp.bfloat16)
    pool = jnp.ones((layers, blocks, 2, 16, 64), jnp.bfloat16)
    bt = jnp.zeros((seqs, 4), jnp.int32)
    kv = jnp.full((seqs,), 5, jnp.int32)
    cu = jnp.arange(seqs + 1, dtype=jnp.int32)
    return q, pool, bt, kv, cu


@pytest.mark.parametrize("spelling", ["out_shape", "out_type"])
def test_both_jax_triton_spellings_and_a_traced_layer(monkeypatch, spelling):
    from pallas_kernels.triton.jax_binding import triton_paged_attention

    calls: list = []
    monkeypatch.setitem(sys.modules, "jax_triton", _recording_module(spelling, calls))
    q, pool, bt, kv, cu = _inputs()

    @jax.jit
    def step(layer):  # the layer index is traced, as under the layer loop's fori_loop
        return triton_paged_attention(q, pool, pool, layer, bt, kv, cu, sm_scale=0.125,
                                      num_splits=1)  # fmt: skip

    out = step(jnp.int32(2))
    assert out.shape == q.shape and out.dtype == q.dtype

    @jax.jit
    def windowed(layer, window):  # per-layer windows arrive traced too
        return triton_paged_attention(q, pool, pool, layer, bt, kv, cu, sm_scale=0.125,
                                      sliding_window=window, num_splits=1)  # fmt: skip

    windowed(jnp.int32(1), jnp.int32(4096))
    plain, with_window = calls
    run_scalars = plain["args"][5]  # [layer, window]
    assert run_scalars.shape == (2,) and run_scalars.dtype == jnp.int32
    assert plain["kw"]["zeroed_outputs"] == (0,)
    assert plain["kw"]["USE_WINDOW"] is False and with_window["kw"]["USE_WINDOW"] is True


def test_missing_jax_triton_names_the_extra(monkeypatch):
    from pallas_kernels.triton.jax_binding import triton_paged_attention

    monkeypatch.setitem(sys.modules, "jax_triton", None)  # import raises ImportError
    q, pool, bt, kv, cu = _inputs()
    with pytest.raises(ImportError, match=r"pagedjax\[triton\]"):
        triton_paged_attention(q, pool, pool, 0, bt, kv, cu, sm_scale=0.125)


def test_engine_contract_adapter(monkeypatch):
    """pagedjax.attention's signature: the stacked pool with layer=, or 4-D pages with
    layer=None (a one-layer pool, layer 0); the pool is never sliced."""
    from pallas_kernels.triton.jax_binding import ragged_paged_attention

    calls: list = []
    monkeypatch.setitem(sys.modules, "jax_triton", _recording_module("out_shape", calls))
    q, pool, bt, kv, cu = _inputs(layers=3)
    ragged_paged_attention(q, pool, pool, bt, kv, cu, layer=jnp.int32(2), sm_scale=0.125)
    args = calls[-1]["args"]
    assert args[1].shape == (3, 6, 2, 16, 64) and np.asarray(args[5]).tolist() == [2, 0]
    ragged_paged_attention(q, pool[0], pool[0], bt, kv, cu, sm_scale=0.125)
    args = calls[-1]["args"]
    assert args[1].shape == (1, 6, 2, 16, 64) and np.asarray(args[5]).tolist() == [0, 0]
    with pytest.raises(ValueError, match="layer"):
        ragged_paged_attention(q, pool, pool, bt, kv, cu, sm_scale=0.125)
    with pytest.raises(ValueError, match="layer=None"):
        ragged_paged_attention(q, pool[0], pool[0], bt, kv, cu, layer=0, sm_scale=0.125)
    # 8-bit pools: the stacked pool only, scales passed through untouched
    k8 = pool.astype(jnp.int8)
    scale = jnp.ones((*k8.shape[:4], 1), jnp.float32)
    ragged_paged_attention(q, k8, k8, bt, kv, cu, layer=jnp.int32(1), sm_scale=0.125,
                           kv_format="int8", k_scale=scale, v_scale=2 * scale)  # fmt: skip
    args = calls[-1]["args"]
    assert args[1].dtype == jnp.int8 and args[3].shape == scale.shape
    assert float(args[4].max()) == 2.0 and calls[-1]["kw"]["KV_FORMAT"] == "int8"
    with pytest.raises(ValueError, match="stacked 5-D pool"):
        ragged_paged_attention(q, k8[0], k8[0], bt, kv, cu, sm_scale=0.125, kv_format="int8",
                               k_scale=scale[0], v_scale=scale[0])  # fmt: skip


def test_rejects_bad_inputs():
    from pallas_kernels.triton.jax_binding import triton_paged_attention

    q, pool, bt, kv, cu = _inputs()
    f = lambda *a, **k: triton_paged_attention(*a, sm_scale=0.125, **k)
    with pytest.raises(ValueError, match="num_layers"):
        f(q, pool[0], pool[0], 0, bt, kv, cu)  # a per-layer slice, not the stacked pool
    with pytest.raises(ValueError, match="share a dtype"):
        f(q.astype(jnp.float32), pool, pool, 0, bt, kv, cu)
    with pytest.raises(ValueError, match="int32"):
        f(q, pool, pool, 0, bt.astype(jnp.float32), kv, cu)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        f(q[:, :3], pool, pool, 0, bt, kv, cu)
    with pytest.raises(ValueError, match="cu_q_lens"):
        f(q, pool, pool, 0, bt, kv, cu[:-1])
    with pytest.raises(ValueError, match="sliding_window"):
        f(q, pool, pool, 0, bt, kv, cu, sliding_window=0)
    # 8-bit pools: bytes of the named format, float32 scales of the format's shape
    u8 = pool.astype(jnp.uint8)
    layer_scale = jnp.ones((3, 2), jnp.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        f(q, u8, u8, 0, bt, kv, cu)  # bytes without a kv_format
    with pytest.raises(ValueError, match="kv_format must be one of"):
        f(q, u8, u8, 0, bt, kv, cu, kv_format="fp8", k_scale=layer_scale, v_scale=layer_scale)
    with pytest.raises(ValueError, match="pools must be uint8"):
        f(q, pool, pool, 0, bt, kv, cu, kv_format="fp8_e4m3", k_scale=layer_scale,
          v_scale=layer_scale)  # fmt: skip
    with pytest.raises(ValueError, match=r"v_scale must be float32\[3, 2\]"):
        f(q, u8, u8, 0, bt, kv, cu, kv_format="fp8_e5m2", k_scale=layer_scale,
          v_scale=layer_scale[:, :1])  # fmt: skip
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        f(q, u8.astype(jnp.int8), u8.astype(jnp.int8), 0, bt, kv, cu, kv_format="int8")
