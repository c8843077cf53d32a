"""One scheduling decision: who runs this step, how many tokens each, who is preempted.

Rules (docs/scheduler.md gives the reasons; ``reference.py`` states them sequentially):

1. Reject WAITING requests that can never run: prompt over ``config.prompt_limit``
   (paper/static modes: prompt + generated output, which a recompute must prefill whole).
2. RUNNING sequences in priority order each take ``min(remaining, budget left)`` tokens
   (a decode is 1). Each scheduled one grows its memory to ``num_computed + q``. When a
   grow fails, the lowest-priority running sequence not yet visited is preempted by
   recompute (memory released, back to WAITING, num_computed = 0) and the grow retried;
   if that victim would be the sequence itself, it is preempted and the pass ends. A
   sequence that fails alone (everything else preempted) can never fit: it finishes
   with REASON_CAPACITY instead.
3. If nobody was preempted (and, in static mode, nothing runs), WAITING sequences in
   priority order are admitted strictly in order while the number of running sequences
   stays within max_num_seqs (static: static_batch_size) and the budget allows: default
   mode chunks the last prompt to the budget left, paper/static modes need it whole.
   Admission grows with the policy's watermark; the first refusal stops admission, and
   if nothing runs the refused request can never fit (REASON_CAPACITY).

The common case (no preemption, no refusal) costs a few batched policy calls; the
sequential preemption loop only runs from the first failed grow.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pagedjax.scheduler.config import SchedulerConfig
from pagedjax.scheduler.priority import priority_order
from pagedjax.scheduler.state import (
    FINISHED,
    REASON_CAPACITY,
    REASON_TOO_LONG,
    RUNNING,
    WAITING,
    SchedulerState,
    max_lens,
)


class ScheduledBatch(NamedTuple):
    """One step's batch. Row arrays are ``[max_seqs]`` in batch order: scheduled running
    sequences (priority order), then new admissions (priority order), then padding.

    seq_ids: int32 slot ids; -1 in padding rows.
    q_lens: int32 tokens computed this step (a decode is 1); 0 in padding rows.
    start_pos: int32 num_computed before the step: the row's first query position.
    emits: bool, the row's last token completes prompt + generated output, so its logits
        are sampled (False for a non-final prefill chunk and for padding).
    num_seqs: int32[] scheduled rows. num_tokens: int32[] sum of q_lens (padding bucket).
    preempted: bool[max_seqs] by slot: preempted this step.
    rejected: bool[max_seqs] by slot: finished this step without running (too long, or
        cannot fit the pool); see state.finish_reason.
    """

    seq_ids: jax.Array
    q_lens: jax.Array
    start_pos: jax.Array
    emits: jax.Array
    num_seqs: jax.Array
    num_tokens: jax.Array
    preempted: jax.Array
    rejected: jax.Array


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


def _run_running(policy, mem, order, want, new_lens, finals, caps, n_run):
    """Grow the running sequences (positions in ``order``); preempt from the back.

    Returns (mem', preempted_pos bool[N], capacity_pos bool[N], end) where positions in
    [end, n_run) were preempted (unless marked capacity) and earlier wanted ones grew.
    """
    n = order.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    no_wm = jnp.zeros((n,), bool)
    mem_all, ok_all = policy.grow(mem, order, new_lens, finals, caps, want, no_wm)
    f = _first_false(ok_all, want)

    def fast() -> tuple:
        z = jnp.zeros((n,), bool)
        return mem_all, z, z, n_run

    def slow() -> tuple:
        # Everything before the first failure grows exactly as in the batched call.
        m, _ = policy.grow(mem, order, new_lens, finals, caps, want & (pos < f), no_wm)
        f1 = jnp.zeros((1,), bool)

        def body(c):
            m, i, j, pre, cap = c
            s, w = order[i], want[i]
            m_grown, ok = policy.grow(
                m, s[None], new_lens[i][None], finals[i][None], caps[i][None], w[None], f1
            )
            ok = ok[0] | ~w
            other = j - 1 > i  # a lower-priority victim remains
            # n = nobody (an out-of-range index, dropped by the scatters below).
            victim = jnp.where(ok, n, jnp.where(other, j - 1, i))
            m_rel = policy.release(m, order[jnp.minimum(victim, n - 1)][None], (victim < n)[None])
            m = _tree_where(ok & w, m_grown, m_rel)
            alone = ~ok & ~other & (i == 0)
            pre = pre.at[victim].set(~alone, mode="drop")
            cap = cap.at[victim].set(alone, mode="drop")
            i = jnp.where(ok, i + 1, i)
            j = jnp.where(ok, j, jnp.where(other, j - 1, i))
            return m, i, j, pre, cap

        z = jnp.zeros((n,), bool)
        m, _, j, pre, cap = lax.while_loop(lambda c: c[1] < c[2], body, (m, f, n_run, z, z))
        return m, pre, cap, j

    return lax.cond(f >= n, fast, slow)


def schedule(
    policy: Any, config: SchedulerConfig, state: SchedulerState
) -> tuple[SchedulerState, ScheduledBatch]:
    """Decide one step (jittable with policy and config static). See the module docstring.

    Memory for every scheduled token is allocated here (grow to num_computed + q_len), so
    the step's KV writes have blocks. Returns the new state and the batch.
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

    # 2. Running sequences.
    running = state.status == RUNNING
    n_run = jnp.sum(running, dtype=jnp.int32)
    order_r = priority_order(state, config, running)
    rem_r = jnp.where(pos < n_run, (total - state.num_computed)[order_r], 0)
    q_r = _budget_prefix(rem_r, budget)
    want_r = q_r > 0
    mem, pre_pos, cap_pos, _ = _run_running(
        policy,
        state.mem,
        order_r,
        want_r,
        state.num_computed[order_r] + q_r,
        state.final_len[order_r],
        caps_all[order_r],
        n_run,
    )
    sched_r = want_r & ~pre_pos & ~cap_pos
    preempted = jnp.zeros((n,), bool).at[order_r].set(pre_pos)
    cap_run = jnp.zeros((n,), bool).at[order_r].set(cap_pos)
    n_run_after = n_run - jnp.sum(pre_pos | cap_pos, dtype=jnp.int32)

    # 3. Admissions.
    allow = ~jnp.any(pre_pos)
    seq_cap = config.max_num_seqs
    if config.mode == "static":
        allow = allow & (n_run_after == 0)
        seq_cap = min(config.static_batch_size, config.max_num_seqs)
    n_wait = jnp.sum(waiting, dtype=jnp.int32)
    order_w = priority_order(state, config, waiting)
    need_w = jnp.where(pos < n_wait, (total - state.num_computed)[order_w], 0)
    budget_left = budget - jnp.sum(jnp.where(sched_r, q_r, 0))
    if config.chunked_prefill:
        q_w = _budget_prefix(need_w, budget_left)
    else:
        q_w = jnp.where(jnp.cumsum(need_w) <= budget_left, need_w, 0)
    cand = allow & (q_w > 0) & (pos < seq_cap - n_run_after)
    grow_w = (
        order_w,
        state.num_computed[order_w] + q_w,
        state.final_len[order_w],
        caps_all[order_w],
    )
    # Policies' batched calls cost O(B) even when nothing is masked: skip idle ones.
    mem_a, ok_a = lax.cond(
        jnp.any(cand),
        lambda: policy.grow(mem, *grow_w, cand, cand),
        lambda: (mem, jnp.ones((n,), bool)),
    )
    f = _first_false(ok_a, cand)
    adm = cand & (pos < f)
    mem = lax.cond(f >= n, lambda: mem_a, lambda: policy.grow(mem, *grow_w, adm, adm)[0])
    # Refused with nothing else holding memory: it can never fit.
    cap_w_pos = (pos == 0) & cand & ~ok_a & (n_run_after == 0)
    cap_wait = jnp.zeros((n,), bool).at[order_w].set(cap_w_pos)
    admitted = jnp.zeros((n,), bool).at[order_w].set(adm)

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
    emits = row & (start + q_lens == total[safe])

    rejected = too_long | cap_run | cap_wait
    status = jnp.where(admitted, RUNNING, state.status)
    status = jnp.where(preempted, WAITING, status)
    status = jnp.where(rejected, FINISHED, status)
    reason = jnp.where(too_long, REASON_TOO_LONG, state.finish_reason)
    reason = jnp.where(cap_run | cap_wait, REASON_CAPACITY, reason)
    new_state = state._replace(
        status=status.astype(jnp.int32),
        finish_reason=reason.astype(jnp.int32),
        num_computed=jnp.where(preempted | cap_run, 0, state.num_computed),
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
    )
    return new_state, batch
