"""Swapping block-table rows between the device block pool and a host block pool.

Preemption by swap (the paper's section 4.5) moves a sequence group's KV blocks to a
host pool and later back. Both pools are ``BlockPool``s (block 0 is null in each), and
a swapped row of the block table holds *host* block ids while its slot is on the host.

``move_rows`` is the one operation, used in both directions: it takes the masked rows'
distinct blocks in the source pool, allocates one destination block for each (so a
block shared by several of the rows, e.g. n > 1 prompt blocks or beams, is copied once
and stays shared: its destination refcount is the number of references among the rows),
drops the rows' references in the source pool, and rewrites the rows. It also returns
the (source block, destination block) pairs, which the engine copies in one batched
gather (device -> host) or one batched scatter (host -> device).

A block also referenced from outside the masked rows (a prefix-cache hit shared with
another group) keeps those references in the source pool; the moved rows get their own
copy. Everything is pure and jittable; the cost is O(rows x blocks per row + source pool
size) for the distinct-block count, plus the blocks moved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.memory import block_pool as bp
from pagedjax.memory.block_pool import NULL_BLOCK, BlockPool
from pagedjax.memory.block_table import BlockTables


class SwapMap(NamedTuple):
    """Block copies of one step in one direction: ``src[i] -> dst[i]`` for i < count.

    src, dst: int32[K] (K static, at least the blocks one step can move); entries at and
    past ``count`` are 0 and mean nothing. count: int32[].
    """

    src: jax.Array
    dst: jax.Array
    count: jax.Array


def empty_map(k: int) -> SwapMap:
    z = jnp.zeros((k,), jnp.int32)
    return SwapMap(z, z, jnp.zeros((), jnp.int32))


def _fit(x: jax.Array, k: int) -> jax.Array:
    """x (1-D) cut or zero-padded to length k."""
    if x.shape[0] >= k:
        return x[:k]
    return jnp.pad(x, (0, k - x.shape[0]))


def append_pairs(m: SwapMap, src: jax.Array, dst: jax.Array, count: jax.Array) -> SwapMap:
    """m with pairs ``src[:count] -> dst[:count]`` appended (the step's accumulated map)."""
    k = m.src.shape[0]
    src, dst = _fit(src, k), _fit(dst, k)
    i = jnp.arange(k, dtype=jnp.int32)
    idx = jnp.where(i < count, m.count + i, k)  # out of range: dropped
    return SwapMap(
        m.src.at[idx].set(src, mode="drop"),
        m.dst.at[idx].set(dst, mode="drop"),
        m.count + count,
    )


def distinct_blocks(rows: jax.Array, num_blocks: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Distinct non-null ids in ``rows`` (int32[...] over a pool of num_blocks).

    Returns (refs int32[num_blocks]: references per block id, ids int32[num_blocks]: the
    distinct ids in increasing order then 0-padding, count int32[]).
    """
    flat = rows.reshape(-1)
    refs = jnp.zeros((num_blocks,), jnp.int32).at[flat].add((flat != NULL_BLOCK).astype(jnp.int32))
    present = refs > 0
    ids = jnp.nonzero(present, size=num_blocks, fill_value=0)[0].astype(jnp.int32)
    return refs, ids, jnp.sum(present, dtype=jnp.int32)


def move_rows(
    src_pool: BlockPool,
    dst_pool: BlockPool,
    tables: BlockTables,
    mask: jax.Array,
    reserve: jax.Array | int = 0,
    pop: Callable[[BlockPool, jax.Array, int], tuple[BlockPool, jax.Array]] = bp.pop_blocks,
) -> tuple[BlockPool, BlockPool, BlockTables, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Move the masked rows' blocks from ``src_pool`` to ``dst_pool``, all or nothing.

    mask: bool[max_seqs]; the masked rows must hold ids of ``src_pool``. reserve: blocks
    that must stay free in ``dst_pool`` afterwards (refused otherwise). pop: the
    allocator of ``dst_pool``'s blocks (the free list's head unless an eviction policy's).
    Returns (src_pool', dst_pool', tables', src_ids int32[Ks], dst_ids int32[Ks], count,
    ok) where Ks = src_pool.num_blocks and pair i < count copies src_ids[i] -> dst_ids[i].
    A refused call (ok False) changes nothing and reports count 0.
    """
    mask = jnp.asarray(mask, bool)
    ks = src_pool.num_blocks
    rows = jnp.where(mask[:, None], tables.tables, NULL_BLOCK)
    refs, ids, count = distinct_blocks(rows, ks)
    ok = dst_pool.num_free - count >= jnp.asarray(reserve, jnp.int32)
    count = jnp.where(ok, count, 0)
    dst_pool, new = pop(dst_pool, count, ks)
    i = jnp.arange(ks, dtype=jnp.int32)
    live = i < count
    # Each destination block is referenced as often as its source block was by the rows.
    rc = dst_pool.refcount.at[jnp.where(live, new, dst_pool.num_blocks)].set(refs[ids], mode="drop")
    dst_pool = dst_pool._replace(refcount=rc)
    remap = jnp.zeros((ks,), jnp.int32).at[jnp.where(live, ids, ks)].set(new, mode="drop")
    flat = rows.reshape(-1)
    real = (flat != NULL_BLOCK) & ok
    order = jnp.nonzero(real, size=flat.shape[0], fill_value=0)[0]
    src_pool = bp.drop_refs(src_pool, flat[order], jnp.sum(real, dtype=jnp.int32))
    moved = mask & ok
    new_tables = jnp.where(moved[:, None], remap[tables.tables], tables.tables)
    return (
        src_pool,
        dst_pool,
        tables._replace(tables=new_tables),
        jnp.where(live, ids, 0),
        jnp.where(live, new, 0),
        count,
        ok,
    )
