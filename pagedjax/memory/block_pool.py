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
decided before any write, and a refused call's writes are disabled (zero loop trips, or
out-of-range scatter indices that are dropped) rather than branched around with
``lax.cond``, which made XLA copy the whole pool; so a donated pool is updated in place.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NULL_BLOCK = 0


class BlockPool(NamedTuple):
    """Pool state.

    refcount: int32[num_blocks]; 0 for free blocks and for the null block.
    next_free, prev_free: int32[num_blocks + 2]; free-list links; index num_blocks is
        the sentinel (next_free[sentinel] is the head, prev_free[sentinel] the tail) and
        index num_blocks + 1 a trash slot for disabled writes. Links of blocks not in
        the list are meaningless.
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
        raise ValueError(
            f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
        )
    n = num_blocks
    sentinel = n
    # Built with numpy and moved in one device_put: called outside jit, each jnp op here
    # dispatched (and, cold, compiled) an XLA program of its own.
    ids = np.arange(n + 2, dtype=np.int32)
    # List order: sentinel -> 1 -> 2 -> ... -> n-1 -> sentinel. Block 0 is not linked.
    next_free = np.where(ids == sentinel, 1, ids + 1).astype(np.int32)
    next_free[n - 1] = sentinel
    prev_free = np.where(ids == 1, sentinel, ids - 1).astype(np.int32)
    prev_free[sentinel] = n - 1
    prev_free[0] = 0
    next_free[0] = 0
    return BlockPool(
        *jax.device_put(
            (np.zeros((n,), np.int32), next_free, prev_free, np.int32(n - 1)), may_alias=False
        )
    )


def _get(x: jax.Array, i: jax.Array) -> jax.Array:
    """x[i] for a scalar index, as a dynamic slice."""
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _set(x: jax.Array, i: jax.Array, v: jax.Array) -> jax.Array:
    """x[i] = v as a one-element dynamic update slice, which XLA performs in place."""
    return jax.lax.dynamic_update_index_in_dim(x, jnp.asarray(v, x.dtype), i, 0)


# In-place updates and XLA: a write that is "disabled" by reading the old value back
# (or a scatter, or a lax.cond around the pool) made XLA copy the whole link arrays on
# every call. So disabled link writes go to a trash slot (index num_blocks + 1), and each
# value read from an array is materialised with optimization_barrier before that array
# is written, so XLA cannot fuse the read past the in-place update.


def _unlink(pool: BlockPool, block: jax.Array, do: jax.Array | bool = True) -> BlockPool:
    """Remove ``block`` from the free list if ``do``; otherwise change nothing."""
    p, n = jax.lax.optimization_barrier((_get(pool.prev_free, block), _get(pool.next_free, block)))
    trash = pool.sentinel + 1
    return pool._replace(
        next_free=_set(pool.next_free, jnp.where(do, p, trash), n),
        prev_free=_set(pool.prev_free, jnp.where(do, n, trash), p),
        num_free=pool.num_free - jnp.asarray(do, jnp.int32),
    )


def _push_back(pool: BlockPool, block: jax.Array, do: jax.Array | bool = True) -> BlockPool:
    """Append ``block`` at the tail of the free list if ``do``."""
    s = jnp.asarray(pool.sentinel, jnp.int32)
    trash = pool.sentinel + 1
    tail = jax.lax.optimization_barrier(_get(pool.prev_free, s))
    nxt = _set(pool.next_free, jnp.where(do, tail, trash), block)
    nxt = _set(nxt, jnp.where(do, block, trash), s)
    prv = _set(pool.prev_free, jnp.where(do, block, trash), tail)
    prv = _set(prv, jnp.where(do, s, trash), block)
    return pool._replace(
        next_free=nxt, prev_free=prv, num_free=pool.num_free + jnp.asarray(do, jnp.int32)
    )


def acquire_ref(pool: BlockPool, block: jax.Array) -> BlockPool:
    """One more reference to ``block`` (a traced int32 scalar): a freed block (refcount 0,
    still on the free list with its contents, e.g. a cached prefix block) is taken off
    the free list in O(1); a live one is shared. The caller has checked that the block
    holds what it wants (``prefix_cache.match``)."""
    rc = jax.lax.optimization_barrier(_get(pool.refcount, block))
    pool = _unlink(pool, block, rc == 0)
    return pool._replace(refcount=_set(pool.refcount, block, rc + 1))


def free_list(pool: BlockPool) -> list[int]:
    """The free list head to tail, as Python ints (host-side; for tests and debugging)."""
    nxt = jax.device_get(pool.next_free).tolist()
    s = pool.sentinel
    out, b = [], int(nxt[s])
    while b != s:
        out.append(b)
        b = nxt[b]
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

    def body(i, carry):
        pool, blocks = carry
        b = _get(pool.next_free, jnp.asarray(pool.sentinel, jnp.int32))
        b = jax.lax.optimization_barrier(b)  # see _unlink
        pool = _unlink(pool, b)
        pool = pool._replace(refcount=_set(pool.refcount, b, 1))
        return pool, _set(blocks, i, b)

    # A refused call runs zero iterations, so the pool is untouched.
    count = jnp.where(ok, n, 0)
    pool, blocks = jax.lax.fori_loop(0, count, body, (pool, jnp.zeros((max_n,), jnp.int32)))
    return pool, blocks, ok


def pop_blocks(pool: BlockPool, n: jax.Array, max_n: int) -> tuple[BlockPool, jax.Array]:
    """Unchecked ``allocate``: the caller guarantees 0 <= n <= min(max_n, num_free)."""
    pool, blocks, _ = allocate(pool, n, max_n)
    return pool, blocks


def drop_refs(pool: BlockPool, blocks: jax.Array, count: jax.Array) -> BlockPool:
    """Unchecked ``free`` of ``blocks[:count]`` (int32[K], no NULL_BLOCK among them).

    For callers whose bookkeeping guarantees validity (block tables hold exactly the
    references they drop); skips ``free``'s O(K^2) double-free check, so K can be large.
    Cost is O(count).
    """

    def body(i, pool):
        b = _get(blocks, i)
        rc = jax.lax.optimization_barrier(_get(pool.refcount, b) - 1)
        pool = pool._replace(refcount=_set(pool.refcount, b, rc))
        return _push_back(pool, b, rc == 0)

    return jax.lax.fori_loop(0, count, body, pool)


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

    def body(i, pool):
        b = _get(blocks, i)
        real_b = b != NULL_BLOCK
        rc = jax.lax.optimization_barrier(_get(pool.refcount, b) - real_b.astype(jnp.int32))
        pool = pool._replace(refcount=_set(pool.refcount, b, rc))
        return _push_back(pool, b, real_b & (rc == 0))

    # A refused call runs zero iterations, so the pool is untouched.
    pool = jax.lax.fori_loop(0, jnp.where(ok, blocks.shape[0], 0), body, pool)
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

    def body(i, refcount):
        b = _get(blocks, i)
        rc = jax.lax.optimization_barrier(_get(refcount, b) + (b != NULL_BLOCK).astype(jnp.int32))
        return _set(refcount, b, rc)

    # A refused call runs zero iterations, so the pool is untouched.
    refcount = jax.lax.fori_loop(0, jnp.where(ok, blocks.shape[0], 0), body, pool.refcount)
    return pool._replace(refcount=refcount), ok


def copy_on_write(
    pool: BlockPool, block: jax.Array
) -> tuple[BlockPool, jax.Array, jax.Array, jax.Array]:
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

    do = ok & shared
    pool, new, _ = allocate(pool, do.astype(jnp.int32), 1)
    rc = jax.lax.optimization_barrier(_get(pool.refcount, block) - do.astype(jnp.int32))
    pool = pool._replace(refcount=_set(pool.refcount, block, rc))
    target = jnp.where(do, new[0], block)
    return pool, target, do, ok


def unlink_free(pool: BlockPool, block: jax.Array) -> tuple[BlockPool, jax.Array]:
    """Take a given free block out of the free list in O(1), with refcount 1.

    Used to revive a freed block that still holds a cached prefix. Refused if the block
    is the null block, out of range or not free.
    """
    block = jnp.asarray(block, jnp.int32)
    in_range = (block > NULL_BLOCK) & (block < pool.num_blocks)
    ok = in_range & (pool.refcount[jnp.where(in_range, block, 0)] == 0)

    rc = jax.lax.optimization_barrier(jnp.where(ok, 1, _get(pool.refcount, block)))
    pool = _unlink(pool, block, ok)
    return pool._replace(refcount=_set(pool.refcount, block, rc)), ok


def take_blocks(pool: BlockPool, blocks: jax.Array, count: jax.Array) -> BlockPool:
    """Unchecked ``unlink_free`` of ``blocks[:count]`` (int32[K], distinct free blocks,
    not the null block), each with refcount 1: the allocator of a non-default eviction
    policy, which chose which free blocks to take (``block_stats.pop_victims``). O(count).
    """

    def body(i, pool):
        b = jax.lax.optimization_barrier(_get(blocks, i))  # see _unlink
        pool = _unlink(pool, b)
        return pool._replace(refcount=_set(pool.refcount, b, 1))

    return jax.lax.fori_loop(0, count, body, pool)
