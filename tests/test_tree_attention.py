"""Draft-tree attention masks (``tree_mask``) in the XLA backends, against numpy.

A tree's nodes sit in consecutive slots after the prefix, parents first; node j sees the
prefix, its ancestors and itself. The oracle gathers exactly those keys per query and
runs a plain softmax, so it shares no masking code with the backends.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.attention.reference import ragged_paged_attention
from pallas_kernels.cases import tree_and_chain
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.tree_cases import tree_case, tree_oracle


def _run_both(case, tree_mask, chunk_keys=4):
    q, k, v, tables, kv_lens, cu, _ = case
    args = tuple(map(jnp.asarray, (q, k, v, tables, kv_lens, cu)))
    tm = None if tree_mask is None else jnp.asarray(tree_mask)
    ragged = ragged_paged_attention(
        *args, sm_scale=0.3, tree_mask=tm, chunk_keys=chunk_keys, chunk_bytes=1 << 12
    )
    dense = ragged_paged_attention_reference(*args, sm_scale=0.3, tree_mask=tm)
    return np.asarray(ragged), np.asarray(dense)


@given(data=st.data())
@settings(max_examples=12, deadline=None)
def test_tree_rows_see_the_prefix_and_their_ancestors_only(data):
    """Random trees beside plain prefill / decode rows in one ragged batch: both XLA
    backends equal the numpy oracle that gathers exactly the prefix and the ancestors."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    seqs = []
    for _ in range(data.draw(st.integers(1, 3))):
        prefix = data.draw(st.integers(0, 48))
        if data.draw(st.booleans()):
            n = data.draw(st.integers(1, 12))
            parents = [-1] + [data.draw(st.integers(-1, j - 1)) for j in range(1, n)]
            seqs.append((prefix, parents))
        else:
            seqs.append((prefix, data.draw(st.integers(1, 32))))  # causal chunk
    case = tree_case(rng, seqs, pad=True)
    want = tree_oracle(*case, scale=0.3)
    ragged, dense = _run_both(case, case[-1])
    n = case[5][-1]  # padding rows are 0 in both; the oracle leaves them 0
    np.testing.assert_allclose(ragged, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dense, want, rtol=2e-5, atol=2e-5)
    assert not ragged[n:].any()


def test_a_chain_mask_is_the_causal_rule_bit_for_bit():
    """A tree that is a chain (every node the child of the one before) gives the same
    output as no mask, exactly: chain verification and tree verification agree."""
    rng = np.random.default_rng(0)
    case = tree_case(rng, [(13, [-1, 0, 1, 2, 3]), (0, 7), (30, [-1, 0, 1])])
    with_mask = _run_both(case, case[-1])
    without = _run_both(case, None)
    for a, b in zip(with_mask, without, strict=True):
        np.testing.assert_array_equal(a, b)


def test_siblings_do_not_see_each_other():
    """Two children of the prefix: the second's output does not move when the first's
    key changes (it would under the causal rule)."""
    rng = np.random.default_rng(1)
    case = list(tree_case(rng, [(9, [-1, -1])], block_size=4))
    words = case[-1]
    before, _ = _run_both(case, words)
    k = case[1].copy()
    table = case[3][0]
    k[table[9 // 4], :, 9 % 4] += 5.0  # the first sibling's key (slot 9)
    case[1] = k
    after, _ = _run_both(case, words)
    np.testing.assert_array_equal(before[1], after[1])
    assert not np.allclose(before[0], after[0])


def test_a_mask_of_the_wrong_length_is_refused():
    rng = np.random.default_rng(2)
    q, k, v, tables, kv_lens, cu, words = tree_case(rng, [(3, [-1, 0])])
    with pytest.raises(ValueError, match="tree_mask must be uint32"):
        ragged_paged_attention(
            *map(jnp.asarray, (q, k, v, tables, kv_lens, cu)),
            sm_scale=0.3,
            tree_mask=jnp.asarray(words[:1]),
        )


def test_tree_verification_equals_chain_verification():
    """The accepted path of a 9-node tree (other branches interleaved, NaN in every free
    slot) verified with its mask equals the same tokens verified as a causal chain
    (pallas_kernels.cases.tree_and_chain), in both XLA backends."""
    parents = [-1, 0, -1, 1, 2, 4, 3, 5, 6]
    tree, words, chain, path = tree_and_chain(
        np.random.default_rng(3), prefix=13, parents=parents, leaf=8, num_q_heads=4,
        num_kv_heads=2, head_dim=8, block_size=4,
    )  # fmt: skip
    got = _run_both(_padded(tree, words), words_padded := _pad_words(words))
    # the chain with all bits: no mask, bit for bit (the test above), one compilation
    want = _run_both(_padded(chain, None), np.full(16, 0xFFFFFFFF, np.uint32))
    assert words_padded.shape == (16,)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g[path], w[: len(path)], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g[len(words) - 1], w[len(path)], rtol=1e-5, atol=1e-6)


def _pad_words(words):
    return np.concatenate([words, np.full(16 - len(words), 0xFFFFFFFF, np.uint32)])


def _padded(case, words):
    """A tree_and_chain case on fixed shapes (16 rows, 12 blocks, 8-page tables; NaN
    blocks and padding rows), so both cases share one compilation per backend."""
    q = np.zeros((16, *case.q.shape[1:]), np.float32)
    q[: len(case.q)] = case.q
    pools = []
    for pages in (case.k_pages, case.v_pages):
        pad = np.full((12 - len(pages), *pages.shape[1:]), np.nan, np.float32)
        pools.append(np.concatenate([pages, pad]))
    tables = np.zeros((2, 8), np.int32)
    tables[:, : case.block_tables.shape[1]] = case.block_tables
    return (q, *pools, tables, case.kv_lens, case.cu_q_lens, words)
