"""The prefix index as a replaceable part: a protocol, and today's hash chain behind it.

A prefix index maps block-aligned token prefixes to the physical blocks holding their
KV. Two implementations satisfy ``PrefixIndex``: ``HashChainIndex`` (this module; the
chained 64-bit hashes of ``prefix_cache``, a flat dict) and ``RadixIndex``
(``radix_index.py``; SGLang's RadixAttention tree). Both are host-side, pure Python, and
exact: a hit is exactly the blocks of the longest cached block-aligned prefix. (The
engine still uses ``prefix_cache.PrefixIndex`` directly as an unverified hint checked on
device; this protocol is where a swappable index plugs in, see docs/kv_tiers.md.)

Contract shared by every implementation (tests/test_prefix_index.py checks it against a
brute-force dict):

- ``match(tokens)`` -> ``list[int]``: block ids of the longest cached prefix of
  ``tokens`` made of whole blocks (a trailing partial block never matches).
- ``insert(parent, tokens, block)`` -> ``int``: register ``block`` as holding the full
  block ``tokens`` (``block_size`` ints) that follows ``parent`` (``NULL_BLOCK`` for a
  prompt's first block). If that prefix is already cached, the index keeps the block it
  has and returns it (the caller may then free ``block``): replacing it would orphan its
  children. Refused (``ValueError``) when ``parent`` is not cached, ``block`` is the null
  block or already cached, or ``tokens`` is not one full block.
- ``remove(block)``: forget a block. Refused (``ValueError``) when it is not cached or
  still has a cached child, so the index stays prefix-closed (every cached prefix's
  shorter prefixes are cached) and a match never skips a hole.
- ``evictable()`` -> ``set[int]``: the cached blocks with no cached child (the leaves).
  Whether a leaf is *referenced* by a running sequence is the block pool's knowledge
  (refcount > 0), so the caller intersects this with the pool's free blocks.
- ``depth(block)`` -> ``int``: the block's position in its prefix (0 for a first
  block); eviction's cost-aware policy needs it (tokens to recompute).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from pagedjax.memory.block_pool import NULL_BLOCK
from pagedjax.memory.prefix_cache import PrefixIndex as HashHint
from pagedjax.memory.prefix_cache import chain_hashes


@runtime_checkable
class PrefixIndex(Protocol):
    """What the memory layer needs from a prefix index (see the module docstring)."""

    block_size: int

    def __len__(self) -> int: ...

    def __contains__(self, block: object) -> bool: ...

    def match(self, tokens: Sequence[int]) -> list[int]: ...

    def insert(self, parent: int, tokens: Sequence[int], block: int) -> int: ...

    def remove(self, block: int) -> None: ...

    def evictable(self) -> set[int]: ...

    def depth(self, block: int) -> int: ...


def check_insert(parent: int, block: int, cached: object) -> None:
    """``PrefixIndex.insert``'s refusals, shared by every index: ValueError unless
    ``parent`` is the null block or cached, and ``block`` is neither (``cached``: any
    container of the index's cached block ids)."""
    if parent != NULL_BLOCK and parent not in cached:
        raise ValueError(f"parent block {parent} is not cached")
    if block == NULL_BLOCK or block in cached:
        raise ValueError(f"block {block} is the null block or already cached")


def check_block_tokens(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """``tokens`` as a tuple of ints, refused unless it is exactly one full block."""
    t = tuple(int(x) for x in tokens)
    if len(t) != block_size:
        raise ValueError(f"a block holds exactly {block_size} tokens, got {len(t)}")
    return t


def chain_hash(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """One step of ``prefix_cache.chain_hashes``: the hash of a block given its parent's
    (None for a first block). Same bytes, same value, so both indexes agree on keys."""
    parent = b"\0" * 8 if parent_hash is None else parent_hash.to_bytes(8, "little")
    toks = np.asarray(tokens, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(parent + toks, digest_size=8).digest(), "little")


class HashChainIndex:
    """Today's hash chain (``prefix_cache.PrefixIndex``: chained hash -> block id) behind
    the ``PrefixIndex`` protocol.

    The hint dict itself is the engine's class, unchanged; this adapter adds what the
    hint never needed because the device verifies and the pool evicts: each block's hash,
    parent and child count, so removal keeps the chain prefix-closed and the leaves are
    known. With that bookkeeping a proposal is never stale, so ``match`` is exact (up
    to 64-bit hash collisions, which the device check covers in the engine).
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.hint = HashHint()
        self._hash: dict[int, int] = {}
        self._parent: dict[int, int] = {}
        self._depth: dict[int, int] = {}
        self._children: dict[int, int] = {}  # cached child count

    def __len__(self) -> int:
        return len(self._hash)

    def __contains__(self, block: object) -> bool:
        return block in self._hash

    def match(self, tokens: Sequence[int]) -> list[int]:
        return self.hint.propose(chain_hashes(list(tokens), self.block_size))

    def insert(self, parent: int, tokens: Sequence[int], block: int) -> int:
        t = check_block_tokens(tokens, self.block_size)
        check_insert(parent, block, self._hash)
        h = chain_hash(self._hash.get(parent), t)
        have = self.hint.propose([h])
        if have:
            return have[0]
        self.hint.record([h], [block])
        self._hash[block] = h
        self._parent[block] = parent
        self._depth[block] = 0 if parent == NULL_BLOCK else self._depth[parent] + 1
        self._children[block] = 0
        if parent != NULL_BLOCK:
            self._children[parent] += 1
        return block

    def remove(self, block: int) -> None:
        if block not in self._hash:
            raise ValueError(f"block {block} is not cached")
        if self._children[block]:
            raise ValueError(f"block {block} has {self._children[block]} cached children")
        self.hint.forget([self._hash.pop(block)])
        parent = self._parent.pop(block)
        del self._depth[block], self._children[block]
        if parent != NULL_BLOCK:
            self._children[parent] -= 1

    def evictable(self) -> set[int]:
        return {b for b, n in self._children.items() if n == 0}

    def depth(self, block: int) -> int:
        return self._depth[block]
