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
from pallas_kernels.reference import TREE_BITS, ragged_paged_attention_reference

ALL_BITS = 0xFFFFFFFF


def tree_words(parents: list[int]) -> np.ndarray:
    """uint32 word per node of a tree given as parents (-1 = child of the prefix),
    parents before children: bit j - a for each ancestor a and itself, bits above j set."""
    words = []
    for j in range(len(parents)):
        w = (ALL_BITS << (j + 1)) & ALL_BITS
        a = j
        while a >= 0:
            w |= 1 << (j - a)
            a = parents[a]
        words.append(w)
    return np.asarray(words, np.uint32)


def visible_keys(kv_len: int, q_len: int, j: int, word: int) -> list[int]:
    """Key positions query j of a q_len-row sequence sees (the oracle's own reading)."""
    pos = kv_len - q_len + j
    keys = []
    for col in range(pos + 1):
        d = pos - col
        if d >= TREE_BITS or (word >> d) & 1:
            keys.append(col)
    return keys


def numpy_attention(q, k_ctx, v_ctx, keys, scale):
    """q [Hq, D], k_ctx / v_ctx [ctx, Hkv, D] of one sequence, keys: visible positions."""
    hq, _ = q.shape
    hkv = k_ctx.shape[1]
    g = hq // hkv
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(hq):
        k = k_ctx[keys, h // g].astype(np.float64)
        v = v_ctx[keys, h // g].astype(np.float64)
        s = k @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v
    return out


def _case(rng, seqs, block_size=4, hq=4, hkv=2, d=8, pad=False):
    """seqs: list of (prefix_len, parents or None for a plain causal chunk of q_len)."""
    q_lens, kv_lens, words = [], [], []
    for prefix, tree in seqs:
        if isinstance(tree, int):
            q_lens.append(tree)
            words += [ALL_BITS] * tree
        else:
            q_lens.append(len(tree))
            words += list(tree_words(tree))
        kv_lens.append(prefix + q_lens[-1])
    max_blocks = max(-(-n // block_size) for n in kv_lens)
    if pad:  # fixed shapes (3 sequences, 96 rows, 80-token tables): one compilation
        max_blocks, t = 80 // block_size, 96
        q_lens += [0] * (3 - len(seqs))
        kv_lens += [0] * (3 - len(seqs))
        words += [ALL_BITS] * (t - len(words))
    else:
        t = sum(q_lens)
    num_blocks = 1 + len(kv_lens) * max_blocks
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = perm.reshape(len(kv_lens), max_blocks).astype(np.int32)
    k_pages = rng.standard_normal((num_blocks, hkv, block_size, d)).astype(np.float32)
    v_pages = rng.standard_normal((num_blocks, hkv, block_size, d)).astype(np.float32)
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (
        q,
        k_pages,
        v_pages,
        tables,
        np.asarray(kv_lens, np.int32),
        cu,
        np.asarray(words, np.uint32),
    )


def _oracle(q, k_pages, v_pages, tables, kv_lens, cu, words, scale):
    out = np.zeros(q.shape, np.float64)
    for s in range(len(kv_lens)):
        if cu[s + 1] == cu[s]:
            continue
        ctx_k = k_pages[tables[s]].transpose(0, 2, 1, 3).reshape(-1, *k_pages.shape[1::2])
        ctx_v = v_pages[tables[s]].transpose(0, 2, 1, 3).reshape(-1, *v_pages.shape[1::2])
        q_len = cu[s + 1] - cu[s]
        for j in range(q_len):
            t = cu[s] + j
            keys = visible_keys(int(kv_lens[s]), int(q_len), j, int(words[t]))
            out[t] = numpy_attention(q[t], ctx_k, ctx_v, keys, scale)
    return out


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
    case = _case(rng, seqs, pad=True)
    want = _oracle(*case, scale=0.3)
    ragged, dense = _run_both(case, case[-1])
    n = case[5][-1]  # padding rows are 0 in both; the oracle leaves them 0
    np.testing.assert_allclose(ragged, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dense, want, rtol=2e-5, atol=2e-5)
    assert not ragged[n:].any()


def test_a_chain_mask_is_the_causal_rule_bit_for_bit():
    """A tree that is a chain (every node the child of the one before) gives the same
    output as no mask, exactly: chain verification and tree verification agree."""
    rng = np.random.default_rng(0)
    case = _case(rng, [(13, [-1, 0, 1, 2, 3]), (0, 7), (30, [-1, 0, 1])])
    with_mask = _run_both(case, case[-1])
    without = _run_both(case, None)
    for a, b in zip(with_mask, without, strict=True):
        np.testing.assert_array_equal(a, b)


def test_siblings_do_not_see_each_other():
    """Two children of the prefix: the second's output does not move when the first's
    key changes (it would under the causal rule)."""
    rng = np.random.default_rng(1)
    case = list(_case(rng, [(9, [-1, -1])], block_size=4))
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
    q, k, v, tables, kv_lens, cu, words = _case(rng, [(3, [-1, 0])])
    with pytest.raises(ValueError, match="tree_mask must be uint32"):
        ragged_paged_attention(
            *map(jnp.asarray, (q, k, v, tables, kv_lens, cu)),
            sm_scale=0.3,
            tree_mask=jnp.asarray(words[:1]),
        )
