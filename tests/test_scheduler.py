"""Scheduler rules on small hand-worked scenarios (expected values computed by hand)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.scheduler import (
    FINISHED,
    FREE,
    REASON_ABORTED,
    REASON_CAPACITY,
    REASON_LENGTH,
    REASON_STOP,
    REASON_TOO_LONG,
    RUNNING,
    WAITING,
    SchedulerLimits,
    abort,
    add_requests,
    init_state,
    recycle,
    schedule,
    update,
)
from pagedjax.scheduler.counting_policy import CountingPolicy

N = 4
# Shared (policy, config) pairs: each distinct pair costs a compilation.
P64 = CountingPolicy(N, 64, unit=4)  # 16 units
B4 = SchedulerLimits(N, max_num_batched_tokens=4, max_num_seqs=N, max_model_len=32)
_schedule = jax.jit(schedule, static_argnums=(0, 1))
_update = jax.jit(update, static_argnums=(0, 1))


def _add(state, reqs):
    """reqs: (slot, prompt_len, max_tokens, arrival[, final_len])."""
    cols = [[] for _ in range(5)]
    for r in reqs:
        slot, p, m, a = r[:4]
        final = r[4] if len(r) > 4 else p + m
        for c, v in zip(cols, (slot, p, m, final, a), strict=True):
            c.append(v)
    arrs = [jnp.asarray(c, jnp.int32) for c in cols]
    return add_requests(state, *arrs, jnp.ones(len(reqs), bool))


def _step(policy, cfg, state, stop_rows=()):
    """One schedule + update; returns (state, rows [(slot, q, start, emits)], batch)."""
    state, b = _schedule(policy, cfg, state)
    ns = int(b.num_seqs)
    rows = [
        (int(b.seq_ids[r]), int(b.q_lens[r]), int(b.start_pos[r]), bool(b.emits[r]))
        for r in range(ns)
    ]
    fin = jnp.asarray([r in stop_rows for r in range(N)])
    return _update(policy, cfg, state, b, fin), rows, b


def _free(state) -> int:
    return int(state.mem.free)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerLimits(4, max_num_seqs=5)
    with pytest.raises(ValueError, match="mode"):
        SchedulerLimits(4, max_num_seqs=4, mode="fast")
    with pytest.raises(ValueError, match="priority"):
        SchedulerLimits(4, max_num_seqs=4, priority="random")
    with pytest.raises(ValueError, match="paper mode is FCFS"):
        SchedulerLimits(4, max_num_seqs=4, mode="paper", priority="shortest_remaining")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerLimits(4, max_num_batched_tokens=0, max_num_seqs=4)
    with pytest.raises(ValueError, match="static_batch_size"):
        SchedulerLimits(4, max_num_seqs=4, mode="static", static_batch_size=5)
    cfg = SchedulerLimits.paper(max_seqs=300)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.mode) == (2560, 256, "paper")
    assert cfg.prompt_limit == 2048


def test_input_validation() -> None:
    policy = CountingPolicy(N, 64, unit=4)
    state = init_state(policy, N)
    with pytest.raises(ValueError, match="prompt_lens"):
        add_requests(
            state,
            *(jnp.zeros(2, jnp.int32),),
            jnp.zeros(3, jnp.int32),
            *(jnp.zeros(2, jnp.int32),) * 3,
            jnp.ones(2, bool),
        )
    with pytest.raises(ValueError, match="policy.max_seqs"):
        init_state(CountingPolicy(3, 64), N)
    cfg = SchedulerLimits(N, 8, max_num_seqs=N, max_model_len=32)
    with pytest.raises(ValueError, match="finished_mask"):
        update(policy, cfg, state, schedule(policy, cfg, state)[1], jnp.zeros(3, bool))


def test_chunked_prefill_then_decode_and_finish() -> None:
    policy, cfg = P64, B4
    state = _add(init_state(policy, N), [(2, 10, 2, 0)])
    steps = []
    for _ in range(4):
        state, rows, _ = _step(policy, cfg, state)
        steps.append(rows)
    assert steps == [
        [(2, 4, 0, False)],
        [(2, 4, 4, False)],
        [(2, 2, 8, True)],  # the prompt's last chunk samples the first token
        [(2, 1, 10, True)],  # decode of that token samples the second: max_tokens reached
    ]
    assert int(state.status[2]) == FINISHED and int(state.finish_reason[2]) == REASON_LENGTH
    assert int(state.output_len[2]) == 2 and _free(state) == 16


def test_decodes_first_then_prompt_chunk_in_one_batch() -> None:
    policy, cfg = P64, B4
    state = _add(init_state(policy, N), [(0, 3, 8, 0)])
    state, rows, _ = _step(policy, cfg, state)
    assert rows == [(0, 3, 0, True)]
    state = _add(state, [(1, 5, 8, 1)])
    state, rows, b = _step(policy, cfg, state)
    assert rows == [(0, 1, 3, True), (1, 3, 0, False)] and int(b.num_tokens) == 4
    state, rows, _ = _step(policy, cfg, state)
    assert rows == [(0, 1, 4, True), (1, 2, 3, True)]


def test_paper_mode_rejects_prompts_over_the_budget_and_does_not_chunk() -> None:
    policy = CountingPolicy(N, 64, unit=4)
    cfg = SchedulerLimits(N, 8, max_num_seqs=N, max_model_len=32, mode="paper")
    state = _add(init_state(policy, N), [(0, 10, 4, 0), (1, 6, 4, 1), (2, 5, 4, 2)])
    state, rows, b = _step(policy, cfg, state)
    # 10 > budget: rejected. 6 fits; 6 + 5 does not: strict FCFS stops there (no chunk).
    assert rows == [(1, 6, 0, True)]
    assert np.flatnonzero(b.rejected).tolist() == [0]
    assert int(state.finish_reason[0]) == REASON_TOO_LONG
    assert int(state.status[2]) == WAITING
    state, rows, _ = _step(policy, cfg, state)
    assert rows == [(1, 1, 6, True), (2, 5, 0, True)]


def test_separate_prompt_steps_alternate_prompt_only_and_decode_only() -> None:
    """vLLM v0.1.3's step composition (SchedulerLimits.prompt_steps "separate"): a step
    with an admissible waiting prompt runs prompts only (all that fit the whole budget,
    in FCFS order), else it decodes only; "mixed" (the default) puts both in one step."""
    policy = CountingPolicy(N, 64, unit=4)
    sep = SchedulerLimits(N, 8, max_num_seqs=N, max_model_len=32, mode="paper",
                          prompt_steps="separate")  # fmt: skip
    mixed = SchedulerLimits(N, 8, max_num_seqs=N, max_model_len=32, mode="paper")
    reqs = [(0, 3, 3, 0), (1, 4, 3, 1), (2, 6, 3, 2)]
    state = _add(init_state(policy, N), reqs)
    state, rows, _ = _step(policy, sep, state)
    assert rows == [(0, 3, 0, True), (1, 4, 0, True)]  # 3 + 4 fit, + 6 would not
    state, rows, b = _step(policy, sep, state)
    assert rows == [(2, 6, 0, True)] and int(b.num_tokens) == 6  # 0 and 1 wait
    state, rows, _ = _step(policy, sep, state)
    assert rows == [(0, 1, 3, True), (1, 1, 4, True), (2, 1, 6, True)]  # decode only
    state = _add(state, [(3, 2, 3, 3)])
    state, rows, _ = _step(policy, sep, state)
    assert rows == [(3, 2, 0, True)]
    # Mixed: the second step decodes 0 and 1 and admits 2 with the budget left (2 + 6).
    state = _add(init_state(policy, N), reqs)
    state, rows, _ = _step(policy, mixed, state)
    state, rows, _ = _step(policy, mixed, state)
    assert rows == [(0, 1, 3, True), (1, 1, 4, True), (2, 6, 0, True)]
    # A head the pool refuses (8 tokens: 2 units, 1 free) makes a decode step, not a
    # capacity verdict: something runs and will free memory.
    small = CountingPolicy(N, 8, unit=4)
    state = _add(init_state(small, N), [(0, 4, 2, 0), (1, 8, 2, 1)])
    state, rows, _ = _step(small, sep, state)
    assert rows == [(0, 4, 0, True)]
    state, rows, b = _step(small, sep, state)
    assert rows == [(0, 1, 4, True)] and not bool(b.rejected[1])
    assert int(state.status[1]) == WAITING
    with pytest.raises(ValueError, match="needs mode 'paper'"):
        SchedulerLimits(N, max_num_seqs=N, prompt_steps="separate")
    with pytest.raises(ValueError, match="prompt_steps must be one of"):
        SchedulerLimits(N, max_num_seqs=N, mode="paper", prompt_steps="alternate")


def test_simulated_systems_take_the_step_composition() -> None:
    """Mixed by default; "separate" for every paper-mode system (the paper's Orca ran on
    the same engine and scheduler), never for the static batcher (no compilation)."""
    from pagedjax.simulator import systems

    assert systems.build_system("paged")[1].prompt_steps == "mixed"
    for name in ("paged", "orca_max", "orca_oracle", "ft_static"):
        _, c = systems.build_system(name, prompt_steps="separate")
        assert c.separate_prompt_steps == (name != "ft_static")


def test_preempt_latest_by_recompute_and_return_to_front() -> None:
    # 4 units of 4 tokens. A and B (8 tokens each) fill the pool.
    policy = CountingPolicy(N, 16, unit=4)
    cfg = SchedulerLimits(N, 64, max_num_seqs=N, max_model_len=32)
    state = _add(init_state(policy, N), [(0, 8, 3, 0), (1, 8, 3, 1)])
    state, rows, _ = _step(policy, cfg, state)
    assert rows == [(0, 8, 0, True), (1, 8, 0, True)] and _free(state) == 0
    state = _add(state, [(2, 1, 3, 2)])  # arrives later than B
    # A's decode needs a 3rd unit: B (latest) is preempted, keeping its output token.
    state, rows, b = _step(policy, cfg, state)
    assert rows == [(0, 1, 8, True)] and np.flatnonzero(b.preempted).tolist() == [1]
    assert int(state.status[1]) == WAITING and int(state.num_computed[1]) == 0
    assert int(state.output_len[1]) == 1 and int(state.num_preemptions[1]) == 1
    # No admissions in a step that preempted; then A finishes and B (front) recomputes
    # prompt + its generated token before C is considered.
    state, rows, _ = _step(policy, cfg, state)
    assert rows == [(0, 1, 9, True)] and int(state.status[0]) == FINISHED
    state, rows, _ = _step(policy, cfg, state)
    assert rows == [(1, 9, 0, True), (2, 1, 0, True)]


def test_requests_that_can_never_fit_are_rejected_not_hung() -> None:
    policy = CountingPolicy(N, 8, unit=4)
    paper = SchedulerLimits(N, 16, max_num_seqs=N, max_model_len=32, mode="paper")
    state = _add(init_state(policy, N), [(0, 12, 2, 0)])
    state, rows, b = _step(policy, paper, state)
    assert rows == [] and bool(b.rejected[0])
    assert int(state.finish_reason[0]) == REASON_CAPACITY
    # Chunked: admitted chunk by chunk, then fails alone and is rejected.
    chunked = SchedulerLimits(N, 4, max_num_seqs=N, max_model_len=32)
    state = _add(init_state(policy, N), [(0, 12, 2, 0)])
    for _ in range(3):
        state, rows, b = _step(policy, chunked, state)
    assert bool(b.rejected[0]) and int(state.finish_reason[0]) == REASON_CAPACITY
    assert _free(state) == 2


def test_static_mode_admits_only_when_the_batch_is_done() -> None:
    policy = CountingPolicy(N, 64, unit=4)
    cfg = SchedulerLimits(
        N, 64, max_num_seqs=N, max_model_len=32, mode="static", static_batch_size=2
    )
    state = _add(init_state(policy, N), [(0, 2, 1, 0), (1, 2, 3, 1), (2, 2, 1, 2)])
    state, rows, _ = _step(policy, cfg, state)
    assert [r[0] for r in rows] == [0, 1]  # batch of 2; slot 0 finishes at once
    state, rows, _ = _step(policy, cfg, state)
    assert [r[0] for r in rows] == [1]  # request 2 waits though room exists
    state, rows, _ = _step(policy, cfg, state)
    assert [r[0] for r in rows] == [1] and int(state.status[1]) == FINISHED
    state, rows, _ = _step(policy, cfg, state)
    assert [r[0] for r in rows] == [2]


def test_shortest_remaining_priority_admits_short_first() -> None:
    policy = CountingPolicy(N, 64, unit=4)
    srpt = SchedulerLimits(N, 64, max_num_seqs=1, max_model_len=32, priority="shortest_remaining")
    fcfs = SchedulerLimits(N, 64, max_num_seqs=1, max_model_len=32)
    reqs = [(0, 8, 8, 0), (1, 2, 2, 1)]
    _, rows, _ = _step(policy, srpt, _add(init_state(policy, N), reqs))
    assert [r[0] for r in rows] == [1]
    _, rows, _ = _step(policy, fcfs, _add(init_state(policy, N), reqs))
    assert [r[0] for r in rows] == [0]


def test_stop_applies_to_emitting_rows_only() -> None:
    policy, cfg = P64, B4
    state = _add(init_state(policy, N), [(3, 6, 8, 0)])
    state, rows, _ = _step(policy, cfg, state, stop_rows=(0,))  # a chunk: nothing sampled
    assert rows == [(3, 4, 0, False)] and int(state.status[3]) == RUNNING
    state, rows, _ = _step(policy, cfg, state, stop_rows=(0,))
    assert rows == [(3, 2, 4, True)]
    assert int(state.status[3]) == FINISHED and int(state.finish_reason[3]) == REASON_STOP
    assert _free(state) == 16


def test_true_output_length_and_max_model_len_end_sequences() -> None:
    policy, cfg = P64, B4
    # slot 0: true output 2 (< max_tokens 5); slot 1: 30 + 5 > max_model_len: 2 tokens.
    state = _add(init_state(policy, N), [(0, 3, 5, 0, 5), (1, 30, 5, 1)])
    for _ in range(10):
        state, _, _ = _step(policy, cfg, state)
    assert np.asarray(state.status[:2]).tolist() == [FINISHED, FINISHED]
    assert np.asarray(state.output_len[:2]).tolist() == [2, 2]


def test_watermark_blocks_admission_but_not_growth() -> None:
    # 10 units, watermark 2: an admission must leave 2 units free.
    policy = CountingPolicy(N, 40, unit=4, watermark_frac=0.2)
    cfg = SchedulerLimits(N, 64, max_num_seqs=N, max_model_len=40)
    state = _add(init_state(policy, N), [(0, 32, 8, 0)])  # 8 units: leaves exactly 2
    state, rows, _ = _step(policy, cfg, state)
    assert rows == [(0, 32, 0, True)] and _free(state) == 2
    state = _add(state, [(1, 1, 4, 1)])  # 1 unit would leave 1 < 2: waits
    state, rows, _ = _step(policy, cfg, state)
    assert rows == [(0, 1, 32, True)] and int(state.status[1]) == WAITING
    assert _free(state) == 1  # the running sequence grew into the watermark


def test_abort_and_recycle() -> None:
    policy, cfg = P64, B4
    state = _add(init_state(policy, N), [(0, 2, 8, 0), (1, 9, 8, 1)])
    state, _, _ = _step(policy, cfg, state)  # 0: whole prompt; 1: a 2-token chunk
    assert _free(state) == 16 - 1 - 1
    state = abort(policy, state, jnp.asarray([1, 0]), jnp.asarray([True, False]))
    assert int(state.status[1]) == FINISHED and int(state.finish_reason[1]) == REASON_ABORTED
    assert _free(state) == 15
    state = recycle(state, jnp.asarray([0, 1]), jnp.asarray([True, True]))
    assert np.asarray(state.status[:2]).tolist() == [RUNNING, FREE]


@pytest.mark.tier2  # second tier (docs/testing.md): 17 s cold + 10 s teardown
def test_schedule_vmaps_over_independent_states() -> None:
    """The simulator sweeps configurations with vmap: each lane decides as if alone."""
    policy = CountingPolicy(N, 16, unit=4)
    cfg = SchedulerLimits(N, 64, max_num_seqs=N, max_model_len=32)
    a = _add(init_state(policy, N), [(0, 8, 3, 0), (1, 8, 3, 1)])  # will preempt
    b = _add(init_state(policy, N), [(0, 2, 3, 0)])
    lanes = jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
    vstep = jax.jit(jax.vmap(lambda s: _step_pure(policy, cfg, s)))
    for _ in range(3):
        lanes, vb = vstep(lanes)
        a, rows_a, ba = _step(policy, cfg, a)
        b, rows_b, bb = _step(policy, cfg, b)
        for lane, single in ((0, ba), (1, bb)):
            np.testing.assert_array_equal(vb.seq_ids[lane], single.seq_ids)
            np.testing.assert_array_equal(vb.q_lens[lane], single.q_lens)
            np.testing.assert_array_equal(vb.preempted[lane], single.preempted)
    np.testing.assert_array_equal(lanes.num_computed[0], a.num_computed)


def _step_pure(policy, cfg, state):
    state, b = schedule(policy, cfg, state)
    return update(policy, cfg, state, b, jnp.zeros(N, bool)), b


class _CountingCalls(CountingPolicy):
    """A CountingPolicy that counts how often ``schedule`` traces each method: every
    traced call is a separate copy in the compiled program (XLA inlines call sites)."""

    def grow(self, *args):
        _TRACED["grow"] += 1
        return super().grow(*args)

    def release(self, *args):
        _TRACED["release"] += 1
        return super().release(*args)

    def swap_out(self, *args):
        _TRACED["swap_out"] += 1
        return super().swap_out(*args)

    def swap_in(self, *args):
        _TRACED["swap_in"] += 1
        return super().swap_in(*args)


_TRACED: dict[str, int] = {}


def test_schedule_traces_each_policy_method_once() -> None:
    """``schedule`` is one loop whose body holds the step's only grow and release (and
    the only swap_out / swap_in): its compile cost does not grow with the call sites
    (docs/scheduler.md, "Each policy method traced once"; main before it: 6 grows and 5
    releases). Lowering only, no compile."""
    policy = _CountingCalls(N, 64, unit=4, host_units=16)
    cfg = SchedulerLimits(N, 8, max_num_seqs=N, max_model_len=32, preemption_mode="swap")
    state = _add(init_state(policy, N), [(0, 8, 3, 0), (1, 8, 3, 1)])
    _TRACED.update(grow=0, release=0, swap_out=0, swap_in=0)
    jax.jit(schedule, static_argnums=(0, 1)).lower(policy, cfg, state, jnp.zeros(N, jnp.int32))
    assert _TRACED == dict(grow=1, release=1, swap_out=1, swap_in=1)
