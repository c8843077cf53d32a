"""Incremental chained block hashes on the host (the prefix cache's hint keys).

``extend_hashes`` gives the same values as ``prefix_cache.chain_hashes`` but appends only
the new blocks, so a decoding sequence hashes each block once.
"""

from __future__ import annotations

import hashlib

import numpy as np


def extend_hashes(
    hashes: list[int], token_ids: list[int], block_size: int, num_blocks: int
) -> None:
    """Append the chained hashes of blocks len(hashes)..num_blocks-1 of token_ids in place
    (num_blocks full blocks must exist in token_ids)."""
    parent = hashes[-1].to_bytes(8, "little") if hashes else b"\0" * 8
    for i in range(len(hashes), num_blocks):
        block = np.asarray(token_ids[i * block_size : (i + 1) * block_size], dtype=np.int64)
        h = hashlib.blake2b(parent + block.tobytes(), digest_size=8).digest()
        hashes.append(int.from_bytes(h, "little"))
        parent = h
