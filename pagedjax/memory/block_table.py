"""Block tables: each sequence's logical-to-physical block map, as arrays.

``tables[s, i]`` is the physical block holding tokens ``[i*B, (i+1)*B)`` of sequence
slot ``s`` (B = block size); unused entries hold the null block. ``lengths[s]`` is the
number of tokens the sequence holds. Invariant: a sequence of length L holds exactly
ceil(L / B) blocks, allocated on demand as it grows.

All functions are pure and jittable; they thread the BlockPool alongside, since every
change to a table changes reference counts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.memory import block_pool as bp
from pagedjax.memory.block_pool import NULL_BLOCK, BlockPool

# A slot index that every KV write drops (out of range for any pool). Never use -1:
# negative indices wrap to the last slot.
PAD_SLOT = jnp.iinfo(jnp.int32).max


class BlockTables(NamedTuple):
    """tables: int32[max_seqs, max_blocks_per_seq]; lengths: int32[max_seqs]."""

    tables: jax.Array
    lengths: jax.Array

    @property
    def max_seqs(self) -> int:
        return self.tables.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.tables.shape[1]


class CopyOnWrite(NamedTuple):
    """A KV block copy the caller must perform before writing: src -> dst, if valid."""

    src: jax.Array
    dst: jax.Array
    valid: jax.Array


def create_block_tables(max_seqs: int, max_blocks_per_seq: int) -> BlockTables:
    if max_seqs < 1 or max_blocks_per_seq < 1:
        raise ValueError(
            f"max_seqs and max_blocks_per_seq must be >= 1, got {max_seqs}, {max_blocks_per_seq}"
        )
    return BlockTables(
        tables=jnp.full((max_seqs, max_blocks_per_seq), NULL_BLOCK, jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
    )


def blocks_for(length: jax.Array, block_size: int) -> jax.Array:
    """ceil(length / block_size), the blocks a sequence of that length holds."""
    return (length + block_size - 1) // block_size


def slot_mapping(
    tables: jax.Array, seq_ids: jax.Array, positions: jax.Array, valid: jax.Array, block_size: int
) -> jax.Array:
    """KV slot of each token: ``tables[seq, pos // B] * B + pos % B``; PAD_SLOT where invalid.

    Args: tables int32[S, M]; seq_ids, positions int32[T]; valid bool[T].
    Returns: int32[T].
    """
    seq = jnp.where(valid, seq_ids, 0)
    pos = jnp.where(valid, positions, 0)
    block = tables[seq, pos // block_size]
    return jnp.where(valid, block * block_size + pos % block_size, PAD_SLOT).astype(jnp.int32)


def append_tokens(
    pool: BlockPool,
    bt: BlockTables,
    seq: jax.Array,
    n: jax.Array,
    block_size: int,
    max_new_tokens: int,
    min_free_after: jax.Array | int = 0,
) -> tuple[BlockPool, BlockTables, jax.Array, CopyOnWrite, jax.Array]:
    """Append ``n`` tokens to sequence ``seq``, allocating only at block boundaries.

    If the sequence's last block is partly filled and shared (after a fork), it is
    copied on write first: the returned CopyOnWrite names the KV copy to perform.

    Args:
      seq: int32 slot id; n: int32 tokens, 0 <= n <= max_new_tokens (static bound).
      min_free_after: blocks that must remain free (admission watermark).
    Returns:
      (pool', bt', slots int32[max_new_tokens] (PAD_SLOT past n), cow, ok). When not ok
      (out of blocks, too long for the table, bad arguments) nothing changes.
    """
    seq = jnp.asarray(seq, jnp.int32)
    n = jnp.asarray(n, jnp.int32)
    m = bt.max_blocks_per_seq
    valid_seq = (seq >= 0) & (seq < bt.max_seqs)
    s = jnp.where(valid_seq, seq, 0)
    length = bt.lengths[s]
    held = blocks_for(length, block_size)
    new_len = length + n
    need = blocks_for(new_len, block_size) - held
    row = bt.tables[s]
    last = row[jnp.maximum(held - 1, 0)]
    writes_into_last = (n > 0) & (length % block_size != 0)
    last_shared = writes_into_last & (pool.refcount[last] > 1)
    total_new = need + last_shared.astype(jnp.int32)
    max_new_blocks = (max_new_tokens + block_size - 1) // block_size + 1
    ok = (
        valid_seq
        & (n >= 0)
        & (n <= max_new_tokens)
        & (blocks_for(new_len, block_size) <= m)
        & (pool.num_free - total_new >= min_free_after)
    )

    def do(args):
        pool, bt = args
        pool, target, copied, _ = bp.copy_on_write(pool, jnp.where(last_shared, last, NULL_BLOCK))
        row2 = jnp.where(last_shared, row.at[held - 1].set(target), row)
        pool, fresh, _ = bp.allocate(pool, need, max_new_blocks)
        idx = jnp.arange(max_new_blocks, dtype=jnp.int32)
        row2 = row2.at[jnp.where(idx < need, held + idx, m)].set(fresh, mode="drop")
        bt = BlockTables(bt.tables.at[s].set(row2), bt.lengths.at[s].set(new_len))
        cow = CopyOnWrite(last, target, copied)
        return pool, bt, cow

    def refuse(args):
        pool, bt = args
        z = jnp.asarray(NULL_BLOCK, jnp.int32)
        return pool, bt, CopyOnWrite(z, z, jnp.asarray(False))

    pool, bt, cow = jax.lax.cond(ok, do, refuse, (pool, bt))
    tok = jnp.arange(max_new_tokens, dtype=jnp.int32)
    slots = slot_mapping(bt.tables, jnp.full_like(tok, s), length + tok, ok & (tok < n), block_size)
    return pool, bt, slots, cow, ok


def append_tokens_batched(
    pool: BlockPool,
    bt: BlockTables,
    seq_ids: jax.Array,
    ns: jax.Array,
    mask: jax.Array,
    block_size: int,
    max_new_tokens: int,
    min_free_after: jax.Array | int = 0,
) -> tuple[BlockPool, BlockTables, CopyOnWrite, jax.Array]:
    """Append ``ns[i]`` tokens to ``seq_ids[i]`` for each masked i, in array (priority) order.

    Each entry succeeds or fails on its own: when the pool cannot serve all, earlier
    entries are served first and a refused entry changes nothing.

    Args: seq_ids, ns int32[B]; mask bool[B]; min_free_after scalar or int32[B].
    Returns: (pool', bt', cow (each field [B]), ok bool[B]); ok is True where not masked.
    """
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    ns = jnp.asarray(ns, jnp.int32)
    reserve = jnp.broadcast_to(jnp.asarray(min_free_after, jnp.int32), seq_ids.shape)

    def body(carry, x):
        pool, bt = carry
        seq, n, m, r = x

        def go(c):
            pool, bt = c
            pool, bt, _, cow, ok = append_tokens(pool, bt, seq, n, block_size, max_new_tokens, r)
            return (pool, bt), cow, ok

        def skip(c):
            z = jnp.asarray(NULL_BLOCK, jnp.int32)
            return c, CopyOnWrite(z, z, jnp.asarray(False)), jnp.asarray(True)

        carry, cow, ok = jax.lax.cond(m, go, skip, (pool, bt))
        return carry, (cow, ok)

    (pool, bt), (cow, ok) = jax.lax.scan(body, (pool, bt), (seq_ids, ns, mask, reserve))
    return pool, bt, cow, ok


def release(pool: BlockPool, bt: BlockTables, seq: jax.Array) -> tuple[BlockPool, BlockTables]:
    """Drop the sequence's references to all its blocks and empty its row."""
    seq = jnp.asarray(seq, jnp.int32)
    valid = (seq >= 0) & (seq < bt.max_seqs)
    s = jnp.where(valid, seq, 0)
    row = jnp.where(valid, bt.tables[s], NULL_BLOCK)
    pool, _ = bp.free(pool, row)
    tables = jnp.where(valid, bt.tables.at[s].set(NULL_BLOCK), bt.tables)
    lengths = jnp.where(valid, bt.lengths.at[s].set(0), bt.lengths)
    return pool, BlockTables(tables, lengths)


def release_batched(
    pool: BlockPool, bt: BlockTables, seq_ids: jax.Array, mask: jax.Array
) -> tuple[BlockPool, BlockTables]:
    """``release`` for each masked entry of ``seq_ids`` (int32[B], bool[B])."""

    def body(carry, x):
        seq, m = x
        carry = jax.lax.cond(m, lambda c: release(c[0], c[1], seq), lambda c: c, carry)
        return carry, None

    (pool, bt), _ = jax.lax.scan(body, (pool, bt), (jnp.asarray(seq_ids, jnp.int32), mask))
    return pool, bt


def fork(
    pool: BlockPool, bt: BlockTables, parent: jax.Array, child: jax.Array
) -> tuple[BlockPool, BlockTables, jax.Array]:
    """Make ``child`` share all of ``parent``'s blocks (refcount + 1 each).

    Refused if either id is invalid, they are equal, or the child slot is not empty.
    """
    parent = jnp.asarray(parent, jnp.int32)
    child = jnp.asarray(child, jnp.int32)
    ok = (
        (parent >= 0)
        & (parent < bt.max_seqs)
        & (child >= 0)
        & (child < bt.max_seqs)
        & (parent != child)
    )
    p = jnp.where(ok, parent, 0)
    c = jnp.where(ok, child, 0)
    ok = ok & (bt.lengths[c] == 0) & jnp.all(bt.tables[c] == NULL_BLOCK)

    def do(args):
        pool, bt = args
        row = bt.tables[p]
        pool, _ = bp.incref(pool, row)
        return pool, BlockTables(bt.tables.at[c].set(row), bt.lengths.at[c].set(bt.lengths[p]))

    pool, bt = jax.lax.cond(ok, do, lambda a: a, (pool, bt))
    return pool, bt, ok
