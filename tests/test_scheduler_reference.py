"""Differential tests: the jitted scheduler agrees with the plain-Python reference.

Random traces (arrivals, prompt / output lengths, stop tokens, pools small enough to
force preemption) drive both schedulers in lock step; every batch, preemption,
rejection and per-slot state must agree at every step, every request must finish
within a bound, and all memory must come back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.memory.reservation import ReservationPolicy
from pagedjax.scheduler import (
    FINISHED,
    FREE,
    REASON_CAPACITY,
    REASON_LENGTH,
    REASON_STOP,
    REASON_TOO_LONG,
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
from pagedjax.scheduler.counting_policy import CountingPolicy
from pagedjax.scheduler.reference import PolicyOracle, ReferenceScheduler, UnitPoolModel

N = 8  # slots
MAX_STEPS = 400

_paged_small = PagedPolicy(
    num_blocks=17, block_size=4, max_seqs=N, max_blocks_per_seq=12, watermark_frac=0.1
)
_paged_paper = PagedPolicy(
    num_blocks=17, block_size=4, max_seqs=N, max_blocks_per_seq=12, watermark_frac=0.1
)
CASES = {
    "default_fcfs": (
        CountingPolicy(N, 64, unit=4),
        SchedulerLimits(N, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=48),
    ),
    "default_srpt": (  # a pool smaller than the longest requests: capacity rejections
        CountingPolicy(N, 40, unit=4),
        SchedulerLimits(N, 16, max_num_seqs=6, max_model_len=48, priority="shortest_remaining"),
    ),
    "paper_counting": (
        CountingPolicy(N, 64, unit=4, watermark_frac=0.1),
        SchedulerLimits(N, 40, max_num_seqs=6, max_model_len=48, mode="paper"),
    ),
    "paper_counting_separate": (  # vLLM v0.1.3's prompt-only / decode-only steps
        CountingPolicy(N, 64, unit=4, watermark_frac=0.1),
        SchedulerLimits(
            N, 40, max_num_seqs=6, max_model_len=48, mode="paper", prompt_steps="separate"
        ),
    ),
    "static": (
        CountingPolicy(N, 80, unit=4),
        SchedulerLimits(
            N, 96, max_num_seqs=6, max_model_len=48, mode="static", static_batch_size=3
        ),
    ),
    "paged_default": (
        _paged_small,
        SchedulerLimits(N, 16, max_num_seqs=6, max_model_len=48),
    ),
    "paged_paper": (
        _paged_paper,
        SchedulerLimits(N, 40, max_num_seqs=6, max_model_len=48, mode="paper"),
    ),
    # Orca baselines (buddy-allocated reservations): checked through PolicyOracle only.
    "orca_pow2_default": (
        ReservationPolicy("pow2", N, 128, 48, watermark_frac=0.05),
        SchedulerLimits(N, 16, max_num_seqs=6, max_model_len=48),
    ),
    "orca_max_static": (
        ReservationPolicy("max", N, 160, 48),
        SchedulerLimits(
            N, 96, max_num_seqs=6, max_model_len=48, mode="static", static_batch_size=3
        ),
    ),
    # Sequence groups (gang scheduling) with swap preemption; requests may join the
    # previous request's group (run with groups=True).
    "counting_swap": (
        CountingPolicy(N, 64, unit=4, host_units=12),
        SchedulerLimits(N, 16, max_num_seqs=6, max_model_len=48, preemption_mode="swap"),
    ),
    "counting_groups_recompute": (
        CountingPolicy(N, 64, unit=4, host_units=40),
        SchedulerLimits(N, 16, max_num_seqs=6, max_model_len=48, preemption_mode="recompute"),
    ),
    "paged_swap_paper_default": (  # None: swap groups of several, recompute single ones
        PagedPolicy(17, 4, N, 12, watermark_frac=0.1, num_host_blocks=16),
        SchedulerLimits(N, 40, max_num_seqs=6, max_model_len=48, mode="paper"),
    ),
    "paged_swap_tiny_host": (  # the host pool is often too small: recompute fallback
        PagedPolicy(17, 4, N, 12, num_host_blocks=3),
        SchedulerLimits(N, 16, max_num_seqs=6, max_model_len=48, preemption_mode="swap"),
    ),
    # A group that needs nearly the whole pool (hand-made trace below).
    "counting_swap_tight": (
        CountingPolicy(N, 40, unit=4, host_units=20),
        SchedulerLimits(N, 64, max_num_seqs=6, max_model_len=48, preemption_mode="swap"),
    ),
}
ORACLE_ONLY = ("orca_pow2_default", "orca_max_static")
GROUP_CASES = (
    "counting_swap",
    "counting_groups_recompute",
    "paged_swap_paper_default",
    "paged_swap_tiny_host",
    "counting_swap_tight",
)

_schedule = jax.jit(schedule, static_argnums=(0, 1))
_update = jax.jit(update, static_argnums=(0, 1))
_add = jax.jit(add_requests)
_recycle = jax.jit(recycle)


def _free_units(policy, mem) -> tuple[int, int]:
    """(free, total) in the policy's own units."""
    if isinstance(policy, CountingPolicy):
        return int(mem.free), policy.num_units
    if isinstance(policy, ReservationPolicy):  # sequences holding a reservation
        return N - int(np.sum(mem.held)), N
    return int(mem.pool.num_free), policy.num_blocks - 1


def _host_free(policy, mem) -> tuple[int, int]:
    """(free, total) of the host swap pool; (0, 0) without one."""
    if isinstance(policy, CountingPolicy):
        return int(mem.host_free), policy.host_units
    if isinstance(policy, PagedPolicy) and policy.can_swap:
        return int(mem.host_pool.num_free), policy.num_host_blocks
    return 0, 0


def _held_tokens(policy, mem) -> np.ndarray:
    """int[N]: tokens each slot can hold now."""
    if isinstance(policy, CountingPolicy):
        return np.asarray(mem.held) * policy.unit
    if isinstance(policy, ReservationPolicy):
        return np.asarray(mem.reserved_len)
    return -(-np.asarray(mem.tables.lengths) // policy.block_size) * policy.block_size


def _fits_alone(policy, length: int) -> bool:
    """Can a sequence of ``length`` KV tokens be admitted into an empty pool?"""
    if isinstance(policy, CountingPolicy):
        return -(-length // policy.unit) <= policy.num_units - policy.watermark_units
    if isinstance(policy, ReservationPolicy):
        return True  # a buddy allocator's limits are its own tests' business
    return (
        -(-length // policy.block_size) <= policy.num_blocks - 1 - policy.watermark_blocks
        and length <= policy.max_model_len
    )


requests = st.lists(
    st.tuples(
        st.integers(0, 12),  # arrival step
        st.integers(1, 50),  # prompt length (some over the limits)
        st.integers(1, 24),  # max_tokens
        st.integers(0, 23),  # true output length - 1 (clipped to max_tokens)
        st.one_of(st.none(), st.integers(0, 10)),  # output index that samples EOS
    ),
    min_size=1,
    max_size=12,
)

# Requests with a sixth field: join the previous request's sequence group.
group_requests = st.lists(
    st.tuples(
        st.integers(0, 12),
        st.integers(1, 30),
        st.integers(1, 24),
        st.integers(0, 23),
        st.one_of(st.none(), st.integers(0, 10)),
        st.booleans(),
    ),
    min_size=1,
    max_size=12,
)

# Scaled to the profile: 8 per case in CI, 200 under the long profile.
_EXAMPLES = max(6, settings.default.max_examples // 25)


def _unit(policy) -> int:
    return policy.unit if isinstance(policy, CountingPolicy) else policy.block_size


def _attach(policy, state, slots: list[int], lens: list[int]):
    """The engine's prefix-cache attach as the scheduler sees it: each WAITING slot gets
    memory for ``len`` tokens (no watermark; in slot order, each all or nothing) and as
    many computed tokens. A refused one gets nothing. Returns (state', ok per slot)."""
    ids, new, mask = np.zeros(N, np.int32), np.zeros(N, np.int32), np.zeros(N, bool)
    ids[: len(slots)], new[: len(slots)], mask[: len(slots)] = slots, lens, True
    mem, ok = _attach_grow(policy, state.mem, ids, new, mask)
    ok = np.asarray(ok)[: len(slots)]
    got = np.asarray(state.num_computed).copy()
    for s, n_tok, good in zip(slots, lens, ok, strict=True):
        if good:
            got[s] = n_tok
    return state._replace(mem=mem, num_computed=jnp.asarray(got)), ok


_policy_grow = jax.jit(lambda p, *a: p.grow(*a), static_argnums=(0,))


def _attach_grow(policy, mem, ids, new, mask):
    big = jnp.full((N,), 10**6, jnp.int32)  # final / max lengths: unused by unit pools
    return _policy_grow(policy, mem, ids, new, big, big, mask, jnp.zeros(N, bool))


def run_trace(
    case: str,
    reqs: list[tuple],
    oracle: bool = False,
    hits: list[int] | None = None,
    spec_seed: int | None = None,
) -> dict[str, int]:
    """Step both schedulers over ``reqs``; the reference's memory is an independent
    Python model of the pool, or (oracle) the policy itself called per sequence.

    Requests with a sixth field True join the previous request's group (group id: the
    index of the group's first request). ``hits`` (units per request) models prefix
    caching as the engine does it: a WAITING slot with nothing computed (new, preempted
    by recompute, or whose hold was released) gets its hit attached before the next
    step (none while a group is swapped out), capped so the last token is computed.
    ``spec_seed`` models speculative decoding: each step every decoding slot asks for
    0-3 lookahead slots (within its output target), and each row with drafts accepts a
    random number of them (the rest rolled back by ``update``).
    Returns counts of preemptions, swaps, released holds and drafts scheduled.
    """
    policy, cfg = CASES[case]
    group_of = []
    for k, r in enumerate(reqs):
        group_of.append(group_of[k - 1] if k and len(r) > 5 and r[5] else k)
    counts = dict(preempted=0, swapped_out=0, swapped_in=0, released=0, attached=0, drafts=0)
    lookup: set[int] = set()  # slots to look up before the next step (the engine's relookup)
    state = init_state(policy, N)
    memory = PolicyOracle(policy) if oracle else UnitPoolModel.of(policy)
    ref = ReferenceScheduler(cfg, memory)
    order = sorted(range(len(reqs)), key=lambda k: (reqs[k][0], k))
    pending = list(order)
    slot_req: dict[int, int] = {}
    finished_reqs: dict[int, int] = {}  # request -> reason
    for t in range(MAX_STEPS):
        # Intake: read and recycle finished slots, then fill free slots in arrival order.
        done_slots = [s for s, r in ref.reqs.items() if r.status == FINISHED]
        for s in done_slots:
            finished_reqs[slot_req.pop(s)] = ref.reqs[s].finish_reason
            ref.recycle(s)
        mask = np.zeros(N, bool)
        mask[done_slots] = True
        state = _recycle(state, jnp.arange(N, dtype=jnp.int32), jnp.asarray(mask))
        ids, pl, mt, fl, ar, gr = (np.zeros(N, np.int32) for _ in range(6))
        add = np.zeros(N, bool)
        free = [s for s in range(N) if s not in ref.reqs]
        while pending and free and reqs[pending[0]][0] <= t:
            k = pending.pop(0)
            s = free.pop(0)
            p, m, o = reqs[k][1:4]
            out = min(o + 1, m)
            ref.add(s, p, m, p + out, k, group_of[k])
            slot_req[s] = k
            ids[s], pl[s], mt[s], fl[s], ar[s], add[s] = s, p, m, p + out, k, True
            gr[s] = group_of[k]
        state = _add(state, ids, pl, mt, fl, ar, add, gr)
        if not pending and not ref.reqs:
            break
        if hits is not None:
            lookup.update(np.flatnonzero(add).tolist())
            if not any(r.status == SWAPPED for r in ref.reqs.values()):
                slots, lens = [], []
                for s in sorted(lookup):
                    r = ref.reqs.get(s)
                    if r is None or r.status != WAITING or r.num_computed:
                        continue
                    u = _unit(policy)
                    n_tok = min(hits[slot_req[s]] * u, (r.total - 1) // u * u)
                    if n_tok > 0:
                        slots.append(s)
                        lens.append(n_tok)
                lookup.clear()
                if slots:
                    state, ok = _attach(policy, state, slots, lens)
                    want = [ref.attach(s, n_tok) for s, n_tok in zip(slots, lens, strict=True)]
                    assert list(ok) == want, f"step {t}"
                    counts["attached"] += sum(want)

        # Schedule: both must decide the same.
        before = jax.device_get(state.status)
        lookahead = None
        if spec_seed is not None:
            rng = np.random.default_rng((spec_seed, t))
            lookahead = {}
            for s, r in ref.reqs.items():
                room = r.target(cfg.max_model_len) - r.output_len - 1
                if r.status == RUNNING and r.output_len >= 1 and room > 0:
                    lookahead[s] = min(int(rng.integers(0, 4)), room)
            la = np.zeros(N, np.int32)
            la[list(lookahead)] = list(lookahead.values())
            state, batch = _schedule(policy, cfg, state, jnp.asarray(la))
        else:
            state, batch = _schedule(policy, cfg, state)
        rb = ref.schedule(lookahead)
        b = jax.device_get(batch)
        ns = int(b.num_seqs)
        rows = [
            (int(b.seq_ids[r]), int(b.q_lens[r]), int(b.start_pos[r]), bool(b.emits[r]))
            for r in range(ns)
        ]
        assert rows == rb.rows, f"step {t}"
        assert (b.seq_ids[ns:] == -1).all() and (b.q_lens[ns:] == 0).all()
        assert not b.emits[ns:].any()
        assert set(np.flatnonzero(b.preempted)) == rb.preempted, f"step {t}"
        assert set(np.flatnonzero(b.rejected)) == rb.rejected, f"step {t}"
        assert set(np.flatnonzero(b.swap.swapped_out)) == rb.swapped_out, f"step {t}"
        assert set(np.flatnonzero(b.swap.swapped_in)) == rb.swapped_in, f"step {t}"
        assert set(np.flatnonzero(b.released)) == rb.released, f"step {t}"
        counts["released"] += len(rb.released)
        if hits is not None:
            lookup.difference_update(s for s, _, _, _ in rb.rows)
            lookup.update(rb.released | (rb.preempted - rb.swapped_out))
        counts["preempted"] += len(rb.preempted)
        counts["swapped_out"] += len(rb.swapped_out)
        counts["swapped_in"] += len(rb.swapped_in)
        after = jax.device_get(state.status)
        # Gang preemption: a group's running sequences are preempted together or not at all.
        groups = jax.device_get(state.group)
        for s in rb.preempted:
            mates = (groups == groups[s]) & (before == RUNNING)
            assert set(np.flatnonzero(mates)) <= rb.preempted, f"step {t}"
        # No admission while a group is swapped out; swapped groups hold no device memory.
        if (after == SWAPPED).any():
            assert not ((before == WAITING) & (after == RUNNING)).any(), f"step {t}"
        if isinstance(policy, PagedPolicy) and policy.can_swap:
            on_host = np.asarray(jax.device_get(state.mem.on_host))
            np.testing.assert_array_equal(on_host, after == SWAPPED)
        assert int(b.num_tokens) == sum(q for _, q, _, _ in rows) <= cfg.max_num_batched_tokens
        # The step's KV writes have memory.
        held = _held_tokens(policy, jax.device_get(state.mem))
        for s, q, start, _ in rows:
            assert held[s] >= start + q

        # Drafts: the jitted batch's spec_lens are the rows' q_len past their last token.
        accepted: dict[int, int] = {}
        acc_rows = np.zeros(N, np.int32)
        for r, (s, q, start, e) in enumerate(rows):
            spec = max(start + q - ref.reqs[s].total, 0)
            assert int(b.spec_lens[r]) == spec, f"step {t}"
            if spec and e:
                accepted[s] = acc_rows[r] = int(rng.integers(0, spec + 1))
                counts["drafts"] += spec
        # EOS when a token emitted this step (1 + accepted of them) has the request's
        # eos index.
        stopped = {
            s for s, _, _, e in rows
            if e and reqs[slot_req[s]][4] is not None
            and 0 <= reqs[slot_req[s]][4] - ref.reqs[s].output_len <= accepted.get(s, 0)
        }  # fmt: skip
        fin_rows = np.array([r < ns and rows[r][0] in stopped for r in range(N)])
        if spec_seed is not None:
            state = _update(policy, cfg, state, batch, jnp.asarray(fin_rows), jnp.asarray(acc_rows))
        else:
            state = _update(policy, cfg, state, batch, jnp.asarray(fin_rows))
        ref.update(rb, stopped, accepted)

        # Per-slot state agrees.
        st_ = jax.device_get(state)
        assert int((st_.status == RUNNING).sum()) <= cfg.max_num_seqs
        for s in range(N):
            r = ref.reqs.get(s)
            if r is None:
                assert st_.status[s] == FREE
                continue
            got = (
                st_.status[s],
                st_.finish_reason[s],
                st_.output_len[s],
                st_.num_computed[s],
                st_.num_preemptions[s],
            )
            want = (r.status, r.finish_reason, r.output_len, r.num_computed, r.num_preemptions)
            assert tuple(int(x) for x in got) == want, f"step {t} slot {s}"
    else:
        pytest.fail(f"{case}: requests still live after {MAX_STEPS} steps (starvation)")

    # Every request finished, for a reason it deserves; all memory is back.
    assert sorted(finished_reqs) == list(range(len(reqs)))
    free_now, total = _free_units(policy, jax.device_get(state.mem))
    assert free_now == total
    host_now, host_total = _host_free(policy, jax.device_get(state.mem))
    assert host_now == host_total
    if oracle:
        assert _free_units(policy, jax.device_get(memory.state)) == (total, total)
    else:
        assert memory.free == memory.total == total
    for k, reason in finished_reqs.items():
        p, m, o = reqs[k][1:4]
        target = max(1, min(m, o + 1, cfg.max_model_len - p))
        if reason == REASON_TOO_LONG:
            assert p > cfg.prompt_limit or not cfg.chunked_prefill
        elif reason == REASON_CAPACITY:  # a group can fail together where one would fit
            assert not _fits_alone(policy, p + target - 1) or group_of.count(group_of[k]) > 1
        else:
            assert p <= cfg.prompt_limit
            assert reason in (REASON_LENGTH, REASON_STOP)
    return counts


# Second tier (docs/testing.md): each case compiles its own scheduler (5-15 s cold); the
# default tier keeps the counting-policy cases and the paged policy's default config.
SECOND_TIER_CASES = {"paged_paper", "paged_swap_tiny_host", "paged_swap_paper_default",
                     "orca_pow2_default", "orca_max_static"}  # fmt: skip


def _tiered(cases) -> list:
    """The cases in order, the expensive ones marked for the second tier."""
    return [pytest.param(c, marks=pytest.mark.tier2) if c in SECOND_TIER_CASES else c
            for c in cases]  # fmt: skip


@pytest.mark.parametrize("case", _tiered(sorted(set(CASES) - set(ORACLE_ONLY) - set(GROUP_CASES))))
@settings(max_examples=_EXAMPLES)
@given(reqs=requests)
def test_jitted_matches_reference(case: str, reqs: list[tuple]) -> None:
    run_trace(case, reqs)


@pytest.mark.parametrize("case", _tiered(["paged_default", "paged_swap_paper_default"]))
@settings(max_examples=max(3, _EXAMPLES // 2))
@given(reqs=group_requests, seed=st.integers(0, 2**16))
def test_speculative_lookahead_matches_reference(case: str, reqs: list[tuple], seed: int):
    """Lookahead slots (speculative decoding): decoding rows ask for drafts, the budget
    and the pool decide how many they get (preempting like any token), and ``update``
    keeps the accepted ones and rolls the rest back: the jitted scheduler agrees with
    the reference step by step, and all memory comes back."""
    run_trace(case, reqs, spec_seed=seed)


@pytest.mark.tier2  # second tier (docs/testing.md): 17 s cold
def test_speculative_traces_schedule_drafts():
    """The speculative traces above really schedule drafts, and under preemption."""
    reqs = [(0, 8, 24, 23, None, k % 2 == 1) for k in range(6)]
    got = run_trace("paged_swap_paper_default", reqs, spec_seed=1)
    assert got["drafts"] > 0 and got["preempted"] > 0


@pytest.mark.parametrize("case", _tiered(GROUP_CASES))
@settings(max_examples=_EXAMPLES)
@given(reqs=group_requests)
def test_groups_and_swap_match_reference(case: str, reqs: list[tuple]) -> None:
    """Gang preemption, swap out / in, the recompute fallback and no admission while
    swapped: the jitted scheduler agrees with the reference step by step."""
    run_trace(case, reqs)


@settings(max_examples=max(3, _EXAMPLES // 4))
@given(reqs=group_requests)
def test_swap_matches_reference_calling_the_policy(reqs: list[tuple]) -> None:
    """The real PagedPolicy's swap_out / swap_in, called per group by the reference."""
    run_trace("paged_swap_paper_default", reqs, oracle=True)


def test_swap_happens_in_the_traces() -> None:
    """The group cases really swap out, swap back in and fall back to recompute."""
    reqs = [(0, 8, 24, 23, None, k % 2 == 1) for k in range(6)]
    got = run_trace("counting_swap", reqs)
    assert got["swapped_out"] > 0 and got["swapped_in"] == got["swapped_out"]
    got = run_trace("paged_swap_paper_default", reqs)
    assert got["swapped_out"] > 0 and got["swapped_in"] == got["swapped_out"]
    got = run_trace("paged_swap_tiny_host", reqs)  # 3 host blocks: groups need more
    assert got["preempted"] > got["swapped_out"]
    got = run_trace("counting_groups_recompute", reqs)
    assert got["preempted"] > 0 and got["swapped_out"] == 0


def test_swapped_group_needing_nearly_the_whole_pool_comes_back():
    """10 units: X (1 unit) and the group G (5 + 4 units) fill the pool; X's next token
    preempts G, which holds 9 units on the host. With nothing running, G must come back
    without the spare unit per sequence (9 + 2 > 10), or nothing would ever run again
    (admissions are closed while G is out); it then finishes."""
    reqs = [
        (0, 4, 2, 1, None, False),  # X
        (0, 20, 2, 1, None, False),  # G1
        (0, 15, 2, 1, None, True),  # G2, G1's group
    ]
    got = run_trace("counting_swap_tight", reqs)  # all finish by length (checked inside)
    assert got["swapped_out"] == got["swapped_in"] == 2


@pytest.mark.parametrize("case", _tiered(["paged_default", "paged_paper", *ORACLE_ONLY]))
@settings(max_examples=max(3, _EXAMPLES // 4))
@given(reqs=requests)
def test_jitted_matches_reference_calling_the_policy(case: str, reqs: list[tuple]) -> None:
    """The reference driven by the real policy, one sequence per call (slower)."""
    run_trace(case, reqs, oracle=True)


def test_preemption_happens_in_the_traces() -> None:
    """The small pools really force preemption (so the differential test covers it)."""
    reqs = [(0, 20, 24, 23, None) for _ in range(6)]
    for case in ("default_fcfs", "paged_default", "paper_counting"):
        policy, cfg = CASES[case]
        state = init_state(policy, N)
        ids = jnp.arange(6, dtype=jnp.int32)
        state = _add(
            state,
            jnp.pad(ids, (0, N - 6)),
            jnp.full(N, 20, jnp.int32),
            jnp.full(N, 24, jnp.int32),
            jnp.full(N, 44, jnp.int32),
            jnp.arange(N, dtype=jnp.int32),
            jnp.arange(N) < 6,
        )
        preempted = 0
        for _ in range(60):
            state, batch = _schedule(policy, cfg, state)
            preempted += int(batch.preempted.sum())
            state = _update(policy, cfg, state, batch, jnp.zeros(N, bool))
        assert preempted > 0, case
        run_trace(case, reqs)


# Prefix-cache hits: WAITING slots that hold memory (the engine attaches a request's
# cached prefix before it is admitted, and again after a recompute preemption).
HIT_CASES = ("default_fcfs", "default_srpt", "paper_counting", "paged_default", "counting_swap")
hit_units = st.lists(st.integers(0, 8), min_size=12, max_size=12)


@pytest.mark.parametrize("case", HIT_CASES)
@settings(max_examples=_EXAMPLES)
@given(reqs=group_requests, hits=hit_units)
def test_prefix_hits_match_reference(case: str, reqs: list[tuple], hits: list[int]) -> None:
    """Holds of WAITING slots give way (released before a preemption, a capacity verdict
    or the end of admission): the jitted scheduler agrees with the reference, and no
    request is finished for capacity that would fit alone (checked in run_trace)."""
    run_trace(case, reqs, hits=hits)


@settings(max_examples=max(3, _EXAMPLES // 4))
@given(reqs=requests, hits=hit_units)
def test_prefix_hits_match_reference_calling_the_policy(reqs: list[tuple], hits: list[int]):
    run_trace("paged_default", reqs, oracle=True, hits=hits)


def test_waiting_holds_give_way_to_a_running_request() -> None:
    """The engine's issue of 2026-12-01 at the scheduler level (16 units of 4 tokens):
    A (prompt 44, 4 new tokens: 12 units at the end) runs while B waits on a 5-unit hit.
    At A's first decode the pool is full and nobody runs behind A: it used to be
    finished for capacity although it fits alone (run_trace checks that no request is).
    Now B's hold is released and A finishes by length (B runs too; checked inside)."""
    reqs = [(0, 44, 4, 3, None), (0, 24, 4, 3, None)]
    got = run_trace("default_fcfs", reqs, hits=[0, 5])
    assert got["released"] > 0


def test_admission_refusal_releases_holds_behind_it() -> None:
    """Nothing runs and the head of the queue (A, first chunk 4 units) is refused while
    the hits of the requests behind it (9 + 4 of 16 units) hold the pool: their holds are
    released and A admitted, not finished for capacity."""
    reqs = [(0, 44, 4, 3, None), (0, 40, 1, 0, None), (0, 20, 4, 3, None)]
    got = run_trace("default_fcfs", reqs, hits=[0, 9, 4])
    assert got["released"] > 0
