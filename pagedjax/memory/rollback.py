"""Roll sequences back to a shorter length: blocks wholly past it return to the pool.

Speculative decoding (docs/speculative_decoding.md) grows a sequence by its k proposed
tokens through the normal grow path, so their KV has slots for the verification step;
after it, only the accepted prefix stays. ``truncate_batched`` drops the references a
sequence holds to blocks past ``ceil(new_len / B)`` and sets its length to ``new_len``,
so the block-table invariant (a sequence of length L holds exactly ceil(L / B) blocks)
holds again and the free count equals that of a run that never proposed the rejected
tokens (block ids may differ: the freed blocks go to the LRU free list's tail).

Contract: ``new_lens[i] <= lengths[seq_ids[i]]`` for masked rows (a longer length is
clamped: this never grows). The dropped blocks must not be registered in the prefix
cache: they hold rejected tokens only, and the grow that handed them out invalidated
their cache entries, so nothing has to be forgotten here. Rows must be distinct.

Cost: O(B * M) to find the blocks (B rows, M blocks per row), O(freed) pool updates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.memory import block_pool as bp
from pagedjax.memory.block_pool import NULL_BLOCK, BlockPool
from pagedjax.memory.block_table import BlockTables, blocks_for


def truncate_batched(
    pool: BlockPool,
    bt: BlockTables,
    seq_ids: jax.Array,
    new_lens: jax.Array,
    mask: jax.Array,
    block_size: int,
) -> tuple[BlockPool, BlockTables]:
    """Shorten each masked sequence to ``new_lens`` tokens (int32[B] ids and lengths,
    bool[B] mask); returns (pool', tables'). See the module docstring."""
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    mask = jnp.asarray(mask, bool) & (seq_ids >= 0) & (seq_ids < bt.max_seqs)
    s = jnp.where(mask, seq_ids, 0)
    new_lens = jnp.minimum(jnp.maximum(jnp.asarray(new_lens, jnp.int32), 0), bt.lengths[s])
    keep = blocks_for(new_lens, block_size)  # [B]
    rows = bt.tables[s]  # [B, M]
    j = jnp.arange(bt.max_blocks_per_seq, dtype=jnp.int32)[None, :]
    drop = mask[:, None] & (j >= keep[:, None]) & (rows != NULL_BLOCK)
    flat = jnp.where(drop, rows, NULL_BLOCK).reshape(-1)
    order = jnp.nonzero(flat != NULL_BLOCK, size=flat.shape[0], fill_value=0)[0]
    pool = bp.drop_refs(pool, flat[order], jnp.sum(drop, dtype=jnp.int32))
    gone = jnp.where(mask, s, bt.max_seqs)  # out of range: dropped
    tables = bt.tables.at[gone].set(jnp.where(drop, NULL_BLOCK, rows), mode="drop")
    lengths = bt.lengths.at[gone].set(new_lens, mode="drop")
    return pool, BlockTables(tables, lengths)


__all__ = ["truncate_batched"]
