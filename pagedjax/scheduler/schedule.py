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
5. Separate prompt steps (paper mode with ``config.prompt_steps == "separate"``, vLLM
   v0.1.3-v0.3): when nothing is swapped out and a request waits, admission (rule 4,
   with the whole budget and the running sequences counted against max_num_seqs) is
   tried first and the running pass skipped; if it admits anyone the step is
   prompt-only (the running sequences wait). Otherwise the step is decode-only: rules
   2 and 3, no admission.

The common case (no preemption, no refusal, nothing swapped) costs two batched grows
(running, admission). Rule 2 is batched too: the wanted running positions not yet
settled grow at once; at a failure the groups before the failing one grow again alone
(the batched call is exact up to its first failure, later entries may have taken
memory), the holds go or a victim is preempted, and the rest is tried again at once. A
preemption costs two batched grows, not a grow per sequence of every group after it.

One loop: every ``policy.grow`` and ``policy.release`` of a step is the same call site,
in the body of one ``lax.while_loop`` whose stages (``_START`` .. ``_DONE``) walk the
rules above: each iteration runs (at ``_MID``) swap-in and the admission set-up, then
one grow over the stage's mask (skipped when empty), the stage's transition (the
victim's swap-out, if any), then one release of what the transition gave up. XLA
inlines every call site of a traced function and compiles each copy on its own: with
the running pass, its preemption retries and admission each calling ``grow`` (six
sites, ~700 StableHLO lines each for the paged policy) and ``release`` at five sites,
``schedule`` took 5,000 lines and 5-6 CPU s to compile on the tests' geometry; see
docs/scheduler.md ("Each policy method traced once") for what one site per method saves.
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


def _victim(policy, config, mem, gm, alone, fail):
    """The preemption of a failed group grow (``fail``): the running members ``gm``
    (bool[N]) of the victim group are swapped out if the mode asks for it and the host
    pool takes them all, else they are to be released (recompute); a group that cannot
    fit even alone (``alone``) is released. Returns (mem', swapped bool[], to_release
    bool[N] by slot): the release is the loop's (``schedule``), at the iteration's end."""
    if not getattr(policy, "can_swap", False) or config.preemption_mode == "recompute":
        return mem, jnp.asarray(False), fail & gm
    if config.preemption_mode == "swap":
        want = ~alone
    else:  # the paper's default: swap groups with several running sequences
        want = ~alone & (jnp.sum(gm, dtype=jnp.int32) > 1)
    try_swap = fail & want
    swapped_mem, ok = lax.cond(
        try_swap, lambda: policy.swap_out(mem, gm), lambda: (mem, jnp.asarray(False))
    )
    use = try_swap & ok
    return _tree_where(use, swapped_mem, mem), use, fail & ~use & gm


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


# The stages of ``schedule``'s loop, in the order a step goes through them (module
# docstring, "One loop"). _MID is the swap-in and the admission set-up, at the start of
# the iteration whose grow is admission's first.
(
    _START,
    _RUN_ALL,
    _RUN_PREFIX,
    _MID,
    _ADMIT_ALL,
    _ADMIT_PREFIX,
    _ADMIT_RETRY,
    _DONE,
) = range(8)
_NUM_STAGES = 8


class _Carry(NamedTuple):
    """``schedule``'s loop state. By slot: bool[N] indexed by slot id; by position: in
    the order of the phase's grow arguments (running: ``order_r``, admission: ``order_w``)."""

    mem: Any
    stage: jax.Array  # int32[]: one of the stages above
    release: jax.Array  # bool[N] by slot: released at the end of this iteration
    grow: jax.Array  # bool[N] by position: the next iteration's grow mask
    wm: jax.Array  # bool[N] by position: its use_watermark
    args: tuple  # (seq_ids, new_lens, final_lens, max_lens), int32[N] each: its arguments
    i: jax.Array  # int32[]: running pass, positions [i, j) are still to grow
    j: jax.Array  # int32[]: running pass, positions [j, n_run) are preempted
    freed: jax.Array  # bool[]: running pass, the waiting holds were released
    pre: jax.Array  # bool[N] by slot: preempted (recompute or swap)
    swp: jax.Array  # bool[N] by slot: of those, swapped out
    cap: jax.Array  # bool[N] by slot: running groups finished for capacity
    rel: jax.Array  # bool[N] by slot: holds released by the running pass
    swapped_in: jax.Array  # bool[N] by slot
    n_run_after: jax.Array  # int32[]: running after the running pass and swap-in
    q_w: jax.Array  # int32[N] by position: admission's tokens per candidate
    cand: jax.Array  # bool[N] by position: admission candidates
    adm: jax.Array  # bool[N] by position: admitted
    f: jax.Array  # int32[]: the refused admission position, or N
    dropped: jax.Array  # bool[N] by position: holds released by admission
    # Set by a stage transition for the loop body (which holds every policy call):
    keep: jax.Array  # bool[]: the iteration's grow result is the new memory state
    victim: jax.Array  # bool[N] by slot: the running group to preempt (all False: none)
    alone: jax.Array  # bool[]: that group is the only one left (capacity verdict)
    prompt: jax.Array  # bool[]: separate prompt steps: this step tries / runs prompts only


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
    grow_r = (
        order_r,
        state.num_computed[order_r] + q_r,
        state.final_len[order_r],
        caps_all[order_r],
    )
    start_r, end_r = _group_bounds(order_r, state.group, n_run)
    seq_cap = config.max_num_seqs
    if config.mode == "static":
        seq_cap = min(config.static_batch_size, config.max_num_seqs)
    n_wait = jnp.sum(waiting, dtype=jnp.int32)
    order_w = priority_order(state, config, waiting)
    need_w = jnp.where(pos < n_wait, (total - state.num_computed)[order_w], 0)
    z = jnp.zeros((n,), bool)

    def slots_of(by_pos: jax.Array) -> jax.Array:  # admission positions -> bool[N] by slot
        return jnp.zeros((n,), bool).at[order_w].set(by_pos)

    def capacity_w(c: _Carry) -> jax.Array:
        """Admission refused the head with nothing running: it can never fit (by slot)."""
        return slots_of((pos == 0) & (c.f == 0) & (c.n_run_after == 0))

    # Stage transitions. Each gets the carry without its memory state (``mem`` None: what
    # a ``lax.switch`` returns is copied at run time, every iteration) and ``ok``, the
    # result of the iteration's grow (of c.grow over c.args; all True when c.grow was
    # empty), and returns the next carry: whether the grow's state is kept (``keep``),
    # what to release, which group to preempt (``victim``). None calls a policy method:
    # the loop body does, each method at one call site.
    def run_all(c: _Carry, ok: jax.Array) -> _Carry:
        # The wanted running positions [i, j) at once (at first all of them): kept when
        # all fit (the common case). Otherwise the call is exact up to its first failure:
        # the groups before the failing one's (from g) grow again alone, since later
        # entries may have taken memory, and group g failed.
        f = _first_false(ok, c.grow)
        good = f >= n
        g = start_r[jnp.minimum(f, n - 1)]
        return c._replace(
            keep=good,
            stage=jnp.where(good, _MID, _RUN_PREFIX).astype(jnp.int32),
            grow=jnp.where(good, z, c.grow & (pos < g)),
            i=jnp.where(good, c.i, g),
        )

    def run_prefix(c: _Carry, ok: jax.Array) -> _Carry:
        # The grow: the groups before group i grew (exactly as in the batched call, or none);
        # group i does not fit. At the step's first failure every waiting hold goes
        # (released at the iteration's end); later, the lowest-priority group not yet
        # visited (positions [vs, j)) is preempted; if that is group i itself, the pass
        # ends, and if group i is alone (everything else preempted, every hold released)
        # it can never fit: finished for capacity. Then [i, j) is tried again at once.
        del ok  # a prefix of the batched call: it fits
        i, j = c.i, c.j
        fail = c.freed
        e = end_r[i]
        other = j > e  # a lower-priority group remains
        vs = jnp.where(other, start_r[jnp.maximum(j - 1, 0)], i)  # the victim's first position
        gm = running & (state.group == state.group[order_r[vs]])
        alone = ~other & (i == 0)
        hit = fail & gm
        j2 = jnp.where(fail, vs, j)
        more = i < j2
        first = holds & ~fail
        return c._replace(
            keep=True,
            victim=hit,
            alone=alone,
            stage=jnp.where(more, _RUN_ALL, _MID).astype(jnp.int32),
            release=first,
            grow=want_r & (pos >= i) & (pos < j2),
            j=j2,
            freed=jnp.asarray(True),
            pre=c.pre | (hit & ~alone),
            cap=c.cap | (hit & alone),
            rel=c.rel | first,
        )

    def admit_all(c: _Carry, ok: jax.Array) -> _Carry:
        # Every candidate at once (with the watermark): kept when all are admitted. At
        # the first refusal f the admitted prefix grows again alone.
        f = _first_false(ok, c.cand)
        good = f >= n
        adm = c.cand & (pos < f)
        return c._replace(
            keep=good,
            stage=jnp.where(good, _DONE, _ADMIT_PREFIX).astype(jnp.int32),
            grow=jnp.where(good, z, adm),
            wm=adm,
            adm=adm,
            f=f,
        )

    def admit_prefix(c: _Carry, ok: jax.Array) -> _Carry:
        # Refused while later waiting slots hold memory: those holds are released (vLLM's
        # waiting requests hold nothing) and the refused one is retried alone; admission
        # then ends for the step (the released slots are behind it and wait for their
        # new lookup anyway).
        del ok  # the admitted prefix: it fits
        drop = holds[order_w] & ~c.rel[order_w] & (pos > c.f)
        retry = jnp.any(drop)
        one = (pos == c.f) & retry
        return c._replace(
            keep=True,
            stage=jnp.where(retry, _ADMIT_RETRY, _DONE).astype(jnp.int32),
            release=slots_of(drop),
            grow=one,
            wm=one,
            dropped=drop,
        )

    def admit_retry(c: _Carry, ok: jax.Array) -> _Carry:
        ok_f = ok[c.f]
        return c._replace(
            keep=True,
            stage=jnp.int32(_DONE),
            grow=z,
            adm=c.adm | ((pos == c.f) & ok_f),
            f=jnp.where(ok_f, n, c.f),
        )

    def idle(c: _Carry, ok: jax.Array) -> _Carry:
        del ok
        return c

    def mid(c: _Carry, swapped_in: jax.Array, n_run_after: jax.Array) -> _Carry:
        """Between the running pass and admission, after swap-in (the loop body's): the
        admission candidates, whose grow is the same iteration's."""
        sched_r = want_r & ~(c.pre | c.cap)[order_r]
        still_out = ((state.status == SWAPPED) & ~swapped_in) | c.swp
        # 4. Admissions: none in a step that preempted, none while a group is swapped out.
        allow = ~jnp.any(c.pre) & ~jnp.any(still_out)
        if config.mode == "static":
            allow = allow & (n_run_after == 0)
        budget_left = budget - jnp.sum(jnp.where(sched_r, q_r, 0))
        if config.separate_prompt_steps:  # rule 5: prompts only, with the whole budget
            allow = allow & c.prompt
            budget_left = jnp.where(c.prompt, budget, budget_left)
        if config.chunked_prefill:
            q_w = _budget_prefix(need_w, budget_left)
        else:
            q_w = jnp.where(jnp.cumsum(need_w) <= budget_left, need_w, 0)
        # A slot whose hold was released this step waits for the engine's new lookup;
        # strict order keeps everything behind it waiting too.
        stop = _first_false(~c.rel[order_w], pos < n_wait)
        cand = allow & (q_w > 0) & (pos < seq_cap - n_run_after) & (pos < stop)
        grow_w = (
            order_w,
            state.num_computed[order_w] + q_w,
            state.final_len[order_w],
            caps_all[order_w],
        )
        return c._replace(
            stage=jnp.where(jnp.any(cand), _ADMIT_ALL, _DONE).astype(jnp.int32),
            grow=cand,
            wm=cand,
            args=grow_w,
            swapped_in=swapped_in,
            n_run_after=n_run_after,
            q_w=q_w,
            cand=cand,
        )

    # Rejected slots' holds go before anything grows: a first, idle iteration releases
    # them (only in a step that has some).
    first_release = jnp.any(too_long & holding)

    def begin(c: _Carry, ok: jax.Array) -> _Carry:
        del ok
        # Rule 5: a prompt step goes straight to admission.
        return c._replace(
            stage=jnp.where(c.prompt, _MID, _RUN_ALL).astype(jnp.int32),
            release=too_long & holding,
            grow=jnp.where(c.prompt, z, want_r),
        )

    branches = [idle] * _NUM_STAGES
    branches[_START] = begin
    branches[_RUN_ALL], branches[_RUN_PREFIX] = run_all, run_prefix
    branches[_ADMIT_ALL], branches[_ADMIT_PREFIX] = admit_all, admit_prefix
    branches[_ADMIT_RETRY] = admit_retry

    any_out = jnp.any(state.status == SWAPPED)

    def body(c: _Carry) -> _Carry:
        mem = c.mem
        f0 = jnp.asarray(False)
        ctl = c._replace(mem=None, keep=f0, victim=z, alone=f0)
        at_mid = c.stage == _MID
        n_run_after = n_run - jnp.sum(c.pre | c.cap, dtype=jnp.int32)
        swapped_in = z
        # 3. Swapped groups come back before anything new is admitted (not in a step
        # that preempted); they run from the next step.
        if getattr(policy, "can_swap", False):
            mem, swapped_in, n_in = lax.cond(
                at_mid & ~jnp.any(c.pre) & any_out,
                lambda: _swap_in(policy, config, state, c.mem, seq_cap, n_run_after),
                lambda: (c.mem, z, jnp.int32(0)),
            )
            n_run_after = n_run_after + n_in
        ctl = lax.cond(at_mid, lambda s: mid(s, swapped_in, n_run_after), lambda s: s, ctl)
        m_g, ok = _grow_masked(policy, mem, ctl.args, ctl.grow, ctl.wm)
        nxt = lax.switch(ctl.stage, branches, ctl, ok)
        if config.separate_prompt_steps:
            # Rule 5: the prompt step admitted nobody, so it is a decode step: the
            # running pass from its start (the refusal is no capacity verdict: n_run > 0).
            back = nxt.prompt & (nxt.stage == _DONE) & ~jnp.any(nxt.adm) & (n_run > 0)
            nxt = nxt._replace(
                stage=jnp.where(back, _RUN_ALL, nxt.stage).astype(jnp.int32),
                grow=jnp.where(back, want_r, nxt.grow),
                wm=jnp.where(back, z, nxt.wm),
                args=_tree_where(back, grow_r, nxt.args),
                prompt=nxt.prompt & ~back,
                f=jnp.where(back, n, nxt.f).astype(jnp.int32),
            )
        mem = _tree_where(nxt.keep, m_g, mem)
        fail = jnp.any(nxt.victim)
        mem, swapped, to_release = _victim(policy, config, mem, nxt.victim, nxt.alone, fail)
        # Admission just ended: a refused head with nothing running can never fit; its
        # hold goes (rule 4).
        ended = (nxt.stage == _DONE) & (ctl.stage != _DONE)
        release = nxt.release | to_release | (ended & capacity_w(nxt) & holds)
        new = lax.cond(jnp.any(release), lambda: policy.release(mem, pos, release), lambda: mem)
        return nxt._replace(mem=new, release=z, swp=nxt.swp | (nxt.victim & swapped))

    i0 = jnp.int32(0)
    # Rule 5: try a prompt-only step first when nothing is swapped out and someone waits.
    prompt0 = jnp.asarray(False)
    if config.separate_prompt_steps:
        prompt0 = ~any_out & (n_wait > 0)
    stage0 = jnp.where(prompt0, _MID, _RUN_ALL)
    init = _Carry(
        mem=state.mem,
        stage=jnp.where(first_release, _START, stage0).astype(jnp.int32),
        release=z,
        grow=jnp.where(first_release | prompt0, z, want_r),
        wm=z,
        args=grow_r,
        i=i0,
        j=n_run,
        pre=z,
        swp=z,
        cap=z,
        rel=z,
        swapped_in=z,
        n_run_after=i0,
        q_w=jnp.zeros((n,), jnp.int32),
        cand=z,
        adm=z,
        f=jnp.int32(n),
        dropped=z,
        freed=jnp.asarray(False),
        keep=jnp.asarray(False),
        victim=z,
        alone=jnp.asarray(False),
        prompt=prompt0,
    )
    c = lax.while_loop(lambda c: c.stage != _DONE, body, init)
    mem, preempted, swapped_out, cap_run, swapped_in = c.mem, c.pre, c.swp, c.cap, c.swapped_in
    sched_r = want_r & ~(preempted | cap_run)[order_r]
    if config.separate_prompt_steps:  # a prompt-only step: the running sequences wait
        sched_r = sched_r & ~c.prompt
    adm, q_w = c.adm, c.q_w
    released = c.rel | slots_of(c.dropped)
    cap_wait = capacity_w(c)
    admitted = slots_of(adm)

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
