"""The physical block pool: reference counts and an LRU-ordered free list, as arrays.

A pool of ``num_blocks`` KV blocks. Block 0 is the null block: block tables point
their unused entries at it, kernels mask by length so its contents are never read as
data, and it is never allocated or freed.

The free list is a doubly linked list over block ids held in two index arrays, with a
sentinel node at index ``num_blocks``. Freed blocks go to the tail and allocation pops
from the head, so the least recently freed block is reused first; that keeps a freed
block's contents (and its prefix-cache hash) alive as long as possible, and
``unlink_free`` takes a given block out of the list in O(1) to revive a cached prefix.

Every function is pure (``pool -> pool'``), jittable, costs time proportional to the
blocks it touches (not to the pool), and returns ``ok``: a refused call (not enough
free blocks, an invalid id, a double free) leaves the pool unchanged. Refusals are
decided before any write, and the write happens under ``lax.cond``, so a donated pool
is updated in place and never copied.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

NULL_BLOCK = 0


class BlockPool(NamedTuple):
    """Pool state.

    refcount: int32[num_blocks]; 0 for free blocks and for the null block.
    next_free, prev_free: int32[num_blocks + 1]; free-list links; index num_blocks is
        the sentinel (next_free[sentinel] is the head, prev_free[sentinel] the tail).
        Links of blocks not in the list are meaningless.
    num_free: int32[]; length of the free list.
    """

    refcount: jax.Array
    next_free: jax.Array
    prev_free: jax.Array
    num_free: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.refcount.shape[0]

    @property
    def sentinel(self) -> int:
        return self.refcount.shape[0]


def create_block_pool(num_blocks: int) -> BlockPool:
    """A pool with every block but the null block free, in id order (1 first)."""
    if not isinstance(num_blocks, int) or num_blocks < 2:
        raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}")
    n = num_blocks
    sentinel = n
    ids = jnp.arange(n + 1, dtype=jnp.int32)
    # List order: sentinel -> 1 -> 2 -> ... -> n-1 -> sentinel. Block 0 is not linked.
    next_free = jnp.where(ids == sentinel, 1, ids + 1)
    next_free = next_free.at[n - 1].set(sentinel)
    prev_free = jnp.where(ids == 1, sentinel, ids - 1)
    prev_free = prev_free.at[sentinel].set(n - 1)
    prev_free = prev_free.at[0].set(0)
    next_free = next_free.at[0].set(0)
    return BlockPool(
        refcount=jnp.zeros((n,), jnp.int32),
        next_free=next_free.astype(jnp.int32),
        prev_free=prev_free.astype(jnp.int32),
        num_free=jnp.asarray(n - 1, jnp.int32),
    )


def _unlink(pool: BlockPool, block: jax.Array) -> BlockPool:
    p = pool.prev_free[block]
    n = pool.next_free[block]
    return pool._replace(
        next_free=pool.next_free.at[p].set(n),
        prev_free=pool.prev_free.at[n].set(p),
        num_free=pool.num_free - 1,
    )


def _push_back(pool: BlockPool, block: jax.Array) -> BlockPool:
    s = pool.sentinel
    tail = pool.prev_free[s]
    return pool._replace(
        next_free=pool.next_free.at[tail].set(block).at[block].set(s),
        prev_free=pool.prev_free.at[block].set(tail).at[s].set(block),
        num_free=pool.num_free + 1,
    )


def free_list(pool: BlockPool) -> list[int]:
    """The free list head to tail, as Python ints (host-side; for tests and debugging)."""
    nxt = jax.device_get(pool.next_free)
    s = pool.sentinel
    out, b = [], int(nxt[s])
    while b != s:
        out.append(b)
        b = int(nxt[b])
        if len(out) > pool.num_blocks:
            raise RuntimeError("free list is cyclic")
    return out


def allocate(
    pool: BlockPool, n: jax.Array | int, max_n: int, min_free_after: jax.Array | int = 0
) -> tuple[BlockPool, jax.Array, jax.Array]:
    """Take ``n`` blocks from the head of the free list, each with refcount 1.

    Args:
      n: int32 scalar, 0 <= n <= max_n.
      max_n: static size of the returned block array.
      min_free_after: int32 scalar; the call is refused unless this many blocks stay free
        (the scheduler's admission watermark).
    Returns:
      (pool', blocks int32[max_n] with entries >= n set to NULL_BLOCK, ok bool[]).
    """
    n = jnp.asarray(n, jnp.int32)
    ok = (n >= 0) & (n <= max_n) & (pool.num_free - n >= min_free_after)

    def take(pool: BlockPool) -> tuple[BlockPool, jax.Array]:
        def body(i, carry):
            pool, blocks = carry
            b = pool.next_free[pool.sentinel]
            pool = _unlink(pool, b)
            pool = pool._replace(refcount=pool.refcount.at[b].set(1))
            return pool, blocks.at[i].set(b)

        return jax.lax.fori_loop(0, n, body, (pool, jnp.zeros((max_n,), jnp.int32)))

    def refuse(pool: BlockPool) -> tuple[BlockPool, jax.Array]:
        return pool, jnp.zeros((max_n,), jnp.int32)

    pool, blocks = jax.lax.cond(ok, take, refuse, pool)
    return pool, blocks, ok


def _occurrences(blocks: jax.Array) -> jax.Array:
    """How often each entry's value appears in ``blocks`` (int32[K]); O(K^2), K small."""
    return jnp.sum(blocks[:, None] == blocks[None, :], axis=1).astype(jnp.int32)


def free(pool: BlockPool, blocks: jax.Array) -> tuple[BlockPool, jax.Array]:
    """Drop one reference to each non-null entry of ``blocks`` (int32[K]).

    A block whose refcount reaches zero goes to the tail of the free list (most recently
    freed), keeping its contents. NULL_BLOCK entries are ignored (padding). Refused
    (ok=False, pool unchanged) if an id is out of range or would drop below zero
    (a double free), counting repeats within ``blocks``.
    """
    blocks = jnp.asarray(blocks, jnp.int32)
    real = blocks != NULL_BLOCK
    in_range = (blocks >= 0) & (blocks < pool.num_blocks)
    safe = jnp.where(in_range, blocks, 0)
    enough = _occurrences(blocks) <= pool.refcount[safe]
    ok = jnp.all(~real | (in_range & enough))

    def release(pool: BlockPool) -> BlockPool:
        def body(i, pool):
            b = blocks[i]

            def dec(pool):
                rc = pool.refcount[b] - 1
                pool = pool._replace(refcount=pool.refcount.at[b].set(rc))
                return jax.lax.cond(rc == 0, lambda p: _push_back(p, b), lambda p: p, pool)

            return jax.lax.cond(b != NULL_BLOCK, dec, lambda p: p, pool)

        return jax.lax.fori_loop(0, blocks.shape[0], body, pool)

    pool = jax.lax.cond(ok, release, lambda p: p, pool)
    return pool, ok


def incref(pool: BlockPool, blocks: jax.Array) -> tuple[BlockPool, jax.Array]:
    """Add one reference to each non-null entry of ``blocks`` (int32[K]): a fork shares them.

    Refused if an entry is out of range or not allocated (refcount 0).
    """
    blocks = jnp.asarray(blocks, jnp.int32)
    real = blocks != NULL_BLOCK
    in_range = (blocks >= 0) & (blocks < pool.num_blocks)
    safe = jnp.where(in_range, blocks, 0)
    ok = jnp.all(~real | (in_range & (pool.refcount[safe] > 0)))
    # Null and refused entries scatter out of range, so they are dropped.
    idx = jnp.where(real & ok, blocks, pool.num_blocks)
    refcount = pool.refcount.at[idx].add(1, mode="drop")
    return pool._replace(refcount=refcount), ok


def copy_on_write(pool: BlockPool, block: jax.Array) -> tuple[BlockPool, jax.Array, jax.Array, jax.Array]:
    """Make ``block`` private before a write.

    If its refcount is 1 nothing changes and no copy is needed. If it is shared, a fresh
    block is allocated, the old block loses one reference, and the caller must copy the
    KV contents from ``block`` to the returned block.

    Returns: (pool', block_to_write int32[], needs_copy bool[], ok bool[]). Refused (ok
    False, pool unchanged) when ``block`` is not allocated or no block is free.
    """
    block = jnp.asarray(block, jnp.int32)
    in_range = (block > NULL_BLOCK) & (block < pool.num_blocks)
    rc = pool.refcount[jnp.where(in_range, block, 0)]
    shared = in_range & (rc > 1)
    ok = in_range & (rc > 0) & (~shared | (pool.num_free > 0))

    def cow(pool: BlockPool) -> tuple[BlockPool, jax.Array]:
        pool, new, _ = allocate(pool, 1, 1)
        pool = pool._replace(refcount=pool.refcount.at[block].add(-1))
        return pool, new[0]

    pool, target = jax.lax.cond(ok & shared, cow, lambda p: (p, block), pool)
    return pool, target, ok & shared, ok


def unlink_free(pool: BlockPool, block: jax.Array) -> tuple[BlockPool, jax.Array]:
    """Take a given free block out of the free list in O(1), with refcount 1.

    Used to revive a freed block that still holds a cached prefix. Refused if the block
    is the null block, out of range or not free.
    """
    block = jnp.asarray(block, jnp.int32)
    in_range = (block > NULL_BLOCK) & (block < pool.num_blocks)
    ok = in_range & (pool.refcount[jnp.where(in_range, block, 0)] == 0)

    def revive(pool: BlockPool) -> BlockPool:
        pool = _unlink(pool, block)
        return pool._replace(refcount=pool.refcount.at[block].set(1))

    return jax.lax.cond(ok, revive, lambda p: p, pool), ok


def num_used(pool: BlockPool) -> jax.Array:
    """Blocks with at least one reference (excluding the null block)."""
    return pool.num_blocks - 1 - pool.num_free
