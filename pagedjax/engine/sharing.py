"""Block sharing in the engine, on device: prefix-cache hits, registration, n > 1 forks.

Pure functions over ``SchedulerState`` (its ``mem`` is a ``PagedState``) and the
engine's token buffer ``int32[max_seqs, max_model_len]``; the engine jits each once.
The host side (hashes, the ``PrefixIndex`` hint, counters) lives in ``llm_engine.py``.

- ``attach_hits``: at admission (new request, or a sequence preempted by recompute),
  verify the host's hinted blocks against the prompt (the token buffer row), take a
  reference to the usable hit, write it into the slot's table row and set
  ``num_computed`` to the hit length, before the jitted ``schedule`` sees the request.
- ``attach_reloaded``: (host tier) extend those rows with fresh blocks for the part of
  the prefix found on the host, registered as cached; the engine copies the KV in.
- ``register_step``: after a step, mark the blocks that step filled as cached.
- ``fork_children``: share a finished prompt's blocks with n - 1 child slots, in the
  parent's sequence group (gang-scheduled, preempted and swapped together).
- ``sharing_usage``: blocks in use vs. blocks that would be in use without sharing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.memory import block_pool as bp
from pagedjax.memory import prefix_cache as pc
from pagedjax.memory.block_pool import NULL_BLOCK
from pagedjax.memory.block_table import blocks_for
from pagedjax.scheduler import RUNNING, WAITING, SchedulerState, add_requests


def _block_tokens(tokens: jax.Array, rows: jax.Array, num_blocks: int, b: int) -> jax.Array:
    """int32[len(rows), num_blocks, b]: the token buffer rows cut into blocks (-1 pad)."""
    width = num_blocks * b
    buf = tokens[rows]
    pad = width - buf.shape[1]
    if pad > 0:
        buf = jnp.pad(buf, ((0, 0), (0, pad)), constant_values=-1)
    return buf[:, :width].reshape(rows.shape[0], num_blocks, b)


def attach_hits(
    block_size: int,
    state: SchedulerState,
    tokens: jax.Array,
    slots: jax.Array,
    candidates: jax.Array,
    mask: jax.Array,
) -> tuple[SchedulerState, jax.Array, jax.Array]:
    """Reuse verified cached blocks for WAITING slots with an empty block-table row.

    slots int32[K], candidates int32[K, M] (hinted block ids, NULL_BLOCK-padded), mask
    bool[K]. A slot's tokens are its buffer row's first prompt_len + output_len ids.
    Returns (state', verified int32[K] blocks accepted by ``match``, used int32[K] blocks
    attached: ``usable_hit`` of verified, so the last token is always computed).
    """
    mem = state.mem
    m = mem.tables.max_blocks_per_seq
    blocks = _block_tokens(tokens, slots, m, block_size)

    def body(i, carry):
        mem, num_computed, verified, used = carry
        s, ok = slots[i], mask[i]
        total = state.prompt_len[s] + state.output_len[s]
        hit = pc.match(mem.prefix, candidates[i], blocks[i], total // block_size)
        # usable_hit, as array code: a hit reaching the last token drops its last block.
        use = jnp.where(hit * block_size >= total, jnp.maximum(0, (total - 1) // block_size), hit)
        use = jnp.where(ok, use, 0)
        pool = pc.acquire(mem.pool, candidates[i], use)
        row = jnp.where(jnp.arange(m) < use, candidates[i], NULL_BLOCK)
        t = mem.tables
        # An unmasked row is left as it is (its slot may be live).
        tables = t._replace(
            tables=t.tables.at[s].set(jnp.where(ok, row, t.tables[s])),
            lengths=t.lengths.at[s].set(jnp.where(ok, use * block_size, t.lengths[s])),
        )
        num_computed = num_computed.at[s].set(jnp.where(ok, use * block_size, num_computed[s]))
        mem = mem._replace(pool=pool, tables=tables)
        return mem, num_computed, verified.at[i].set(hit), used.at[i].set(use)

    k = slots.shape[0]
    z = jnp.zeros((k,), jnp.int32)
    mem, num_computed, verified, used = jax.lax.fori_loop(
        0, k, body, (mem, state.num_computed, z, z)
    )
    return state._replace(mem=mem, num_computed=num_computed), verified, used


def attach_reloaded(
    block_size: int,
    state: SchedulerState,
    tokens: jax.Array,
    slots: jax.Array,
    counts: jax.Array,
    mask: jax.Array,
) -> tuple[SchedulerState, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Give WAITING slots fresh blocks for the host-tier part of their prefix hit.

    slots int32[K], counts int32[K] (blocks found on the host, continuing the row's
    attached device hit: the row holds lengths[s] / B blocks), mask bool[K]. Each masked
    row takes min(count, free blocks, room in its row) blocks from the pool's free list
    (a cached block among them is evicted: its old tokens are returned so the engine
    can keep it on the host too), appends them to its table row, registers them as
    cached with the row's tokens and parents (the engine writes their KV from the host
    before any program reads them), and advances lengths and num_computed.

    Returns (state', new int32[K, M] block ids (first ``got`` real), got int32[K],
    was_cached bool[K, M]: the new block held a cached block, old_tokens int32[K, M, B]:
    its tokens then).
    """
    mem = state.mem
    m = mem.tables.max_blocks_per_seq
    blocks = _block_tokens(tokens, slots, m, block_size)
    cols = jnp.arange(m, dtype=jnp.int32)

    def body(i, carry):
        mem, num_computed, new_all, got_all, was_all, old_all = carry
        s, ok = slots[i], mask[i]
        t = mem.tables
        d = t.lengths[s] // block_size
        n = jnp.where(ok, jnp.minimum(jnp.minimum(counts[i], mem.pool.num_free), m - d), 0)
        pool, new = bp.pop_blocks(mem.pool, n, m)
        valid = cols < n
        safe = jnp.where(valid, new, 0)
        was = valid & mem.prefix.cached[safe]
        old = mem.prefix.tokens[safe]
        at = jnp.where(valid, d + cols, m)  # table columns of the new blocks
        row = t.tables[s].at[at].set(new, mode="drop")
        parents = jnp.where(d + cols > 0, row[jnp.clip(d + cols - 1, 0, m - 1)], NULL_BLOCK)
        toks = blocks[i][jnp.clip(d + cols, 0, m - 1)]
        prefix = pc.register(mem.prefix, new, parents, toks, valid)
        length = (d + n) * block_size
        tables = t._replace(
            tables=t.tables.at[s].set(row),
            lengths=t.lengths.at[s].set(jnp.where(ok, length, t.lengths[s])),
        )
        num_computed = num_computed.at[s].set(jnp.where(ok, length, num_computed[s]))
        mem = mem._replace(pool=pool, tables=tables, prefix=prefix)
        return (mem, num_computed, new_all.at[i].set(new), got_all.at[i].set(n),
                was_all.at[i].set(was), old_all.at[i].set(old))  # fmt: skip

    k = slots.shape[0]
    init = (
        mem,
        state.num_computed,
        jnp.zeros((k, m), jnp.int32),
        jnp.zeros((k,), jnp.int32),
        jnp.zeros((k, m), bool),
        jnp.zeros((k, m, block_size), jnp.int32),
    )
    mem, num_computed, new, got, was, old = jax.lax.fori_loop(0, k, body, init)
    return state._replace(mem=mem, num_computed=num_computed), new, got, was, old


def register_step(
    block_size: int,
    state: SchedulerState,
    tokens: jax.Array,
    seq_ids: jax.Array,
    start_pos: jax.Array,
    q_lens: jax.Array,
) -> SchedulerState:
    """Mark as cached the full blocks a step's rows completed (their KV is now written).

    seq_ids, start_pos, q_lens: the ScheduledBatch's ``[max_seqs]`` rows (-1 = padding).
    Block j of a row is newly full iff start_pos // B <= j < (start_pos + q_len) // B.
    """
    mem = state.mem
    n, m = mem.tables.tables.shape
    row_ok = seq_ids >= 0
    sid = jnp.where(row_ok, seq_ids, 0)
    j = jnp.arange(m)[None, :]
    full = (
        row_ok[:, None]
        & (j >= (start_pos // block_size)[:, None])
        & (j < ((start_pos + q_lens) // block_size)[:, None])
    )
    table = mem.tables.tables[sid]  # [n, m]
    parents = jnp.concatenate([jnp.full((n, 1), NULL_BLOCK, jnp.int32), table[:, :-1]], axis=1)
    toks = _block_tokens(tokens, sid, m, block_size)
    prefix = pc.register(
        mem.prefix,
        table.reshape(-1),
        parents.reshape(-1),
        toks.reshape(n * m, block_size),
        full.reshape(-1),
    )
    return state._replace(mem=mem._replace(prefix=prefix))


def fork_children(
    block_size: int,
    state: SchedulerState,
    parent: jax.Array,
    children: jax.Array,
    mask: jax.Array,
    max_tokens: jax.Array,
    arrivals: jax.Array,
) -> SchedulerState:
    """Start n - 1 samples that share the parent's prompt blocks (refcount + 1 each).

    parent: int32[] slot whose prompt (length P) was just computed. children int32[K]
    FREE slots, mask bool[K], max_tokens / arrivals int32[K]. Each child gets the
    parent's blocks covering its first P - 1 tokens, num_computed = P - 1, the parent's
    group id and RUNNING status: it joins the running group at once (no admission, as
    vLLM's forked sequences, so the group is scheduled, preempted and swapped as one and
    no admission rule can strand a child holding shared blocks), computes the last
    prompt token itself next step (copying the shared partial block on write when there
    is one) and samples its first token with its own sample index, so sample k is the
    same as sample k of an unshared run.
    """
    mem = state.mem
    m = mem.tables.max_blocks_per_seq
    p_len = state.prompt_len[parent]
    shared = p_len - 1
    row = jnp.where(jnp.arange(m) < blocks_for(shared, block_size), mem.tables.tables[parent], 0)
    row = row.astype(jnp.int32)

    def body(i, pool):
        add = jnp.where(mask[i], row, NULL_BLOCK)
        return bp.incref(pool, add)[0]

    pool = jax.lax.fori_loop(0, children.shape[0], body, mem.pool)
    ids = jnp.where(mask, children, state.max_seqs)  # out of range: dropped
    t = mem.tables
    tables = t._replace(
        tables=t.tables.at[ids].set(jnp.broadcast_to(row, (ids.shape[0], m)), mode="drop"),
        lengths=t.lengths.at[ids].set(shared, mode="drop"),
    )
    state = add_requests(
        state,
        children,
        jnp.broadcast_to(p_len, children.shape),
        max_tokens,
        p_len + max_tokens,
        arrivals,
        mask,
        jnp.broadcast_to(state.group[parent], children.shape),
    )
    return state._replace(
        mem=mem._replace(pool=pool, tables=tables),
        num_computed=state.num_computed.at[ids].set(shared, mode="drop"),
        status=state.status.at[ids].set(RUNNING, mode="drop"),
    )


def sharing_usage(block_size: int, state: SchedulerState) -> tuple[jax.Array, jax.Array]:
    """(blocks referenced, blocks the live rows would hold without sharing): int32[] each.

    Without sharing every sequence holds its own ceil(len / B) blocks; with it a shared
    block counts once (refcount > 0). Free cached blocks count as free; swapped-out
    sequences hold host blocks, not device ones, and are not counted.
    """
    used = jnp.sum(state.mem.pool.refcount > 0, dtype=jnp.int32)
    live = (state.status == WAITING) | (state.status == RUNNING)
    lens = state.mem.tables.lengths
    unshared = jnp.sum(jnp.where(live, blocks_for(lens, block_size), 0), dtype=jnp.int32)
    return used, unshared
