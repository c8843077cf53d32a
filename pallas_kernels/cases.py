"""Random paged-attention cases with poisoned (NaN) non-data, shared by tests and bench."""

from __future__ import annotations

import dataclasses

import numpy as np


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
