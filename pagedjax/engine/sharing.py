"""Block sharing in the engine, on device: prefix-cache hits, registration, n > 1 forks.

Pure functions over ``SchedulerState`` (its ``mem`` is a ``PagedState``) and the
engine's token buffer ``int32[max_seqs, max_model_len]``; the engine jits each once.
The host side (hashes, the ``PrefixIndex`` hint, counters) lives in ``llm_engine.py``.

- ``attach_hits``: at admission (new request, or a sequence preempted by recompute),
  verify the host's hinted blocks against the prompt (the token buffer row), take a
  reference to the usable hit, write it into the slot's table row and set
  ``num_computed`` to the hit length, before the jitted ``schedule`` sees the request.
- ``attach_reloaded``: (host tier) extend those rows with the rest of their cached
  prefix: fresh blocks for the part on the host (the engine copies the KV in) and the
  device blocks that follow a host run, re-linked to it.
- ``register_step``: after a step, mark the blocks that step filled as cached.
- ``fork_children``: share a finished prompt's blocks with n - 1 child slots, in the
  parent's sequence group (gang-scheduled, preempted and swapped together).
- ``sharing_usage``: blocks in use vs. blocks that would be in use without sharing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.memory import block_pool as bp
from pagedjax.memory import block_stats as bst
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
        if mem.stats is not None:  # eviction statistics (lfu / cost policies)
            mem = mem._replace(stats=bst.hit(mem.stats, candidates[i], jnp.arange(m) < use))
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
    kinds: jax.Array,
    cands: jax.Array,
    mask: jax.Array,
) -> tuple[SchedulerState, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Extend WAITING slots' attached device hits with the rest of their cached prefix.

    slots int32[K], mask bool[K]; kinds int32[K, M] by table column: 1 = the block is on
    the host (a fresh block is taken for it, the engine copies the KV in), 2 = the device
    block ``cands[k, j]`` (a block still cached after a host run: its parent link names
    an evicted block, so it is re-linked to the block before it, which the host found
    by the chained hash), 0 = stop. A row's attached hit ends at column d = lengths / B;
    its run continues from d while each column is a host block or a device block that is
    cached, holds the row's tokens, was not taken by this call, and follows a host block
    of the run or names the device block before it as parent. The host blocks of the
    run must fit the free blocks (after the device ones are taken off the free list);
    the run is cut there. The run's blocks are attached (host: fresh, refcount 1; device: one more
    reference), registered as cached with the row's tokens and parents, and lengths /
    num_computed advance to its end.

    Returns (state', new int32[K, M]: the fresh blocks, for the run's host columns in
    order (first ``got``), got int32[K], total int32[K]: columns attached past d,
    was_cached bool[K, M]: a fresh block held a cached block (evicted now), old_tokens
    int32[K, M, B]: its tokens then).
    """
    mem = state.mem
    m = mem.tables.max_blocks_per_seq
    nb = mem.prefix.cached.shape[0]
    blocks = _block_tokens(tokens, slots, m, block_size)
    cols = jnp.arange(m, dtype=jnp.int32)
    null = jnp.full((1,), NULL_BLOCK, jnp.int32)

    def compact(sel: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        idx = jnp.nonzero(sel, size=m, fill_value=0)[0]
        return values[idx], jnp.sum(sel, dtype=jnp.int32)

    def body(i, carry):
        mem, num_computed, fresh, new_all, got_all, tot_all, was_all, old_all = carry
        s, ok = slots[i], mask[i]
        t, pc_state = mem.tables, mem.prefix
        d = t.lengths[s] // block_size
        kind = jnp.where(ok & (cols >= d), kinds[i], 0)
        cand = cands[i]
        sc = jnp.clip(cand, 0, nb - 1)
        prev_kind = jnp.concatenate([jnp.zeros((1,), jnp.int32), kind[:-1]])
        prev_cand = jnp.concatenate([null, cand[:-1]])
        dev_ok = (
            (cand > NULL_BLOCK) & (cand < nb) & pc_state.cached[sc] & ~fresh[sc]
            & jnp.all(pc_state.tokens[sc] == blocks[i], axis=1)
            & jnp.where(prev_kind == 2, pc_state.parent[sc] == prev_cand, prev_kind == 1)
        )  # fmt: skip
        col_ok = jnp.where(cols < d, True, (kind == 1) | ((kind == 2) & dev_ok))
        end = jnp.sum(jnp.cumprod(col_ok.astype(jnp.int32)))  # the run is [d, end)
        dev_sel = (cols >= d) & (cols < end) & (kind == 2)
        dev_ids, n_dev = compact(dev_sel, cand)
        pool = pc.acquire(mem.pool, dev_ids, n_dev)
        # Host blocks past the free ones cut the run; device blocks past the cut go back.
        host_sel = (cols >= d) & (cols < end) & (kind == 1)
        over = host_sel & (jnp.cumsum(host_sel) > pool.num_free)
        end = jnp.where(jnp.any(over), jnp.argmax(over), end).astype(jnp.int32)
        back_ids, n_back = compact(dev_sel & (cols >= end), cand)
        pool = bp.drop_refs(pool, back_ids, n_back)
        host_sel = host_sel & (cols < end)
        n = jnp.sum(host_sel, dtype=jnp.int32)
        pool, new = bst.pop_fn(mem.stats, pc_state.cached)(pool, n, m)
        valid = cols < n
        safe = jnp.where(valid, new, 0)
        was = valid & pc_state.cached[safe]
        old = pc_state.tokens[safe]
        fresh = fresh.at[jnp.where(valid, new, nb)].set(True, mode="drop")
        run = (cols >= d) & (cols < end)
        at_new = new[jnp.clip(jnp.cumsum(host_sel) - 1, 0, m - 1)]
        row = jnp.where(run, jnp.where(kind == 1, at_new, cand), t.tables[s])
        parents = jnp.concatenate([null, row[:-1]])
        prefix = pc.register(pc_state, row, parents, blocks[i], run)
        if mem.stats is not None:  # fresh blocks: new content at column j; all: a hit
            stats = bst.registered(mem.stats, row, cols, run & (kind == 1))
            mem = mem._replace(stats=bst.hit(stats, row, run))
        length = jnp.where(ok, end * block_size, t.lengths[s])
        tables = t._replace(
            tables=t.tables.at[s].set(row), lengths=t.lengths.at[s].set(length)
        )
        num_computed = num_computed.at[s].set(jnp.where(ok, length, num_computed[s]))
        mem = mem._replace(pool=pool, tables=tables, prefix=prefix)
        return (mem, num_computed, fresh, new_all.at[i].set(new), got_all.at[i].set(n),
                tot_all.at[i].set(jnp.where(ok, end - d, 0)), was_all.at[i].set(was),
                old_all.at[i].set(old))  # fmt: skip

    k = slots.shape[0]
    init = (
        mem,
        state.num_computed,
        jnp.zeros((nb,), bool),
        jnp.zeros((k, m), jnp.int32),
        jnp.zeros((k,), jnp.int32),
        jnp.zeros((k,), jnp.int32),
        jnp.zeros((k, m), bool),
        jnp.zeros((k, m, block_size), jnp.int32),
    )
    mem, num_computed, _, new, got, total, was, old = jax.lax.fori_loop(0, k, body, init)
    return state._replace(mem=mem, num_computed=num_computed), new, got, total, was, old


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
    if mem.stats is not None:  # eviction statistics: new contents at depth j
        depth = jnp.broadcast_to(j, full.shape).reshape(-1)
        mem = mem._replace(stats=bst.registered(mem.stats, table.reshape(-1), depth,
                                                full.reshape(-1)))  # fmt: skip
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
