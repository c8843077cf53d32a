"""Block tables: each sequence's logical-to-physical block map, as arrays.

``tables[s, i]`` is the physical block holding tokens ``[i*B, (i+1)*B)`` of sequence
slot ``s`` (B = block size); unused entries hold the null block. ``lengths[s]`` is the
number of tokens the sequence holds. Invariant: a sequence of length L holds exactly
ceil(L / B) blocks, allocated on demand as it grows.

All functions are pure and jittable; they thread the BlockPool alongside, since every
change to a table changes reference counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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
    # numpy, one device_put: no op-by-op XLA programs outside jit (create_block_pool)
    return BlockTables(*jax.device_put((
        np.full((max_seqs, max_blocks_per_seq), NULL_BLOCK, np.int32),
        np.zeros((max_seqs,), np.int32),
    ), may_alias=False))  # fmt: skip


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
    pop: Callable[[BlockPool, jax.Array, int], tuple[BlockPool, jax.Array]] = bp.pop_blocks,
) -> tuple[BlockPool, BlockTables, CopyOnWrite, jax.Array]:
    """Append ``ns[i]`` tokens to ``seq_ids[i]`` for each masked i, in array (priority) order.

    Equivalent to calling ``append_tokens`` on each masked entry in order: when the pool
    cannot serve all, earlier entries are served first, and a refused entry changes
    nothing (later, smaller ones may still succeed). Masked ``seq_ids`` must be distinct.

    It runs as: a scan over scalars that decides each entry (free blocks left, and
    copy-on-write of shared last blocks, counting copies made by earlier entries); one
    pop of all granted blocks from the free list; and one scatter into the tables. Cost
    is O(B^2 + blocks granted), never a per-entry copy of the tables or the pool.

    Args: seq_ids, ns int32[B]; mask bool[B]; min_free_after scalar or int32[B]; pop:
      the allocator taking the granted blocks (``block_pool.pop_blocks``, the free list's
      head; an eviction policy's ``block_stats.pop_victims`` otherwise).
    Returns: (pool', bt', cow (each field [B]), ok bool[B]); ok is True where not masked.
    """
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    ns = jnp.asarray(ns, jnp.int32)
    mask = jnp.asarray(mask, bool)
    nb = seq_ids.shape[0]
    m = bt.max_blocks_per_seq
    reserve = jnp.broadcast_to(jnp.asarray(min_free_after, jnp.int32), (nb,))
    valid_seq = (seq_ids >= 0) & (seq_ids < bt.max_seqs)
    s = jnp.where(valid_seq, seq_ids, 0)
    length = bt.lengths[s]
    held = blocks_for(length, block_size)
    new_len = length + ns
    need = blocks_for(new_len, block_size) - held
    last = bt.tables[s, jnp.maximum(held - 1, 0)]
    writes_into_last = (ns > 0) & (length % block_size != 0)
    last_rc = pool.refcount[last]
    fits = valid_seq & (ns >= 0) & (ns <= max_new_tokens) & (blocks_for(new_len, block_size) <= m)

    def decide(carry, i):
        free, copied_from = carry
        # Earlier copies of the same shared block lowered its refcount.
        rc = last_rc[i] - jnp.sum(copied_from == last[i])
        cow = writes_into_last[i] & (rc > 1)
        total = need[i] + cow.astype(jnp.int32)
        ok = mask[i] & fits[i] & (free - total >= reserve[i])
        free = free - jnp.where(ok, total, 0)
        copied_from = copied_from.at[i].set(jnp.where(ok & cow, last[i], -1))
        return (free, copied_from), (ok, cow & ok)

    init = (pool.num_free, jnp.full((nb,), -1, jnp.int32))
    _, (ok, cow) = jax.lax.scan(decide, init, jnp.arange(nb))
    counts = jnp.where(ok, need + cow.astype(jnp.int32), 0)
    offsets = jnp.cumsum(counts) - counts
    max_new_blocks = (max_new_tokens + block_size - 1) // block_size + 1
    pool, popped = pop(pool, jnp.sum(counts), nb * max_new_blocks)

    # Copy-on-write: the entry's first popped block replaces its shared last block.
    cow_dst = popped[offsets]
    n_cow = jnp.sum(cow)
    cow_entries = jnp.nonzero(cow, size=nb, fill_value=0)[0]
    pool = bp.drop_refs(pool, last[cow_entries], n_cow)  # never reaches 0: rc was > 1
    tables = bt.tables.at[jnp.where(cow, s, bt.max_seqs), held - 1].set(cow_dst, mode="drop")

    # Fresh blocks go to positions held .. held + need - 1 of each row.
    k = jnp.arange(max_new_blocks, dtype=jnp.int32)[None, :]
    take = ok[:, None] & (k < need[:, None])
    src = offsets[:, None] + cow[:, None].astype(jnp.int32) + k
    rows = jnp.where(take, s[:, None], bt.max_seqs)
    tables = tables.at[rows, held[:, None] + k].set(popped[jnp.where(take, src, 0)], mode="drop")
    lengths = bt.lengths.at[jnp.where(ok, s, bt.max_seqs)].set(new_len, mode="drop")
    copies = CopyOnWrite(last, jnp.where(cow, cow_dst, NULL_BLOCK), cow)
    return pool, BlockTables(tables, lengths), copies, ok | ~mask


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
    """``release`` for each masked entry of ``seq_ids`` (int32[B], bool[B]; distinct ids).

    The masked rows' blocks are compacted into one list and dropped in one loop, in row
    order, so the cost follows the blocks freed rather than B * max_blocks_per_seq.
    """
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    mask = jnp.asarray(mask, bool) & (seq_ids >= 0) & (seq_ids < bt.max_seqs)
    s = jnp.where(mask, seq_ids, 0)
    rows = jnp.where(mask[:, None], bt.tables[s], NULL_BLOCK).reshape(-1)
    real = rows != NULL_BLOCK
    order = jnp.nonzero(real, size=rows.shape[0], fill_value=0)[0]
    pool = bp.drop_refs(pool, rows[order], jnp.sum(real))
    gone = jnp.where(mask, s, bt.max_seqs)
    tables = bt.tables.at[gone].set(NULL_BLOCK, mode="drop")
    lengths = bt.lengths.at[gone].set(0, mode="drop")
    return pool, BlockTables(tables, lengths)


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
