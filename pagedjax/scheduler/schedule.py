"""One scheduling decision: who runs this step, how many tokens each, who is preempted.

Rules (docs/scheduler.md gives the reasons; ``reference.py`` states them sequentially):

1. Reject WAITING requests that can never run: prompt over ``config.prompt_limit``
   (paper/static modes: prompt + generated output, which a recompute must prefill whole).
   A WAITING slot may hold memory: the engine attaches its prefix-cache hit before the
   step (``num_computed > 0``). Such holds give way to everything else (2 and 4).
2. RUNNING sequences, group by group (groups in the order of their best member, members
   in priority order), each take ``min(remaining, budget left)`` tokens (a decode is 1)
   and grow their memory to ``num_computed + q``, all or nothing per group. At the first
   failed grow, every WAITING slot's hold is released (num_computed back to 0) and the
   grow retried. When it still fails, the lowest-priority running group not yet
   visited is preempted whole (by swap or recompute, per ``config.preemption_mode``;
   recompute when the host pool cannot take it) and the grow retried; if that victim
   would be the group itself, it is preempted and the pass ends. A group that fails
   alone (everything else preempted, every hold released) can never fit: it finishes
   with REASON_CAPACITY instead.
3. If nobody was preempted, SWAPPED groups in priority order are swapped back in (all
   members, RUNNING from the next step) while the device keeps watermark + one block
   per member free; the first that does not fit stops.
4. If nobody was preempted, no group is still swapped out (and, in static mode, nothing
   runs), WAITING sequences in priority order are admitted strictly in order while the
   number of running sequences stays within max_num_seqs (static: static_batch_size)
   and the budget allows: default mode chunks the last prompt to the budget left,
   paper/static modes need it whole. A slot whose hold was released this step stops
   admission (the engine looks its prefix up again first). Admission grows with the
   policy's watermark; at the first refusal the holds of the WAITING slots behind the
   refused one are released and it is retried (alone: admission then ends for the
   step); the refusal that remains stops admission, and if nothing runs the refused
   request can never fit (REASON_CAPACITY). Rejected slots release their holds.

The common case (no preemption, no refusal, nothing swapped) costs a few batched policy
calls; the sequential preemption and swap-in loops only run when needed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pagedjax.scheduler.config import SchedulerLimits
from pagedjax.scheduler.priority import priority_order
from pagedjax.scheduler.state import (
    FINISHED,
    REASON_CAPACITY,
    REASON_TOO_LONG,
    RUNNING,
    SWAPPED,
    WAITING,
    SchedulerState,
    max_lens,
)


class SwapPlan(NamedTuple):
    """This step's swap work, for the engine to copy before the model step.

    out_src, out_dst: int32[K] device -> host block pairs; the first ``num_out`` are
        real (K static: the device pool's size for the paged policy, 1 for policies
        without block ids). in_src, in_dst: int32[K] host -> device pairs, ``num_in``.
    swapped_out: bool[max_seqs] by slot: preempted by swap this step (also in
        ``ScheduledBatch.preempted``). swapped_in: bool[max_seqs]: back on device this
        step (RUNNING; they run from the next step).
    """

    out_src: jax.Array
    out_dst: jax.Array
    num_out: jax.Array
    in_src: jax.Array
    in_dst: jax.Array
    num_in: jax.Array
    swapped_out: jax.Array
    swapped_in: jax.Array


class ScheduledBatch(NamedTuple):
    """One step's batch. Row arrays are ``[max_seqs]`` in batch order: scheduled running
    sequences (priority order), then new admissions (priority order), then padding.

    seq_ids: int32 slot ids; -1 in padding rows.
    q_lens: int32 tokens computed this step (a decode is 1); 0 in padding rows.
    start_pos: int32 num_computed before the step: the row's first query position.
    emits: bool, the row's last token completes prompt + generated output, so its logits
        are sampled (False for a non-final prefill chunk and for padding).
    num_seqs: int32[] scheduled rows. num_tokens: int32[] sum of q_lens (padding bucket).
    preempted: bool[max_seqs] by slot: preempted this step (recompute or swap).
    rejected: bool[max_seqs] by slot: finished this step without running (too long, or
        cannot fit the pool); see state.finish_reason.
    swap: SwapPlan (always set by ``schedule``; None only in hand-built batches).
    released: bool[max_seqs] by slot: WAITING slots whose attached prefix-cache hit was
        released this step (num_computed back to 0) so that a running sequence or an
        admission could have the memory; the engine looks their prefixes up again.
        None only in hand-built batches.
    spec_lens: int32 speculative (draft) positions among the row's q_lens: a RUNNING
        decode row given ``lookahead`` drafts computes 1 + k tokens (its last token and k
        drafts; ``emits`` is set), the step verifies them; 0 elsewhere. None only in
        hand-built batches.
    """

    seq_ids: jax.Array
    q_lens: jax.Array
    start_pos: jax.Array
    emits: jax.Array
    num_seqs: jax.Array
    num_tokens: jax.Array
    preempted: jax.Array
    rejected: jax.Array
    swap: SwapPlan | None = None
    released: jax.Array | None = None
    spec_lens: jax.Array | None = None


def _tree_where(c: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)


def _first_false(ok: jax.Array, mask: jax.Array) -> jax.Array:
    """Index of the first masked entry with ok False; len(ok) if none."""
    bad = mask & ~ok
    n = ok.shape[0]
    return jnp.where(jnp.any(bad), jnp.argmax(bad), n).astype(jnp.int32)


def _budget_prefix(need: jax.Array, budget: jax.Array) -> jax.Array:
    """Greedy min(need_i, budget left) in array order, vectorized: int32 like need."""
    before = jnp.cumsum(need) - need
    return jnp.clip(budget - before, 0, need).astype(jnp.int32)


def group_order(state: SchedulerState, config: SchedulerLimits, members: jax.Array) -> jax.Array:
    """Like ``priority_order`` but group-contiguous: groups ordered by their best member,
    members by priority within the group. For n = 1 groups it is the priority order.
    Group ids are any int32 (one sort, no table indexed by group id)."""
    n = state.max_seqs
    order = priority_order(state, config, members)
    pos = jnp.arange(n, dtype=jnp.int32)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(pos)
    # Sorted by (group, rank), each group's first entry holds its best rank. Non-members
    # rank after all members, so they never lower a member group's best.
    by_group = jnp.lexsort((rank, state.group))
    g = state.group[by_group]
    first = lax.cummax(jnp.where((pos == 0) | (g != jnp.roll(g, 1)), pos, 0))
    best = jnp.zeros((n,), jnp.int32).at[by_group].set(rank[by_group][first])
    gkey = jnp.where(members, best, n)
    return jnp.lexsort((rank, gkey)).astype(jnp.int32)


def _group_bounds(order: jax.Array, group: jax.Array, n_members: jax.Array) -> tuple:
    """(start, end) int32[N]: the positions [start, end) of each position's group in a
    group-contiguous ``order`` whose first n_members positions are members."""
    n = order.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    g = group[order]
    boundary = (pos == 0) | (g != jnp.roll(g, 1)) | (pos >= n_members)
    start = lax.cummax(jnp.where(boundary, pos, 0))
    nxt = jnp.concatenate([jnp.where(boundary, pos, n)[1:], jnp.full((1,), n, jnp.int32)])
    end = lax.cummin(nxt, reverse=True)
    return start, end


def _preempt_group(policy, config, mem, gm, alone):
    """Preempt the running members ``gm`` (bool[N]) of one group: swap them out if the
    mode asks for it and the host pool takes them all, else release (recompute). A group
    that cannot fit even alone (``alone``) is released. Returns (mem', swapped bool[])."""
    n = gm.shape[0]
    released = policy.release(mem, jnp.arange(n, dtype=jnp.int32), gm)
    if not getattr(policy, "can_swap", False) or config.preemption_mode == "recompute":
        return released, jnp.asarray(False)
    if config.preemption_mode == "swap":
        want = ~alone
    else:  # the paper's default: swap groups with several running sequences
        want = ~alone & (jnp.sum(gm, dtype=jnp.int32) > 1)
    swapped_mem, ok = policy.swap_out(mem, gm)
    use = want & ok
    return _tree_where(use, swapped_mem, released), use


def _grow_masked(policy, mem, args: tuple, mask: jax.Array, wm: jax.Array) -> tuple:
    """``policy.grow(mem, *args, mask, wm)``; an empty mask skips the call (a policy's
    batched call costs O(B) even when nothing is masked) and changes nothing, as the
    policy contract says of unmasked entries. Returns (mem', ok bool[N])."""
    n = mask.shape[0]
    return lax.cond(
        jnp.any(mask),
        lambda: policy.grow(mem, *args, mask, wm),
        lambda: (mem, jnp.ones((n,), bool)),
    )


# Stages of the running pass's loop (``_run_running``).
_R_ALL, _R_PREFIX, _R_GROUP, _R_DONE = 0, 1, 2, 3


class _RunCarry(NamedTuple):
    mem: Any
    stage: jax.Array  # int32[]: one of _R_*
    grow: jax.Array  # bool[N] by position: the next iteration's grow mask
    i: jax.Array  # int32[]: first position of the group to grow (stages PREFIX, GROUP)
    j: jax.Array  # int32[]: positions [j, n_run) were preempted (stage GROUP)
    pre: jax.Array  # bool[N] by slot: preempted (recompute or swap)
    swp: jax.Array  # bool[N] by slot: of those, swapped out
    cap: jax.Array  # bool[N] by slot: finished for capacity
    rel: jax.Array  # bool[N] by slot: holds released


def _run_running(policy, config, state, mem, order, want, new_lens, finals, caps, n_run, holds):
    """Grow the running sequences (positions in a group-contiguous ``order``); preempt
    whole groups from the back.

    holds: bool[N] by slot, WAITING slots holding memory (attached prefix-cache hits).
    At the first failed grow they are all released and the grow is retried, before any
    running group is preempted or finished for capacity: a waiting request never keeps
    memory from a running one (vLLM holds no blocks for waiting requests).

    One ``lax.while_loop`` whose body calls ``policy.grow`` once, so the policy is traced
    once here (XLA inlines every call site: each traced copy is compiled on its own).
    Its stages: ALL grows every wanted position at once, kept when all succeed (the
    common case: one iteration). Otherwise PREFIX grows the groups before the failing
    one's (exactly as the batched call did), the holds are released, and GROUP retries
    the groups one at a time from there: a group grows whole (one batched call over its
    members, all or nothing) or the lowest-priority group not yet visited is preempted.

    Returns (mem', preempted, swapped, capacity, released), each bool[N] by slot:
    preempted (by recompute or swap), of those the swapped ones, groups finished for
    capacity, and the holds released.
    """
    n = order.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    no_wm = jnp.zeros((n,), bool)
    start, end = _group_bounds(order, state.group, n_run)
    running = state.status == RUNNING
    args = (order, new_lens, finals, caps)

    def members(i: jax.Array) -> jax.Array:  # the wanted positions of i's group
        return want & (pos >= i) & (pos < end[jnp.minimum(i, n - 1)])

    def body(c: _RunCarry) -> _RunCarry:
        m_g, ok = _grow_masked(policy, c.mem, args, c.grow, no_wm)
        good = jnp.all(ok | ~c.grow)

        def batched() -> _RunCarry:
            # The batched call is exact up to its first failure: the groups before the
            # failing one's grow again alone (later entries may have taken memory).
            f = _first_false(ok, want)
            g0 = start[jnp.minimum(f, n - 1)]
            return c._replace(
                mem=_tree_where(good, m_g, c.mem),
                stage=jnp.where(good, _R_DONE, _R_PREFIX).astype(jnp.int32),
                grow=want & (pos < g0),
                i=g0,
            )

        def prefix() -> _RunCarry:
            # Group g0 fails: the waiting holds go first, then g0 is retried, group by group.
            return c._replace(
                mem=policy.release(m_g, pos, holds),
                stage=jnp.int32(_R_GROUP),
                grow=members(c.i),
                rel=holds,
            )

        def group() -> _RunCarry:
            i, j = c.i, c.j
            e = end[i]
            other = j > e  # a lower-priority group remains
            vs = jnp.where(other, start[jnp.maximum(j - 1, 0)], i)  # the victim's first position
            gm = running & (state.group == state.group[order[vs]])
            alone = ~other & (i == 0)

            def victim():
                return _preempt_group(policy, config, c.mem, gm, alone)

            m_pre, swapped = lax.cond(good, lambda: (c.mem, jnp.asarray(False)), victim)
            hit = ~good & gm
            i2, j2 = jnp.where(good, e, i), jnp.where(good, j, vs)
            return c._replace(
                mem=_tree_where(good, m_g, m_pre),
                stage=jnp.where(i2 < j2, _R_GROUP, _R_DONE).astype(jnp.int32),
                grow=members(i2),
                i=i2,
                j=j2,
                pre=c.pre | (hit & ~alone),
                swp=c.swp | (hit & swapped),
                cap=c.cap | (hit & alone),
            )

        return lax.switch(c.stage, (batched, prefix, group))

    z = jnp.zeros((n,), bool)
    init = _RunCarry(mem, jnp.int32(_R_ALL), want, jnp.int32(0), n_run, z, z, z, z)
    c = lax.while_loop(lambda c: c.stage != _R_DONE, body, init)
    return c.mem, c.pre, c.swp, c.cap, c.rel


# Stages of the admission loop (``_admit``).
_A_ALL, _A_PREFIX, _A_RETRY, _A_DONE = 0, 1, 2, 3


class _AdmitCarry(NamedTuple):
    mem: Any
    stage: jax.Array  # int32[]: one of _A_*
    grow: jax.Array  # bool[N] by position: the next iteration's grow mask
    adm: jax.Array  # bool[N] by position: admitted
    f: jax.Array  # int32[]: the refused position, or N
    dropped: jax.Array  # bool[N] by position: holds released


def _admit(policy, mem, grow_w, cand, drop) -> tuple:
    """Admit the candidates (bool[N] by position) in order up to the first the policy
    refuses (with the watermark). On a refusal, the holds behind the refused position
    (``drop``: bool[N] by position, the slots that may give theirs) are released and it
    is retried, alone.

    One ``lax.while_loop`` whose body calls ``policy.grow`` once (traced once). ALL grows
    every candidate at once, kept when all are admitted; at a refusal PREFIX grows the
    admitted prefix again (so the result equals growing one at a time, for any policy),
    then releases the holds behind it, and RETRY grows the refused one.
    Returns (mem', admitted bool[N] by position, the refused position or N, released
    bool[N] by position)."""
    n = cand.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)

    def body(c: _AdmitCarry) -> _AdmitCarry:
        m_g, ok = _grow_masked(policy, c.mem, grow_w, c.grow, c.grow)

        def batched() -> _AdmitCarry:
            f = _first_false(ok, cand)
            good = f >= n
            adm = cand & (pos < f)
            return c._replace(
                mem=_tree_where(good, m_g, c.mem),
                stage=jnp.where(good, _A_DONE, _A_PREFIX).astype(jnp.int32),
                grow=adm,
                adm=adm,
                f=f,
            )

        def prefix() -> _AdmitCarry:
            d = drop & (pos > c.f)
            any_d = jnp.any(d)
            slots = jnp.zeros((n,), bool).at[grow_w[0]].set(d)
            m = lax.cond(any_d, lambda: policy.release(m_g, pos, slots), lambda: m_g)
            return c._replace(
                mem=m,
                stage=jnp.where(any_d, _A_RETRY, _A_DONE).astype(jnp.int32),
                grow=pos == c.f,
                dropped=d,
            )

        def retry() -> _AdmitCarry:
            ok_f = ok[c.f]
            return c._replace(
                mem=m_g,
                stage=jnp.int32(_A_DONE),
                adm=c.adm | ((pos == c.f) & ok_f),
                f=jnp.where(ok_f, n, c.f),
            )

        return lax.switch(c.stage, (batched, prefix, retry))

    z = jnp.zeros((n,), bool)
    init = _AdmitCarry(mem, jnp.int32(_A_ALL), cand, z, jnp.int32(n), z)
    c = lax.while_loop(lambda c: c.stage != _A_DONE, body, init)
    return c.mem, c.adm, c.f, c.dropped


def _swap_in(policy, config, state, mem, seq_cap, n_running):
    """Swapped groups in priority order come back while they fit (device blocks with the
    watermark plus one block per sequence, and max_num_seqs); the first that does not
    fit stops the pass. When nothing runs the spare blocks are not asked for: a group
    that needs nearly the whole pool would otherwise never come back (and, with
    admissions closed while it is out, the engine would idle forever); if it then cannot
    grow alone, the running pass finishes it for capacity.
    Returns (mem', swapped_in bool[N], sequences swapped in)."""
    n = state.max_seqs
    swapped = state.status == SWAPPED
    n_sw = jnp.sum(swapped, dtype=jnp.int32)
    order = group_order(state, config, swapped)
    _, end = _group_bounds(order, state.group, n_sw)

    def body(c):
        m, i, _, sin, nr = c
        gm = swapped & (state.group == state.group[order[i]])
        k = jnp.sum(gm, dtype=jnp.int32)
        fits = nr + k <= seq_cap
        m2, ok = policy.swap_in(m, gm & fits, k, nr > 0)
        ok = ok & fits
        m = _tree_where(ok, m2, m)
        return m, jnp.where(ok, end[i], i), ok, sin | (gm & ok), nr + jnp.where(ok, k, 0)

    z = jnp.zeros((n,), bool)
    init = (mem, jnp.int32(0), jnp.asarray(True), z, n_running)
    m, _, _, sin, nr = lax.while_loop(lambda c: c[2] & (c[1] < n_sw), body, init)
    return m, sin, nr - n_running


def _swap_maps(mem: Any) -> tuple:
    """The policy state's pending swap maps, or empty ones (K = 1) without block ids."""
    out, inn = getattr(mem, "swap_out", None), getattr(mem, "swap_in", None)
    if out is None:
        z, c = jnp.zeros((1,), jnp.int32), jnp.zeros((), jnp.int32)
        return z, z, c, z, z, c
    return out.src, out.dst, out.count, inn.src, inn.dst, inn.count


def schedule(
    policy: Any,
    config: SchedulerLimits,
    state: SchedulerState,
    lookahead: jax.Array | None = None,
) -> tuple[SchedulerState, ScheduledBatch]:
    """Decide one step (jittable with policy and config static). See the module docstring.

    Memory for every scheduled token is allocated here (grow to num_computed + q_len), so
    the step's KV writes have blocks. Returns the new state and the batch.

    lookahead: int32[max_seqs] by slot, speculative slots wanted (vLLM's lookahead
    slots): a RUNNING sequence with exactly one token to compute (a decode) asks for
    1 + lookahead tokens instead, budgeted and grown like any other (rule 2: it may
    preempt); the budget may give it fewer (``batch.spec_lens`` says how many drafts it
    got). The caller keeps num_computed + 1 + lookahead within the sequence's length cap.
    None: no speculation (all zeros).
    """
    n = config.max_seqs
    if state.max_seqs != n or policy.max_seqs != n:
        raise ValueError(
            f"config.max_seqs ({n}), state rows ({state.max_seqs}) and policy.max_seqs"
            f" ({policy.max_seqs}) must agree"
        )
    # Per-step bookkeeping of the memory policy (the paged policy's pending KV copies).
    if hasattr(policy, "begin_step"):
        state = state._replace(mem=policy.begin_step(state.mem))
    pos = jnp.arange(n, dtype=jnp.int32)
    total = state.prompt_len + state.output_len  # tokens the sequence has (KV + last)
    caps_all = max_lens(state, config.max_model_len)
    budget = jnp.int32(config.max_num_batched_tokens)

    # 1. Requests that can never be scheduled.
    waiting = state.status == WAITING
    length = state.prompt_len if config.chunked_prefill else total
    too_long = waiting & (length > config.prompt_limit)
    waiting = waiting & ~too_long
    # A WAITING slot with computed tokens holds memory: its attached prefix-cache hit.
    holding = (state.status == WAITING) & (state.num_computed > 0)
    mem = lax.cond(
        jnp.any(too_long & holding),
        lambda: policy.release(state.mem, pos, too_long & holding),
        lambda: state.mem,
    )
    holds = holding & ~too_long

    # 2. Running sequences, group by group.
    running = state.status == RUNNING
    n_run = jnp.sum(running, dtype=jnp.int32)
    order_r = group_order(state, config, running)
    base_r = (total - state.num_computed)[order_r]
    if lookahead is not None:  # a decode row verifies its drafts in the same step
        base_r = base_r + jnp.where(base_r == 1, jnp.asarray(lookahead, jnp.int32)[order_r], 0)
    rem_r = jnp.where(pos < n_run, base_r, 0)
    q_r = _budget_prefix(rem_r, budget)
    want_r = q_r > 0
    mem, preempted, swapped_out, cap_run, released = _run_running(
        policy,
        config,
        state,
        mem,
        order_r,
        want_r,
        state.num_computed[order_r] + q_r,
        state.final_len[order_r],
        caps_all[order_r],
        n_run,
        holds,
    )
    sched_r = want_r & ~(preempted | cap_run)[order_r]
    n_run_after = n_run - jnp.sum(preempted | cap_run, dtype=jnp.int32)
    seq_cap = config.max_num_seqs
    if config.mode == "static":
        seq_cap = min(config.static_batch_size, config.max_num_seqs)

    # 3. Swapped groups come back before anything new is admitted (not in a step that
    # preempted); they run from the next step.
    swapped_in = jnp.zeros((n,), bool)
    if getattr(policy, "can_swap", False):
        any_out = jnp.any(state.status == SWAPPED)
        mem, swapped_in, n_in = lax.cond(
            ~jnp.any(preempted) & any_out,
            lambda: _swap_in(policy, config, state, mem, seq_cap, n_run_after),
            lambda: (mem, swapped_in, jnp.int32(0)),
        )
        n_run_after = n_run_after + n_in
    still_out = ((state.status == SWAPPED) & ~swapped_in) | swapped_out

    # 4. Admissions: none in a step that preempted, none while a group is swapped out.
    allow = ~jnp.any(preempted) & ~jnp.any(still_out)
    if config.mode == "static":
        allow = allow & (n_run_after == 0)
    n_wait = jnp.sum(waiting, dtype=jnp.int32)
    order_w = priority_order(state, config, waiting)
    need_w = jnp.where(pos < n_wait, (total - state.num_computed)[order_w], 0)
    budget_left = budget - jnp.sum(jnp.where(sched_r, q_r, 0))
    if config.chunked_prefill:
        q_w = _budget_prefix(need_w, budget_left)
    else:
        q_w = jnp.where(jnp.cumsum(need_w) <= budget_left, need_w, 0)
    # A slot whose hold was released this step waits for the engine's new lookup; strict
    # order keeps everything behind it waiting too.
    stop = _first_false(~released[order_w], pos < n_wait)
    cand = allow & (q_w > 0) & (pos < seq_cap - n_run_after) & (pos < stop)
    grow_w = (
        order_w,
        state.num_computed[order_w] + q_w,
        state.final_len[order_w],
        caps_all[order_w],
    )
    # Refused while later waiting slots hold memory: release those holds (vLLM's waiting
    # requests hold nothing) and retry the refused one; admission then ends for the step
    # (the released slots are behind it and wait for their new lookup anyway).
    drop = holds[order_w] & ~released[order_w]
    mem, adm, f, drop_w = _admit(policy, mem, grow_w, cand, drop)
    released = released | jnp.zeros((n,), bool).at[order_w].set(drop_w)
    # Refused with nothing else holding memory: it can never fit.
    cap_w_pos = (pos == 0) & (f == 0) & (n_run_after == 0)
    cap_wait = jnp.zeros((n,), bool).at[order_w].set(cap_w_pos)
    admitted = jnp.zeros((n,), bool).at[order_w].set(adm)
    mem = lax.cond(
        jnp.any(cap_wait & holds),
        lambda: policy.release(mem, pos, cap_wait & holds),
        lambda: mem,
    )

    # Batch: running rows then admitted rows, compacted.
    ids2 = jnp.concatenate([order_r, order_w])
    q2 = jnp.concatenate([jnp.where(sched_r, q_r, 0), jnp.where(adm, q_w, 0)])
    m2 = jnp.concatenate([sched_r, adm])
    dest = jnp.where(m2, jnp.cumsum(m2) - 1, n)
    seq_ids = jnp.full((n,), -1, jnp.int32).at[dest].set(ids2, mode="drop")
    q_lens = jnp.zeros((n,), jnp.int32).at[dest].set(q2, mode="drop")
    row = seq_ids >= 0
    safe = jnp.maximum(seq_ids, 0)
    start = jnp.where(row, state.num_computed[safe], 0)
    emits = row & (start + q_lens >= total[safe])  # > : drafts past the last token
    spec_lens = jnp.where(row, jnp.maximum(start + q_lens - total[safe], 0), 0)

    rejected = too_long | cap_run | cap_wait
    recomputed = preempted & ~swapped_out
    status = jnp.where(admitted | swapped_in, RUNNING, state.status)
    status = jnp.where(recomputed, WAITING, status)
    status = jnp.where(swapped_out, SWAPPED, status)
    status = jnp.where(rejected, FINISHED, status)
    reason = jnp.where(too_long, REASON_TOO_LONG, state.finish_reason)
    reason = jnp.where(cap_run | cap_wait, REASON_CAPACITY, reason)
    new_state = state._replace(
        status=status.astype(jnp.int32),
        finish_reason=reason.astype(jnp.int32),
        num_computed=jnp.where(recomputed | rejected | released, 0, state.num_computed),
        num_preemptions=state.num_preemptions + preempted.astype(jnp.int32),
        mem=mem,
    )
    batch = ScheduledBatch(
        seq_ids=seq_ids,
        q_lens=q_lens,
        start_pos=start.astype(jnp.int32),
        emits=emits,
        num_seqs=jnp.sum(row, dtype=jnp.int32),
        num_tokens=jnp.sum(q_lens, dtype=jnp.int32),
        preempted=preempted,
        rejected=rejected,
        swap=SwapPlan(*_swap_maps(mem), swapped_out, swapped_in),
        released=released,
        spec_lens=spec_lens.astype(jnp.int32),
    )
    return new_state, batch
