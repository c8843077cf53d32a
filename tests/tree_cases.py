"""Draft-tree attention cases shared by every backend's tree-mask tests: the words of a
tree (``tree_words``), a ragged batch of trees beside plain causal chunks
(``tree_case``) and a numpy oracle that gathers exactly the keys each query may see
(``tree_oracle``), so it shares no masking code with any backend."""

from __future__ import annotations

import numpy as np

from pallas_kernels.cases import ALL_BITS, tree_words
from pallas_kernels.reference import TREE_BITS

__all__ = ["ALL_BITS", "tree_case", "tree_oracle", "tree_words", "visible_keys"]


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


def tree_case(rng, seqs, block_size=4, hq=4, hkv=2, d=8, pad=False):
    """A ragged batch, (q, k_pages, v_pages, tables, kv_lens, cu_q_lens, words), fp32.

    seqs: list of (prefix_len, parents: a tree, or an int q_len: a plain causal chunk whose
    rows get all bits). pad: fixed shapes (3 sequences, 96 rows, 80-token tables), so one
    compilation serves every case; padding rows get all bits."""
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


def tree_oracle(q, k_pages, v_pages, tables, kv_lens, cu, words, scale):
    """float64 [T, Hq, D]: each query over exactly the keys ``visible_keys`` lists; padding
    rows 0."""
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
