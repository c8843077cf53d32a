"""Random paged-attention cases with poisoned (NaN) non-data, shared by tests and bench;
the words of draft trees (``tree_words``) for their ``tree_mask``."""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.reference import TREE_BITS


@dataclasses.dataclass
class PagedCase:
    q: np.ndarray  # [T, Hq, D] float32
    k_pages: np.ndarray  # [N, Hkv, B, D] float32, NaN wherever no token lives
    v_pages: np.ndarray
    block_tables: np.ndarray  # int32[S, M]
    kv_lens: np.ndarray  # int32[S]
    cu_q_lens: np.ndarray  # int32[S+1]


def make_case(
    rng: np.random.Generator,
    *,
    q_lens: list[int],
    kv_lens: list[int],
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    num_blocks: int,
    garbage_table_tail: bool = True,
) -> PagedCase:
    """Pages of all sequences are a random permutation of blocks 1..N-1; block 0 (null),
    unused pages and slots past kv_len are NaN; table entries past a sequence's last page
    point at the null block or (garbage_table_tail) at random other blocks."""
    num_seqs = len(kv_lens)
    need = [-(-n // block_size) for n in kv_lens]
    if sum(need) > num_blocks - 1 or max(need, default=0) > max_blocks:
        raise ValueError("case does not fit the pool")
    if sum(q_lens) > num_tokens or any(q > kv for q, kv in zip(q_lens, kv_lens, strict=True)):
        raise ValueError("bad q_lens")
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    if garbage_table_tail:
        tables[:] = rng.integers(0, num_blocks, tables.shape)
    used = 0
    for s, n in enumerate(kv_lens):
        pages = perm[used : used + need[s]]
        used += need[s]
        tables[s, : need[s]] = pages
        for j, page in enumerate(pages):
            live = min(block_size, n - j * block_size)
            k[page, :, :live] = rng.standard_normal((num_kv_heads, live, head_dim))
            v[page, :, :live] = rng.standard_normal((num_kv_heads, live, head_dim))
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return PagedCase(q, k, v, tables, np.asarray(kv_lens, np.int32), cu)


ALL_BITS = 0xFFFFFFFF


def tree_words(parents: list[int]) -> np.ndarray:
    """uint32 word per node of a tree given as parents (-1 = child of the prefix),
    parents before children: bit j - a for each ancestor a and itself, bits above j set."""
    words = []
    for j in range(len(parents)):
        w = (ALL_BITS << (j + 1)) & ALL_BITS
        a = j
        while a >= 0:
            if j - a < TREE_BITS:  # keys 32 or more back are visible anyway
                w |= 1 << (j - a)
            a = parents[a]
        words.append(w)
    return np.asarray(words, np.uint32)


def tree_and_chain(
    rng: np.random.Generator,
    *,
    prefix: int,
    parents: list[int],
    leaf: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    decode_ctx: int = 9,
) -> tuple[PagedCase, np.ndarray, PagedCase, list[int]]:
    """The same accepted tokens verified as a tree and as a chain.

    Sequence 0 is a prefix and then the nodes of the tree ``parents`` (in the tree case)
    or only the nodes on the path from the root to ``leaf`` (in the chain case), each path
    node with the same q, K and V in both; sequence 1 is a decode row, the same in both.
    Returns (tree case, its uint32 words, chain case, path): the tree's rows ``path`` must
    equal the chain's rows 0..len(path)-1 (a causal chain needs no mask), up to the
    summation order of keys that sit in other pages. Slots that hold no token are NaN.
    """
    path, a = [], leaf
    while a >= 0:
        path.append(a)
        a = parents[a]
    path.reverse()
    kv_shape = (num_kv_heads, head_dim)
    pre_k, pre_v = (rng.standard_normal((prefix, *kv_shape)) for _ in range(2))
    node_k, node_v = (rng.standard_normal((len(parents), *kv_shape)) for _ in range(2))
    node_q = rng.standard_normal((len(parents), num_q_heads, head_dim))
    dec_k, dec_v = (rng.standard_normal((decode_ctx, *kv_shape)) for _ in range(2))
    dec_q = rng.standard_normal((1, num_q_heads, head_dim))
    cases = []
    for nodes in (list(range(len(parents))), path):
        k = [np.concatenate([pre_k, node_k[nodes]]), dec_k]
        v = [np.concatenate([pre_v, node_v[nodes]]), dec_v]
        q = np.concatenate([node_q[nodes], dec_q])
        cases.append(_paged(rng, q, [len(nodes), 1], k, v, block_size))
    words = np.concatenate([tree_words(parents), [ALL_BITS]]).astype(np.uint32)
    return cases[0], words, cases[1], path


def _paged(rng, q, q_lens, ks, vs, block_size) -> PagedCase:
    """A PagedCase of whole contexts ks / vs ([ctx, Hkv, D] per sequence), pages in random
    order after the null block, NaN in every slot that holds no token."""
    need = [-(-len(k) // block_size) for k in ks]
    num_blocks, max_blocks = 1 + sum(need), max(need)
    shape = (num_blocks, ks[0].shape[1], block_size, ks[0].shape[2])
    k_pages, v_pages = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(ks), max_blocks), np.int32)
    used = 0
    for s, (k, v) in enumerate(zip(ks, vs, strict=True)):
        for j in range(need[s]):
            page, lo = perm[used], j * block_size
            used += 1
            tables[s, j] = page
            live = min(block_size, len(k) - lo)
            k_pages[page, :, :live] = k[lo : lo + live].transpose(1, 0, 2)
            v_pages[page, :, :live] = v[lo : lo + live].transpose(1, 0, 2)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.asarray([len(k) for k in ks], np.int32)
    return PagedCase(q.astype(np.float32), k_pages, v_pages, tables, kv_lens, cu)
