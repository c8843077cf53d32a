"""Draft-tree masks through the backend switch (pagedjax.attention.backends): every backend
callable takes ``tree_mask``; "auto" on an H200 sends it to the XLA reference with the
inputs the Mosaic kernel refuses, and the Pallas backend runs 8-bit pools with a tree
(``with_8bit_pages`` forwards it), equal to the reference on the same pool."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np

from pagedjax.attention import kv_quant, reference, select_attention_backend
from pallas_kernels import parity
from pallas_kernels.cases import tree_words
from pallas_kernels.paged_attention import default_interpret


def _batch(rng, dtype, head_dim, kv_heads=2, q_heads=4):
    """A 5-node tree after a 14-token prefix beside a decode row; stacked one-layer pool."""
    words = np.concatenate([tree_words([-1, 0, -1, 2, 1]), [0xFFFFFFFF]]).astype(np.uint32)
    q = jnp.asarray(rng.normal(size=(6, q_heads, head_dim)), dtype)
    pool = [jnp.asarray(rng.normal(size=(1, 5, kv_heads, 8, head_dim)), jnp.float32)
            for _ in range(2)]  # fmt: skip
    meta = (jnp.array([[1, 2, 3], [4, 0, 0]], jnp.int32), jnp.array([19, 7], jnp.int32),
            jnp.array([0, 5, 6], jnp.int32))  # fmt: skip
    return q, pool, meta, jnp.asarray(words)


def test_auto_on_an_h200_sends_a_tree_to_the_reference_where_the_kernel_refuses(monkeypatch):
    monkeypatch.setattr(parity, "H200_PARITY_VERIFIED", True)
    h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    auto = select_attention_backend("auto", device=h200)
    q, (k, v), meta, words = _batch(np.random.default_rng(0), jnp.float32, 32)
    kw = dict(layer=jnp.int32(0), sm_scale=0.2, tree_mask=words)
    got = np.asarray(auto.ragged_paged_attention(q, k, v, *meta, **kw))
    np.testing.assert_array_equal(
        got, np.asarray(reference.ragged_paged_attention(q, k, v, *meta, **kw))
    )
    causal = np.asarray(
        reference.ragged_paged_attention(q, k, v, *meta, layer=jnp.int32(0), sm_scale=0.2)
    )
    assert not np.allclose(got, causal)  # the mask reached the reference


def test_auto_on_an_h200_keeps_trees_on_the_reference_until_verified(monkeypatch):
    """The Mosaic kernel's tree path is interpreted and cross-lowered only: "auto" runs a
    step with a tree mask on the XLA reference until parity.H200_TREE_PARITY_VERIFIED,
    and on the kernel after (a recording stand-in for the kernel here)."""
    from pallas_kernels import paged_attention

    calls = []

    def fake_kernel(q, *args, **kwargs):
        calls.append(kwargs.get("tree_mask") is not None)
        return jnp.zeros_like(q)

    monkeypatch.setattr(paged_attention, "ragged_paged_attention", fake_kernel)
    monkeypatch.setattr(parity, "H200_PARITY_VERIFIED", True)
    h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    q, (k, v), meta, words = _batch(np.random.default_rng(2), jnp.bfloat16, 64)
    k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    kw = dict(layer=jnp.int32(0), sm_scale=0.125)
    for verified, want_calls in ((False, [False]), (True, [False, True])):
        monkeypatch.setattr(parity, "H200_TREE_PARITY_VERIFIED", verified)
        attend = select_attention_backend("auto", device=h200).ragged_paged_attention
        attend(q, k, v, *meta, **kw)  # no mask: the kernel
        got = attend(q, k, v, *meta, tree_mask=words, **kw)
        assert calls == want_calls
        calls.clear()
        if not verified:
            want = reference.ragged_paged_attention(q, k, v, *meta, tree_mask=words, **kw)
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_pallas_backend_runs_an_8bit_pool_with_a_tree():
    """select_attention_backend("pallas") on an int8 QuantizedPages pool with a tree mask
    (interpreted): the kernel's kv_format path with the row words, equal to the XLA
    reference on the same quantized pool within bf16 rounding."""
    rng = np.random.default_rng(1)
    q, pool, meta, words = _batch(rng, jnp.bfloat16, 64, kv_heads=1, q_heads=2)
    fmt = kv_quant.resolve_kv_format("int8_per_token_head")
    k, v = (kv_quant.QuantizedPages(*kv_quant.quantize(x, fmt), fmt) for x in pool)
    kw = dict(layer=jnp.int32(0), sm_scale=0.125, tree_mask=words)
    pallas = select_attention_backend("pallas").ragged_paged_attention
    got = np.asarray(pallas(q, k, v, *meta, num_splits=1, interpret=default_interpret(), **kw),
                     np.float32)  # fmt: skip
    want = np.asarray(reference.ragged_paged_attention(q.astype(jnp.float32), k, v, *meta, **kw))
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
