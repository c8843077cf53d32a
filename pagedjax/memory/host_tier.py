"""The host tier: prefix-cache blocks evicted from the device pool, kept in host memory.

Issue 35, item 1 (docs/kv_tiers.md). With automatic prefix caching a freed cached block
stays in the device pool until an allocation takes it (``block_pool.allocate`` pops the
least recently freed block; ``PagedPolicy`` records it in ``PagedState.evicted``). With
the host tier on, the engine copies such a block's KV to a host block before the step
that reuses it overwrites it, keyed by the block's chained hash, and a later prompt whose
prefix misses the device but hits the host gets fresh device blocks loaded from there.

One bounded host allocator: the host tier's blocks come from the same ``BlockPool`` as
the swap pool's (``PagedState.host_pool``, block 0 null). The tier holds one reference
to each block it keeps (refcount 1), so a swap-out never overwrites a kept block and a
kept block is never on the free list; evicting an entry drops that reference. The pool's
size is the swap space plus ``kv_offloading_size``; the tier itself never holds more than
its own capacity (``kv_offloading_size`` in blocks), so the swap space stays for swaps.

Parts, and why each is where it is:

- ``HostTierIndex`` (host, pure Python): chained hash -> (host block, the block's token
  ids), least recently used first, at most ``capacity`` entries. A lookup checks the
  stored tokens against the prompt's, so a hash collision on a block's own tokens cannot
  return wrong KV; the parent link is the chained hash (64 bits, as vLLM's offloading
  keys blocks), since the parent's device block may be long reused.
- ``exchange`` (jittable, ``BlockPool`` -> ``BlockPool``): drop the references of the
  evicted entries, then take up to n fresh blocks: the tier's only writes to the shared
  allocator, one dispatch per batch of offloads.
- ``cross_tier_hit`` (pure, numpy or jax): how many blocks of a prompt to take from the
  device and from the host, given which blocks each tier holds: a verified device prefix,
  then the host run that continues it, cut so the prompt's last token is computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.memory import block_pool as bp
from pagedjax.memory.block_pool import BlockPool


class HostEntry(NamedTuple):
    """One kept block: its host block id and token ids (int32[block_size])."""

    block: int
    tokens: np.ndarray


class HostTierIndex:
    """chained block hash -> ``HostEntry``, in least-recently-used order, bounded.

    capacity: the most entries (host blocks) the tier may hold, >= 0. The index never
    allocates: ``plan_store`` says which entries to evict to make room, the caller
    exchanges blocks with the pool (``exchange``) and ``commit``s the ones it got.
    """

    def __init__(self, capacity: int, block_size: int):
        if capacity < 0 or block_size < 1:
            raise ValueError(f"capacity must be >= 0 and block_size >= 1, got {capacity},"
                             f" {block_size}")  # fmt: skip
        self.capacity, self.block_size = capacity, block_size
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, h: object) -> bool:
        return h in self._entries

    def blocks(self) -> list[int]:
        """The host blocks the tier holds (one reference each), LRU first."""
        return [e.block for e in self._entries.values()]

    def get(self, h: int, tokens: Sequence[int] | np.ndarray) -> int | None:
        """The host block keeping hash ``h`` if its stored tokens equal ``tokens``."""
        e = self._entries.get(h)
        if e is None or not np.array_equal(e.tokens, np.asarray(tokens, np.int32)):
            return None
        return e.block

    def run(self, hashes: Sequence[int], token_ids: Sequence[int], start: int,
            stop: int) -> list[int]:  # fmt: skip
        """Host blocks of the leading run of kept blocks start, start + 1, ... < stop of
        a prompt (its chained ``hashes`` and ``token_ids``)."""
        b, out = self.block_size, []
        for i in range(start, stop):
            blk = self.get(hashes[i], token_ids[i * b : (i + 1) * b])
            if blk is None:
                break
            out.append(blk)
        return out

    def touch(self, hashes: Sequence[int]) -> None:
        """Mark kept hashes most recently used (a hit)."""
        for h in hashes:
            if h in self._entries:
                self._entries.move_to_end(h)

    def plan_store(self, n_new: int) -> tuple[list[int], list[int]]:
        """Make room for ``n_new`` entries: (hashes to evict, their host blocks), least
        recently used first, so that at most ``capacity`` entries remain afterwards."""
        over = max(0, len(self._entries) + min(n_new, self.capacity) - self.capacity)
        victims = list(self._entries)[:over]
        return victims, [self._entries[h].block for h in victims]

    def evict(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            del self._entries[h]

    def commit(self, hashes: Sequence[int], tokens: Sequence[np.ndarray],
               blocks: Sequence[int]) -> None:  # fmt: skip
        """Keep ``hashes[i]`` in host block ``blocks[i]`` (as most recently used); the
        caller took the blocks from the pool and wrote their KV. Refused (ValueError) past
        capacity or for a hash already kept: the index never silently drops a block."""
        if len(self._entries) + len(hashes) > self.capacity:
            raise ValueError(f"host tier over capacity: {len(self._entries)} + {len(hashes)}"
                             f" > {self.capacity}")  # fmt: skip
        for h, t, blk in zip(hashes, tokens, blocks, strict=True):
            if h in self._entries:
                raise ValueError(f"hash {h} is already kept")
            self._entries[h] = HostEntry(int(blk), np.asarray(t, np.int32).copy())


def exchange(
    pool: BlockPool, release: jax.Array, num_release: jax.Array, n: jax.Array, max_n: int
) -> tuple[BlockPool, jax.Array, jax.Array]:
    """Drop one reference to ``release[:num_release]`` (int32[R], blocks the tier held),
    then take ``min(n, num_free)`` blocks (each refcount 1) for new entries.

    Returns (pool', blocks int32[max_n] (entries >= count are NULL_BLOCK), count int32[]).
    Pure and jittable; a block is never both free and held (``block_pool``'s invariant).
    """
    pool = bp.drop_refs(pool, release, num_release)
    count = jnp.clip(jnp.minimum(jnp.asarray(n, jnp.int32), pool.num_free), 0, max_n)
    pool, blocks = bp.pop_blocks(pool, count, max_n)
    return pool, blocks, count


def cross_tier_hit(
    device_hit: np.ndarray, host_run: np.ndarray, num_tokens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of each prompt to reuse from the device and from the host.

    device_hit: int[K] blocks of the verified device prefix; host_run: int[K] cached
    blocks that continue it (blocks device_hit, device_hit + 1, ...: a run that starts
    on the host, and may go on with device blocks after it); num_tokens: int[K] the
    prompt's tokens. The hit is the longest cached prefix across both tiers, cut as
    ``prefix_cache.usable_hit`` does: when it reaches the last token, its last block is
    dropped (that token's logits are needed). Returns (use_device, use_rest), int[K].
    Works on numpy or jax arrays alike (no Python control flow on values).
    """
    xp = jnp if isinstance(device_hit, jax.Array) else np
    total = device_hit + host_run
    usable = xp.where(
        total * block_size >= num_tokens, xp.maximum(0, (num_tokens - 1) // block_size), total
    )
    use_device = xp.minimum(device_hit, usable)
    return use_device, usable - use_device


def leading_run(present: np.ndarray, start: np.ndarray) -> np.ndarray:
    """int[K]: for each row of ``present`` (bool[K, M]), how many consecutive True
    entries begin at column ``start[k]`` (pure numpy; the reference form of a lookup)."""
    k, m = present.shape
    cols = np.arange(m)[None, :]
    inside = cols >= start[:, None]
    miss = inside & ~present
    first_miss = np.where(miss.any(axis=1), np.argmax(miss, axis=1), m)
    return np.maximum(first_miss - start, 0)


__all__ = ["HostEntry", "HostTierIndex", "cross_tier_hit", "exchange", "leading_run"]
