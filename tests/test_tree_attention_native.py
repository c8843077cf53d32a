"""Draft-tree masks (``tree_mask``) in the native CPU kernel (cpu_kernel.cc), against the
numpy oracle of tests/tree_cases.py and the XLA version, fp32 and 8-bit pages.

The kernel must build where a compiler is (tests/test_attention_native.py asserts it), so
these compare the kernel with the oracle, not the XLA fallback with itself; one test checks
that the custom call is what runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import native_build
from pagedjax.attention import kv_quant, native_cpu, ragged_paged_attention
from pallas_kernels.cases import tree_and_chain
from tests.tree_cases import ALL_BITS, tree_case, tree_oracle, tree_words

pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler")

SCALE = 0.3


@jax.jit
def _native(q, k, v, tables, kv_lens, cu, tree_mask, window=None):
    return native_cpu.ragged_paged_attention(
        q, k, v, tables, kv_lens, cu, sm_scale=SCALE, sliding_window=window, tree_mask=tree_mask
    )


@jax.jit
def _xla(q, k, v, tables, kv_lens, cu, tree_mask, window=None):
    return ragged_paged_attention(
        q, k, v, tables, kv_lens, cu, sm_scale=SCALE, sliding_window=window, tree_mask=tree_mask,
        chunk_keys=8, chunk_bytes=1 << 14,
    )  # fmt: skip


def _jnp(case, words="same"):
    *arrays, own = case
    words = own if isinstance(words, str) else words
    return (*map(jnp.asarray, arrays), None if words is None else jnp.asarray(words))


def _random_seqs(data, max_prefix=48):  # tree_case(pad=True) tables hold 80 tokens
    seqs = []
    for _ in range(data.draw(st.integers(1, 3))):
        prefix = data.draw(st.integers(0, max_prefix))
        if data.draw(st.booleans()):
            n = data.draw(st.integers(1, 12))
            seqs.append((prefix, [-1] + [data.draw(st.integers(-1, j - 1)) for j in range(1, n)]))
        else:
            seqs.append((prefix, data.draw(st.integers(1, 32))))  # a causal chunk
    return seqs


@given(data=st.data())
@settings(max_examples=15, deadline=None)
def test_native_tree_rows_match_the_oracle(data):
    """Random trees beside plain prefill / decode rows: the kernel equals the numpy oracle
    (exactly the prefix and the ancestors) and the XLA version."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    case = tree_case(rng, _random_seqs(data), pad=True)
    got = np.asarray(_native(*_jnp(case)))
    np.testing.assert_allclose(got, tree_oracle(*case, scale=SCALE), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, np.asarray(_xla(*_jnp(case))), rtol=2e-5, atol=2e-5)
    assert not got[case[5][-1] :].any(), "padding rows must be 0"


@given(data=st.data())
@settings(max_examples=8, deadline=None)
def test_native_tree_rows_under_a_sliding_window_match_xla(data):
    """The tree mask ANDs with the window: keys beyond it stay hidden even when their bit
    is set (windows 3..40, a traced scalar as under the layer loop: one compilation)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    case = tree_case(rng, _random_seqs(data), pad=True)
    window = jnp.int32(data.draw(st.sampled_from([3, 9, 40])))
    got = np.asarray(_native(*_jnp(case), window=window))
    want = np.asarray(_xla(*_jnp(case), window=window))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_native_chain_mask_is_the_causal_rule_bit_for_bit():
    """A chain (each node the child of the previous) gives the kernel's no-mask output
    exactly: tree verification equals chain verification on the same tokens. Prefixes put
    the chain across page boundaries and past 32 keys back."""
    rng = np.random.default_rng(0)
    case = tree_case(rng, [(13, [-1, 0, 1, 2, 3]), (0, 7), (30, list(range(-1, 39)))])
    np.testing.assert_array_equal(
        np.asarray(_native(*_jnp(case))), np.asarray(_native(*_jnp(case, None)))
    )
    all_bits = np.full_like(case[-1], ALL_BITS)
    np.testing.assert_array_equal(
        np.asarray(_native(*_jnp(case, all_bits))), np.asarray(_native(*_jnp(case, None)))
    )


def test_native_siblings_do_not_see_each_other():
    rng = np.random.default_rng(1)
    case = list(tree_case(rng, [(9, [-1, -1, 1])], block_size=4))
    before = np.asarray(_native(*_jnp(case)))
    k = case[1].copy()
    k[case[3][0][9 // 4], :, 9 % 4] += 5.0  # the first sibling's key (slot 9)
    case[1] = k
    after = np.asarray(_native(*_jnp(case)))
    np.testing.assert_array_equal(before[1:], after[1:])  # the sibling and its child
    assert not np.allclose(before[0], after[0])


@pytest.mark.parametrize("fmt_name", ["int8_per_token_head", "fp8_e4m3"])
def test_native_tree_mask_over_8bit_pages_matches_xla(fmt_name):
    """The 8-bit handler reads the same tree words: equal to the XLA version over the same
    quantized pool (stacked as one layer)."""
    rng = np.random.default_rng(2)
    parents = [-1, 0, 0, 1, -1, 4, 2]
    q, k, v, tables, kv_lens, cu, words = tree_case(rng, [(21, parents), (5, 3), (40, 1)])
    fmt = kv_quant.resolve_kv_format(fmt_name)
    pools = []
    for pages in (k, v):
        x = jnp.asarray(pages)[None]
        if fmt.per_token:
            pools.append(kv_quant.QuantizedPages(*kv_quant.quantize(x, fmt), fmt))
        else:
            values, _ = kv_quant.quantize(x, fmt, jnp.ones((x.shape[2], 1, 1)))
            scale = kv_quant.default_layer_scale(1, x.shape[2])
            pools.append(kv_quant.QuantizedPages(values, None, fmt, scale))
    args = (jnp.asarray(q), *pools, *map(jnp.asarray, (tables, kv_lens, cu)))
    opts = dict(layer=jnp.int32(0), sm_scale=SCALE, tree_mask=jnp.asarray(words))
    got = np.asarray(native_cpu.ragged_paged_attention(*args, **opts))
    want = np.asarray(ragged_paged_attention(*args, **opts))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    chain = np.asarray(native_cpu.ragged_paged_attention(*args, layer=jnp.int32(0), sm_scale=SCALE))
    assert not np.allclose(got, chain)  # the mask changed something


def test_native_runs_the_custom_call_with_a_tree_and_refuses_a_wrong_length():
    rng = np.random.default_rng(3)
    case = tree_case(rng, [(3, [-1, 0, 0])])
    lowered = _native.lower(*_jnp(case)).as_text()
    assert native_cpu.TARGET in lowered
    with pytest.raises(ValueError, match="tree_mask must be uint32"):
        *args, _ = _jnp(case)
        native_cpu.ragged_paged_attention(
            *args, sm_scale=SCALE, tree_mask=jnp.asarray(tree_words([-1, 0]))
        )


@pytest.mark.parametrize("leaf", [3, 8])
def test_native_tree_verification_equals_chain_verification(leaf):
    """The accepted path of a 9-node tree (siblings interleaved with it) verified as a tree
    equals the same tokens verified as a causal chain, row for row (pallas_kernels.cases
    .tree_and_chain): the mask hides exactly the other branches."""
    rng = np.random.default_rng(leaf)
    parents = [-1, 0, -1, 1, 2, 4, 3, 5, 6]
    tree, words, chain, path = tree_and_chain(
        rng, prefix=13, parents=parents, leaf=leaf, num_q_heads=4, num_kv_heads=2,
        head_dim=16, block_size=4,
    )  # fmt: skip
    fields = ("q", "k_pages", "v_pages", "block_tables", "kv_lens", "cu_q_lens")
    t_args = [jnp.asarray(getattr(tree, f)) for f in fields]
    c_args = [jnp.asarray(getattr(chain, f)) for f in fields]
    got = np.asarray(native_cpu.ragged_paged_attention(*t_args, sm_scale=SCALE,
                                                       tree_mask=jnp.asarray(words)))  # fmt: skip
    want = np.asarray(native_cpu.ragged_paged_attention(*c_args, sm_scale=SCALE))
    np.testing.assert_allclose(got[path], want[: len(path)], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[-1], want[-1])  # the decode row beside it
    assert np.isfinite(got).all()
