"""Incremental chained block hashes on the host (the prefix cache's hint keys).

``extend_hashes`` gives the same values as ``prefix_cache.chain_hashes`` but appends only
the new blocks, so a decoding sequence hashes each block once.

``salt`` (optional, vLLM's ``cache_salt`` idea; LoRA requests pass their adapter's
``LoRARequest.cache_salt``) replaces the chain's all-zero root by a hash of the salt, so
every block hash of a salted request differs from the unsalted (and other salts') ones:
the host hint never proposes another adapter's blocks. Without a salt the values are
unchanged.
"""

from __future__ import annotations

import hashlib

import numpy as np


def chain_root(salt: bytes | None = None) -> bytes:
    """The parent bytes of a chain's first block: zeros, or an 8-byte hash of ``salt``."""
    if not salt:
        return b"\0" * 8
    return hashlib.blake2b(b"pagedjax-cache-salt\0" + salt, digest_size=8).digest()


def extend_hashes(
    hashes: list[int], token_ids: list[int], block_size: int, num_blocks: int,
    salt: bytes | None = None,
) -> None:  # fmt: skip
    """Append the chained hashes of blocks len(hashes)..num_blocks-1 of token_ids in place
    (num_blocks full blocks must exist in token_ids). ``salt`` keys the chain's root
    (module docstring); pass the same salt on every call for one sequence."""
    parent = hashes[-1].to_bytes(8, "little") if hashes else chain_root(salt)
    for i in range(len(hashes), num_blocks):
        block = np.asarray(token_ids[i * block_size : (i + 1) * block_size], dtype=np.int64)
        h = hashlib.blake2b(parent + block.tobytes(), digest_size=8).digest()
        hashes.append(int.from_bytes(h, "little"))
        parent = h
