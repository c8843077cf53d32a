"""Per-block access statistics for the eviction policies, and the allocator that uses them.

The device pool's free list reuses the least recently *freed* block first
(``block_pool.allocate``): that is the ``lru`` policy, the default, and it needs nothing
from this module (``PagedState.stats`` is None, so its programs are the ones before this
module existed). The other policies of ``eviction.py`` (``lfu``, ``cost``) rank cached
blocks by numbers the free list does not hold; this module keeps them on device, next to
the reference counts, and lets them choose the victims:

``BlockStats`` (a pytree; ``policy`` is static):
  last_access int32[N]: the clock when the block was last freed, hit or registered.
  hit_count int32[N]: prefix-cache hits on the block since it was registered with its
      present content (reset at registration: a count belongs to a content, not a slot).
  depth int32[N]: the block's index in its sequence (its table column), set at
      registration (a prefix's first block has depth 0).
  clock int32[]: one tick per schedule (``PagedPolicy.begin_step``), so "last access" is
      a step number; blocks touched in one step tie and break by id.

Updates, each pure and O(blocks touched): ``tick``; ``touch`` (blocks freed, by
``PagedPolicy.release`` / ``swap_out``); ``hit`` (prefix-cache hits: ``sharing.attach_hits``
and the device part of a host run, ``attach_reloaded``); ``registered`` (blocks whose
KV a step wrote, ``sharing.register_step``, and reloaded blocks).

``pop_victims``: the allocation of a non-default policy. It orders the whole pool with
``eviction.victim_order`` (free uncached blocks first, so a cached block is only taken
when nothing uncached is free; then free cached blocks by the policy) and unlinks the
first ``n`` from the free list (``block_pool.take_blocks``). Cost: one sort over the
pool, O(N log N), per allocating call (a schedule's grow, a swap-in, a reload), instead
of the free list's O(n). On CPU (benchmarks/eviction_alloc_cost.py, docs/kv_tiers.md)
about 20 us for 56 blocks, 0.23 ms for 1,024 and 4.9 ms for 8,192 per call, against
11-24 us for the free list: fine for the policy ablations, not for serving a big pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.memory import block_pool as bp
from pagedjax.memory.block_pool import NULL_BLOCK, BlockPool
from pagedjax.memory.eviction import POLICIES, victim_order


@dataclasses.dataclass(frozen=True)
class BlockStats:
    """See the module docstring. Arrays [num_blocks] int32, ``clock`` int32[]."""

    last_access: jax.Array
    hit_count: jax.Array
    depth: jax.Array
    clock: jax.Array
    policy: str = "lfu"

    def replace(self, **changes: jax.Array) -> BlockStats:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    BlockStats, data_fields=["last_access", "hit_count", "depth", "clock"], meta_fields=["policy"]
)


def create_block_stats(num_blocks: int, policy: str) -> BlockStats:
    """Zeroed statistics for a pool of ``num_blocks``; ``policy`` one of ``eviction.POLICIES``
    other than ``lru`` (which keeps the free list; ValueError otherwise)."""
    if policy not in POLICIES or policy == "lru":
        raise ValueError(
            f"block statistics serve the policies {sorted(set(POLICIES) - {'lru'})}, got"
            f" {policy!r} (lru is the pool's free list)"
        )
    # numpy, one device_put: no op-by-op XLA programs outside jit (create_block_pool)
    z = np.zeros((num_blocks,), np.int32)
    arrays = jax.device_put((z, z.copy(), z.copy(), np.int32(0)), may_alias=False)
    return BlockStats(*arrays, policy=policy)


def _index(stats: BlockStats, blocks: jax.Array, mask: jax.Array) -> jax.Array:
    n = stats.last_access.shape[0]
    blocks = jnp.asarray(blocks, jnp.int32)
    return jnp.where(jnp.asarray(mask, bool) & (blocks != NULL_BLOCK), blocks, n)  # n: dropped


def tick(stats: BlockStats) -> BlockStats:
    """One step later."""
    return stats.replace(clock=stats.clock + 1)


def touch(stats: BlockStats, blocks: jax.Array, mask: jax.Array) -> BlockStats:
    """``blocks`` (int32[K], where ``mask``; null entries ignored) were used now (freed)."""
    idx = _index(stats, blocks, mask)
    return stats.replace(last_access=stats.last_access.at[idx].set(stats.clock, mode="drop"))


def hit(stats: BlockStats, blocks: jax.Array, mask: jax.Array) -> BlockStats:
    """``blocks`` (distinct where ``mask``) were hit by a prefix-cache lookup now."""
    idx = _index(stats, blocks, mask)
    return stats.replace(
        last_access=stats.last_access.at[idx].set(stats.clock, mode="drop"),
        hit_count=stats.hit_count.at[idx].add(1, mode="drop"),
    )


def registered(
    stats: BlockStats, blocks: jax.Array, depth: jax.Array, mask: jax.Array
) -> BlockStats:
    """``blocks`` now hold a new content at table column ``depth`` (int32 like blocks):
    no hits yet, accessed now."""
    idx = _index(stats, blocks, mask)
    depth = jnp.broadcast_to(jnp.asarray(depth, jnp.int32), idx.shape)
    return stats.replace(
        last_access=stats.last_access.at[idx].set(stats.clock, mode="drop"),
        hit_count=stats.hit_count.at[idx].set(0, mode="drop"),
        depth=stats.depth.at[idx].set(depth, mode="drop"),
    )


def choose_victims(
    pool: BlockPool, cached: jax.Array, stats: BlockStats, max_n: int
) -> jax.Array:
    """The first ``max_n`` blocks (int32[max_n]) of ``eviction.victim_order`` over the
    pool (free = refcount 0 and not the null block; ``cached``: bool[N], the prefix
    cache's flags); entries past the pool's size are NULL_BLOCK."""
    n = pool.num_blocks
    free = (pool.refcount == 0) & (jnp.arange(n) != NULL_BLOCK)
    order = victim_order(
        stats.policy, free, cached, stats.last_access, stats.hit_count, stats.depth
    )
    if max_n > n:
        order = jnp.concatenate([order, jnp.full((max_n - n,), NULL_BLOCK, jnp.int32)])
    return order[:max_n]


def pop_victims(
    pool: BlockPool, cached: jax.Array, stats: BlockStats, n: jax.Array, max_n: int
) -> tuple[BlockPool, jax.Array]:
    """``block_pool.pop_blocks`` with the policy's choice: take ``n`` free blocks (the
    caller guarantees 0 <= n <= min(max_n, num_free)) in ``choose_victims`` order, each
    with refcount 1. Returns (pool', blocks int32[max_n], NULL_BLOCK past n)."""
    n = jnp.asarray(n, jnp.int32)
    chosen = choose_victims(pool, cached, stats, max_n)
    blocks = jnp.where(jnp.arange(max_n) < n, chosen, NULL_BLOCK)
    return bp.take_blocks(pool, blocks, n), blocks


PopFn = Callable[[BlockPool, jax.Array, int], tuple[BlockPool, jax.Array]]


def pop_fn(stats: BlockStats | None, cached: jax.Array | None) -> PopFn:
    """The allocator for ``(pool, n, max_n)`` calls: the free list's ``pop_blocks`` when
    there are no statistics (``lru``, or prefix caching off), else ``pop_victims``."""
    if stats is None or cached is None:
        return bp.pop_blocks
    return lambda pool, n, max_n: pop_victims(pool, cached, stats, n, max_n)
