"""The simulated executor: a whole request trace inside one ``lax.while_loop``.

Each loop iteration is one engine step of the real scheduler and memory policy
(``pagedjax.scheduler``), with the model step replaced by a cost model:

1. FINISHED slots are recycled (their times were recorded when they finished).
2. Requests whose arrival time has passed enter free slots, in arrival order
   (``add_requests``). If nothing is live, the clock first jumps to the next arrival.
3. ``schedule`` picks the batch; the cost model gives the step time from the batch's
   prefill tokens, decode sequences and KV tokens read (plus its ``wake_s``, if it has
   one, on the first step after the clock jumped over an idle gap); the clock advances.
4. ``update`` advances lengths; a sequence finishes at its true output length
   (``final_len``, the requests are sent with ``ignore_eos`` as in vLLM's benchmark).

Slots bound the requests inside the scheduler (waiting + running); arrivals beyond the
free slots wait outside, in order. Because admission is strictly FCFS, the outside queue
only changes decisions when every slot is taken by waiting requests *and* more could be
admitted in one step; ``max_seqs`` of a few times ``max_num_seqs`` makes that rare.

Everything is array code, so ``simulate_many`` vmaps the loop over several traces (request
rates, seeds, length spreads) sharing one policy, scheduler limits and cost model. All
outputs are *simulated*: callers must label them so.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pagedjax.scheduler import (
    FINISHED,
    FREE,
    REASON_LENGTH,
    RUNNING,
    SWAPPED,
    WAITING,
    SchedulerLimits,
    add_requests,
    init_state,
    recycle,
    schedule,
    update,
)
from pagedjax.scheduler.schedule import ScheduledBatch
from pagedjax.simulator import speculative as spec_mode
from pagedjax.simulator.speculative import SpecParams


class Trace(NamedTuple):
    """One padded request trace (arrays ``[N]``; add a leading axis for ``simulate_many``).

    arrival: float32 seconds, non-decreasing; padding rows +inf.
    prompt_len, output_len: int32 >= 1 (padding rows 1).
    num_real: int32[] real requests (the first num_real rows).
    window_start: float32[] earliest start of the steady window (a warm-up to skip); the
        window opens at max(window_start, first completion).
    window_end: float32[] end of the steady window (the last real arrival).
    horizon: float32[] simulated time at which the run stops even if requests remain.
    stop_latency: float32[] stop as soon as the trace's mean normalized latency (s/token,
        over all ``num_real`` requests, unfinished ones counted with their wait so far)
        provably exceeds this: the bound only grows, so the run has "exploded" past it.
        A knee search needs no more than that; +inf (default) never stops early.
    """

    arrival: jax.Array
    prompt_len: jax.Array
    output_len: jax.Array
    num_real: jax.Array
    window_start: jax.Array
    window_end: jax.Array
    horizon: jax.Array
    stop_latency: jax.Array


class SimResult(NamedTuple):
    """Per-request arrays ``[N]`` and steady-window averages (``[]``) of one trace.

    finish_time: float32 seconds; +inf if unfinished at the horizon or never run.
    first_token_time: float32 seconds of the first output token; +inf if none.
    rejected: bool, finished without running (too long / cannot fit the pool).
    num_preemptions: int32 preemptions (by recompute or, with a swap policy, by swap;
        a swap's copies cost the cost model's ``swap_time`` when it has one).
    clock: float32[] simulated time at the end. steps: int32[] engine steps.
    win_time: float32[] seconds of the steady window [max(window_start, first
        completion), last arrival].
    win_batched: float32[] time-weighted mean of scheduled sequences per step in it.
    win_usage: float32[4] time-weighted mean slots: token, reserved, internal frag,
        external frag + free (sums to the pool's capacity).
    busy_time: float32[] simulated seconds spent in steps.
    win_free: float32[] time-weighted mean free slots (held by nothing) in the window:
        the free part of win_usage[3], the rest being external fragmentation (buddy
        rounding slack); NaN for a policy without ``free_slots``.
    latency_bound: float32[] the lower bound of the mean normalized latency at the end
        (above ``trace.stop_latency`` when the run stopped early).
    """

    finish_time: jax.Array
    first_token_time: jax.Array
    rejected: jax.Array
    num_preemptions: jax.Array
    clock: jax.Array
    steps: jax.Array
    win_time: jax.Array
    win_batched: jax.Array
    win_usage: jax.Array
    busy_time: jax.Array
    win_free: jax.Array
    latency_bound: jax.Array


def make_trace(
    arrival: np.ndarray,
    prompt_len: np.ndarray,
    output_len: np.ndarray,
    pad_to: int | None = None,
    horizon: float = np.inf,
    window_start: float = 0.0,
    stop_latency: float = np.inf,
) -> Trace:
    """A padded Trace from numpy arrays ``[n]`` (arrival in seconds, sorted)."""
    n = len(arrival)
    size = n if pad_to is None else pad_to
    if size < n:
        raise ValueError(f"pad_to ({pad_to}) is below the number of requests ({n})")
    arr = np.full(size, np.inf, np.float32)
    arr[:n] = arrival
    p = np.ones(size, np.int32)
    o = np.ones(size, np.int32)
    p[:n] = prompt_len
    o[:n] = output_len
    end = float(arrival[-1]) if n else 0.0
    return Trace(
        jnp.asarray(arr),
        jnp.asarray(p),
        jnp.asarray(o),
        jnp.int32(n),
        jnp.float32(window_start),
        jnp.float32(end),
        jnp.float32(horizon),
        jnp.float32(stop_latency),
    )


def stack_traces(traces: list[Trace]) -> Trace:
    """Stack equally padded traces along a new leading axis (for ``simulate_many``)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *traces)


def batch_work(state: Any, batch: ScheduledBatch) -> tuple[jax.Array, ...]:
    """The cost model's inputs for one scheduled batch (int32/float32 scalars).

    A row is a decode when it computes one token on top of cached KV; every other row
    is a prefill (a prompt, a chunk, or a recompute after preemption). Returns
    (prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs, prefill_seqs).
    """
    row = batch.seq_ids >= 0
    q = batch.q_lens
    start = batch.start_pos
    decode = row & (q == 1) & (start > 0)
    prefill = row & ~decode
    f32 = jnp.float32
    prefill_tokens = jnp.sum(jnp.where(prefill, q, 0)).astype(f32)
    decode_seqs = jnp.sum(decode).astype(f32)
    # Decode reads its whole context (incl. the token it writes); a chunk reads its prefix.
    kv = jnp.sum(jnp.where(decode, start + 1, 0)) + jnp.sum(jnp.where(prefill, start, 0))
    qf, sf = q.astype(f32), start.astype(f32)
    pairs = jnp.sum(jnp.where(prefill, qf * (qf + 1) / 2 + qf * sf, 0.0))
    prefill_seqs = jnp.sum(prefill & batch.emits).astype(f32)
    del state
    return prefill_tokens, decode_seqs, kv.astype(f32), pairs, prefill_seqs


def block_work(batch: ScheduledBatch, block_size: int | jax.Array) -> tuple[jax.Array, jax.Array]:
    """(KV blocks the batch's attention visits, unused slots in them) for a paged pool of
    ``block_size`` (an int, or int32[B] per batch row): each row reads the blocks of the
    context batch_work counts for it (decode: start + 1; a prefill chunk: its prefix).
    float32 scalars."""
    row = batch.seq_ids >= 0
    decode = row & (batch.q_lens == 1) & (batch.start_pos > 0)
    ctx = jnp.where(decode, batch.start_pos + 1, jnp.where(row, batch.start_pos, 0))
    blocks = (ctx + block_size - 1) // block_size
    f32 = jnp.float32
    return jnp.sum(blocks).astype(f32), jnp.sum(blocks * block_size - ctx).astype(f32)


class _Carry(NamedTuple):
    state: Any
    clock: jax.Array  # Kahan-summed float32 clock (hi, lo): 1e5 steps of ms would drift
    clock_lo: jax.Array
    next_req: jax.Array
    slot_req: jax.Array
    finish: jax.Array
    first_tok: jax.Array
    rejected: jax.Array
    preempt: jax.Array
    n_done: jax.Array
    first_done: jax.Array
    steps: jax.Array
    win_time: jax.Array
    win_batched: jax.Array
    win_usage: jax.Array
    win_free: jax.Array
    busy: jax.Array
    # Lower bound of the mean normalized latency (early stop): sums over finished
    # requests of (finish - arrival) / out, 1 / out and arrival / out.
    fin_lat: jax.Array
    fin_inv: jax.Array
    fin_arr: jax.Array
    lat_bound: jax.Array
    rec: jax.Array  # float32[record, 5]: the first `record` steps' cost-model inputs


def _simulate(
    policy,
    config: SchedulerLimits,
    cost_model,
    max_steps: int,
    trace: Trace,
    record: int = 0,
    spec: SpecParams | None = None,
):  # spec: a SpecModel's traced arrays (speculative.py) or None
    n_slots = config.max_seqs
    n_req = trace.arrival.shape[0]
    slots = jnp.arange(n_slots, dtype=jnp.int32)
    inf = jnp.float32(jnp.inf)
    # Prefix sums over requests in arrival order of 1 / out and arrival / out: the
    # requests arrived by t and not finished add t * sum(1/o) - sum(a/o) to the bound.
    real = jnp.arange(n_req) < trace.num_real
    inv_out = jnp.where(real, 1.0 / trace.output_len.astype(jnp.float32), 0.0)
    arr_out = jnp.where(real, trace.arrival * inv_out, 0.0)
    cum_inv = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(inv_out)])
    cum_arr = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(arr_out)])
    n_real = jnp.maximum(trace.num_real, 1).astype(jnp.float32)

    def admit(c: _Carry) -> tuple[_Carry, jax.Array]:
        """Recycle finished slots, jump an idle clock to the next arrival, admit the
        arrived requests. Also returns whether the clock jumped (the executor was idle)."""
        st = recycle(c.state, slots, c.state.status == FINISHED)
        live = jnp.any((st.status == WAITING) | (st.status == RUNNING) | (st.status == SWAPPED))
        nxt = trace.arrival[jnp.minimum(c.next_req, n_req - 1)]
        pending = c.next_req < trace.num_real
        jump = ~live & pending & (nxt > c.clock)
        clock = jnp.where(jump, nxt, c.clock)
        clock_lo = jnp.where(jump, 0.0, c.clock_lo)
        arrived = jnp.minimum(
            jnp.searchsorted(trace.arrival, clock, side="right").astype(jnp.int32),
            trace.num_real,
        )
        free = st.status == FREE
        k = jnp.minimum(jnp.sum(free, dtype=jnp.int32), arrived - c.next_req)
        rank = jnp.where(free, jnp.cumsum(free) - 1, n_slots)
        slot_by_rank = jnp.full((n_slots,), 0, jnp.int32).at[rank].set(slots, mode="drop")
        mask = slots < k
        req = jnp.minimum(c.next_req + slots, n_req - 1)
        p, o = trace.prompt_len[req], trace.output_len[req]
        st = add_requests(st, slot_by_rank, p, o, p + o, c.next_req + slots, mask)
        slot_req = c.slot_req.at[jnp.where(mask, slot_by_rank, n_slots)].set(req, mode="drop")
        c = c._replace(
            state=st, clock=clock, clock_lo=clock_lo, next_req=c.next_req + k, slot_req=slot_req
        )
        return c, jump

    def step(c: _Carry) -> _Carry:
        c, woke = admit(c)
        st0 = c.state
        st1, batch = schedule(policy, config, st0)
        work = batch_work(st1, batch)
        if spec is not None:  # decode rows verify k drafts (speculative.py)
            work = spec_mode.verify_work(spec, batch, work)
        dt = cost_model(*work)
        if spec is not None:  # and the draft proposed them (0 unless its cost is given)
            dt = dt + spec_mode.draft_time(spec, batch, cost_model)
        block_time = getattr(cost_model, "block_time", None)
        block_size = getattr(policy, "block_size", None)  # paged pools only
        row_blocks = getattr(policy, "row_block_sizes", None)  # a block size per request
        contiguous = getattr(policy, "contiguous_kernel", False)  # vAttention-like
        if block_time is not None and row_blocks is not None:
            dt = dt + block_time(*block_work(batch, row_blocks(st1.mem, batch.seq_ids)))
        elif block_time is not None and block_size is not None and not contiguous:
            dt = dt + block_time(*block_work(batch, block_size))
        wake_s = getattr(cost_model, "wake_s", 0.0)
        if wake_s:  # static: the first step after an idle executor wakes it (fitted)
            dt = dt + jnp.where(woke, jnp.float32(wake_s), 0.0)
        swap_time = getattr(cost_model, "swap_time", None)
        if swap_time is not None:  # swap copies of the step (0 without a swap pool)
            moved = batch.swap.num_out + batch.swap.num_in
            dt = dt + swap_time(moved, getattr(policy, "block_size", 1))
        rec = c.rec
        if record:  # static: runs without recording pay nothing
            rec = rec.at[jnp.minimum(c.steps, record)].set(jnp.stack(work), mode="drop")
        dt = jnp.where(batch.num_seqs > 0, dt, 0.0).astype(jnp.float32)
        # Kahan summation of the clock.
        y = dt - c.clock_lo
        t = c.clock + y
        clock_lo = (t - c.clock) - y
        t0, t1 = c.clock, t

        # Memory held during the step (after schedule's grows): Fig. 2 accounting.
        ids = jnp.where(batch.seq_ids >= 0, batch.seq_ids, n_slots)
        q_slot = jnp.zeros((n_slots,), jnp.int32).at[ids].set(batch.q_lens, mode="drop")
        lens = st1.num_computed + q_slot
        use = policy.usage(st1.mem, lens, st1.final_len, st1.status == RUNNING)
        use_vec = jnp.stack(
            [use.token_slots, use.reserved_slots, use.internal_frag_slots, use.external_free_slots]
        )
        # Free memory apart from external fragmentation (Fig. 2 draws them apart, so an
        # idle pool never reads as waste); static: a policy without it records NaN.
        free_fn = getattr(policy, "free_slots", None)
        free = free_fn(st1.mem) if free_fn is not None else jnp.float32(jnp.nan)

        if spec is not None:  # the kept drafts, before update adds the step's token
            st1 = spec_mode.accept(spec, st1, batch, c.steps, config.max_model_len)
        st2 = update(policy, config, st1, batch, jnp.zeros((n_slots,), bool))
        newly = (st2.status == FINISHED) & (st0.status != FINISHED)
        req_ids = jnp.where(newly, c.slot_req, n_req)
        finish = c.finish.at[req_ids].set(t1, mode="drop")
        rej = newly & (st2.finish_reason != REASON_LENGTH)
        rejected = c.rejected.at[jnp.where(rej, c.slot_req, n_req)].set(True, mode="drop")
        got_first = (st2.output_len > 0) & (st0.output_len == 0) & (st0.status != FREE)
        first_tok = c.first_tok.at[jnp.where(got_first, c.slot_req, n_req)].set(t1, mode="drop")
        pre = c.preempt.at[jnp.where(batch.preempted, c.slot_req, n_req)].add(1, mode="drop")
        n_fin = jnp.sum(newly & ~rej, dtype=jnp.int32)

        # Early-stop bound: finished requests at their latency, arrived ones at their wait.
        req_c = jnp.clip(c.slot_req, 0, n_req - 1)
        w_inv = jnp.where(newly, inv_out[req_c], 0.0)
        fin_inv = c.fin_inv + jnp.sum(w_inv)
        fin_arr = c.fin_arr + jnp.sum(jnp.where(newly, arr_out[req_c], 0.0))
        fin_lat = c.fin_lat + jnp.sum(w_inv * jnp.where(newly, t1 - trace.arrival[req_c], 0.0))
        k_arr = jnp.minimum(jnp.searchsorted(trace.arrival, t1, side="right"), trace.num_real)
        waiting_inv = cum_inv[k_arr] - fin_inv
        waiting_arr = cum_arr[k_arr] - fin_arr
        lat_bound = (fin_lat + jnp.maximum(t1 * waiting_inv - waiting_arr, 0.0)) / n_real

        # Steady window: from the first completion to the last arrival (time-weighted).
        lo = jnp.maximum(jnp.maximum(t0, c.first_done), trace.window_start)
        w = jnp.clip(jnp.minimum(t1, trace.window_end) - lo, 0.0)
        first_done = jnp.where((n_fin > 0) & (c.first_done == inf), t1, c.first_done)
        return c._replace(
            state=st2,
            clock=t,
            clock_lo=clock_lo,
            finish=finish,
            first_tok=first_tok,
            rejected=rejected,
            preempt=pre,
            n_done=c.n_done + jnp.sum(newly, dtype=jnp.int32),
            first_done=first_done,
            steps=c.steps + 1,
            win_time=c.win_time + w,
            win_batched=c.win_batched + w * batch.num_seqs.astype(jnp.float32),
            win_usage=c.win_usage + w * use_vec,
            win_free=c.win_free + w * free,
            busy=c.busy + dt,
            fin_lat=fin_lat,
            fin_inv=fin_inv,
            fin_arr=fin_arr,
            lat_bound=lat_bound,
            rec=rec,
        )

    def cond(c: _Carry) -> jax.Array:
        return (
            (c.n_done < trace.num_real)
            & (c.clock < trace.horizon)
            & (c.steps < max_steps)
            & (c.lat_bound <= trace.stop_latency)
        )

    z = jnp.float32(0.0)
    c0 = _Carry(
        state=init_state(policy, n_slots),
        clock=z,
        clock_lo=z,
        next_req=jnp.int32(0),
        slot_req=jnp.zeros((n_slots,), jnp.int32),
        finish=jnp.full((n_req,), inf),
        first_tok=jnp.full((n_req,), inf),
        rejected=jnp.zeros((n_req,), bool),
        preempt=jnp.zeros((n_req,), jnp.int32),
        n_done=jnp.int32(0),
        first_done=inf,
        steps=jnp.int32(0),
        win_time=z,
        win_batched=z,
        win_usage=jnp.zeros((4,), jnp.float32),
        win_free=z,
        busy=z,
        fin_lat=z,
        fin_inv=z,
        fin_arr=z,
        lat_bound=z,
        rec=jnp.zeros((max(record, 1), 5), jnp.float32),
    )
    c = lax.while_loop(cond, step, c0)
    safe = jnp.maximum(c.win_time, 1e-9)
    res = SimResult(
        finish_time=c.finish,
        first_token_time=c.first_tok,
        rejected=c.rejected,
        num_preemptions=c.preempt,
        clock=c.clock,
        steps=c.steps,
        win_time=c.win_time,
        win_batched=c.win_batched / safe,
        win_usage=c.win_usage / safe,
        busy_time=c.busy,
        win_free=c.win_free / safe,
        latency_bound=c.lat_bound,
    )
    return (res, c.rec) if record else res


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _simulate_jit(policy, config, cost_model, max_steps, trace, spec=None):
    return _simulate(policy, config, cost_model, max_steps, trace, spec=spec)


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _simulate_rec(policy, config, cost_model, max_steps, record, trace):
    return _simulate(policy, config, cost_model, max_steps, trace, record)


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _simulate_vmap(policy, config, cost_model, max_steps, traces, spec=None):
    return jax.vmap(lambda t: _simulate(policy, config, cost_model, max_steps, t, spec=spec))(
        traces
    )


def simulate(
    policy: Any,
    config: SchedulerLimits,
    cost_model: Any,
    trace: Trace,
    max_steps: int = 2_000_000,
    speculative: Any = None,
) -> SimResult:
    """Run one trace (jitted; policy, config, cost_model must be hashable).
    speculative: a ``speculative.SpecModel`` (simulated speculative decoding) or None.
    Its numbers are traced: SpecModels of one ``pmf_width`` share one compiled loop."""
    _check_speculative_cost(cost_model, speculative)
    spec = None if speculative is None else speculative.params()
    return _simulate_jit(policy, config, cost_model, max_steps, trace, spec)


def _check_speculative_cost(cost_model: Any, speculative: Any) -> None:
    """ValueError for speculation under a per-sequence host cost: the verification's
    draft rows enter the cost model as logits rows (``speculative.verify_work``), which
    that cost would charge as sequences; the one model that has it (``vllm2023``)
    describes 2023 vLLM, which did not speculate."""
    if speculative is not None and getattr(cost_model, "seq_overhead_s", 0.0):
        raise ValueError(
            "speculative simulation needs a cost model without seq_overhead_s (the draft"
            " rows would be charged as sequences); use the roofline, not vllm2023"
        )


def simulate_many(
    policy: Any,
    config: SchedulerLimits,
    cost_model: Any,
    traces: Trace,
    max_steps: int = 2_000_000,
    speculative: Any = None,
) -> SimResult:
    """Run stacked traces (leading axis R) at once under ``vmap``; results gain axis R.

    The loop runs until every trace is done, so pair traces of similar length.
    speculative: as ``simulate``.
    """
    _check_speculative_cost(cost_model, speculative)
    spec = None if speculative is None else speculative.params()
    return _simulate_vmap(policy, config, cost_model, max_steps, traces, spec)


def simulate_recorded(
    policy: Any,
    config: SchedulerLimits,
    cost_model: Any,
    trace: Trace,
    record: int,
    max_steps: int = 2_000_000,
) -> tuple[SimResult, jax.Array]:
    """``simulate`` that also returns the cost-model inputs of its first ``record`` steps.

    float32[record, 5] rows of (prefill_tokens, decode_seqs, kv_tokens, prefill_attn_pairs,
    prefill_seqs), zeros past the last step. When every request arrives at t = 0 the
    schedule does not depend on step times, so the total time under *any* cost model is
    the sum of that model over these rows (used by ``calibrate``).
    """
    if record < 1:
        raise ValueError(f"record must be >= 1, got {record}")
    return _simulate_rec(policy, config, cost_model, max_steps, record, trace)
