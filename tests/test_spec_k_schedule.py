"""k per step (engine/spec/k_schedule.py): vLLM's batch-size table and the automatic rule.

The table's lookup equals a direct reading of vLLM's rule (the k of the last range
starting at or below B, capped at num_speculative_tokens); its validation refuses what
vLLM refuses. ``allocate`` equals a brute-force search of every per-row k vector. In the
engine, greedy outputs equal the plain run's under a table whose k changes with the batch
(4, 1, 0 and back) and under the automatic rule in both directions (a verification that
costs ten plain steps: k = 0, no draft proposed; one that costs a plain step: drafts),
and the verification still compiles once per (T, S) bucket whatever the k.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.config import ConfigError, SpeculativeConfig
from pagedjax.engine.spec.k_schedule import (
    Acceptance,
    StepCost,
    allocate,
    allocate_levels,
    batch_size_lookup,
    bfs_order,
    node_levels,
)
from tests.test_speculative import (
    OracleProposer,
    _assert_same,
    _drain,
    _engine,
    _greedy,
    _prompts,
    _reference,
    _refs,
    check_memory,
)


def _reference_k(table, b: int, kmax: int) -> int:
    """vLLM's rule read directly: the last range starting at or below b decides (inside
    it, in the gap after it, or past the last range)."""
    return min(kmax, [k for lo, _, k in sorted(table) if lo <= b][-1])


@st.composite
def tables(draw):
    """Valid 3-item tables: sorted, non-overlapping ranges from 1, maybe with gaps."""
    n = draw(st.integers(1, 4))
    rows, lo = [], 1
    for _ in range(n):
        hi = lo + draw(st.integers(0, 5))
        rows.append([lo, hi, draw(st.integers(0, 8))])
        lo = hi + 1 + draw(st.integers(0, 3))
    return rows


@settings(max_examples=60, deadline=None)
@given(tables(), st.integers(1, 40), st.integers(1, 6))
def test_batch_size_lookup_is_vllms_rule(table, max_batch, kmax):
    cfg = SpeculativeConfig(num_speculative_tokens=kmax,
                            num_speculative_tokens_per_batch_size=table)  # fmt: skip
    parsed = SpeculativeConfig.from_dict({"num_speculative_tokens": kmax,
                                          "num_speculative_tokens_per_batch_size": table})
    assert parsed == cfg  # the JSON form (--speculative-config) normalises alike
    dense = batch_size_lookup(cfg.num_speculative_tokens_per_batch_size, max_batch, kmax)
    for b in range(1, max_batch + 1):
        assert dense[b] == _reference_k(table, b, kmax), (table, b)


@pytest.mark.parametrize("table,match", [
    ([[2, 4, 1]], "start at 1"),
    ([[1, 4, 2], [3, 8, 1]], "non-overlapping"),
    ([[1, 4, -1]], ">= 0"),
    ([[4, 1, 2]], "start must be <= end"),
    ([[1, 4, 1, 100, 2]], "5-item form"),
    ([], "non-empty"),
])  # fmt: skip
def test_batch_size_table_refusals(table, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig.from_dict({"num_speculative_tokens_per_batch_size": table})
    with pytest.raises(ConfigError, match="draft_sample_method"):
        SpeculativeConfig.from_dict({"draft_sample_method": "nucleus"})


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 3)), min_size=1, max_size=3),
    st.integers(1, 4),
    st.lists(st.floats(0.5, 4.0), min_size=10, max_size=10),
)
def test_allocate_is_the_brute_force_optimum(rows, base, steps):
    alpha = np.array([a for a, _ in rows])
    caps = np.array([c for _, c in rows])
    table = np.cumsum(steps)  # cost(n): increasing in the drafts (buckets may be flat)

    def rate(ks) -> float:
        gain = sum(alpha[r] ** j for r, k in enumerate(ks) for j in range(1, k + 1))
        return (base + gain) / table[sum(ks)]

    got = allocate(alpha, caps, base, lambda n: float(table[n]))
    assert np.all((0 <= got) & (got <= caps))
    best = max(rate(ks) for ks in itertools.product(*(range(c + 1) for c in caps)))
    assert rate(got) >= best * (1 - 1e-9)


def test_allocate_unknown_cost_keeps_caps_and_acceptance_estimate():
    caps = np.array([3, 0, 2])
    np.testing.assert_array_equal(allocate(np.ones(3) * 0.5, caps, 2, lambda n: None), caps)
    acc = Acceptance(4)
    acc.bind(0, 7)
    # rows: 4 drafts, 2 accepted (one rejection); 3 drafts all accepted (none)
    acc.record(np.array([0, 0]), np.array([4, 3]), np.array([2, 3]))
    a = acc.alpha(np.array([0]))[0]
    g = acc.global_accepted / (acc.global_accepted + acc.global_rejected)
    assert a == pytest.approx((5 + 2 * g) / (5 + 1 + 2))  # MLE 5 / 6 shrunk to g
    acc.bind(0, 8)  # a new sequence in the slot starts from the global estimate
    assert acc.alpha(np.array([0]))[0] == pytest.approx(g)


@pytest.mark.parametrize("verify_cost,expect_drafts", [(3.0, False), (1.05, True)])
def test_step_cost_explores_then_settles(verify_cost, expect_drafts):
    """Allocation and measurement in a loop, costs per (verifies, T) from a known world
    (a plain step: 1.0, a verifying one: verify_cost, whatever T): whatever it tries
    first, the rule measures both kinds and settles on the better one, alpha = 0.4."""
    cost, buckets = StepCost(), (8, 16, 32)
    picked = []
    for _ in range(12):
        def est(n: int) -> float:
            t = next(x for x in buckets if x >= 8 + n)
            return cost.estimate((n > 0, t, t))

        k = allocate(np.full(8, 0.4), np.full(8, 3), 8, est)
        n = int(k.sum())
        t = next(x for x in buckets if x >= 8 + n)
        cost.observe((n > 0, t, t), verify_cost if n else 1.0)  # weight-bound: flat in T
        picked.append(n)
    assert (picked[-1] > 0) == expect_drafts, picked
    assert len(set(picked[-3:])) == 1, picked  # settled


@pytest.mark.parametrize("spike_plain", [True, False])
def test_refresh_recovers_from_a_transient_measurement(spike_plain):
    """A world where drafting costs 3 plain steps, but the first measurements of one side
    were a transient (the shared box): the plain step measured at 10, or drafting at
    0.5. Without refreshing, a plain step measured at 10 keeps the rule drafting for good
    (the key it stopped choosing is never measured again); with ``choose_with_refresh``
    it runs the plain step again within REFRESH_STEPS steps and settles on plain steps.
    A drafting spike needs no refresh: the rule keeps drafting, measures, and stops."""
    from pagedjax.engine.spec.k_schedule import REFRESH_STEPS, choose_with_refresh

    def run(refresh: bool) -> list[int]:
        cost, picked = StepCost(), []

        def key(n: int) -> tuple:
            t = 16 if n else 8
            return (n > 0, t, t)

        def choose(c):
            return allocate(np.full(8, 0.4), np.full(8, 1), 8, c)

        for step in range(4 * REFRESH_STEPS):
            if refresh:
                n = int(choose_with_refresh(choose, key, cost).sum())
            else:
                n = int(choose(lambda m: cost.estimate(key(m))).sum())
            spike = step < 4 and (n == 0) == spike_plain
            seconds = (10.0 if n == 0 else 0.5) if spike else (3.0 if n else 1.0)
            cost.observe(key(n), seconds)
            picked.append(n)
        return picked

    stuck, fixed = run(False), run(True)
    if spike_plain:
        assert all(stuck[-2 * REFRESH_STEPS:]), stuck  # never measures plain again
    assert fixed[-2 * REFRESH_STEPS:] == [0] * (2 * REFRESH_STEPS), fixed


class _Spy:
    """Wraps SpeculativeDecoder.plan: (batch size, largest k) of every planned step."""

    def __init__(self, spec):
        self.spec, self.real, self.seen = spec, spec.plan, []

    def __call__(self, core):
        lookahead, drafts = self.real(core)
        self.seen.append((len(core.book.slot_owner), int(lookahead.max())))
        return lookahead, drafts


def _run_with(config_changes: dict, cost=None):
    """Greedy requests of different lengths (the batch shrinks as they finish) through
    the shared speculative engine with ``config_changes``; returns (ref, got, spy, stats)."""
    prompts = dict(enumerate(_prompts(21, 4, lo=6, hi=24)))
    reqs = [(str(i), p, _greedy(8 + 4 * i)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _engine(True)
    spec = engine.speculator
    old = (spec.config, spec.proposer, spec.cost, spec.plan)
    spec.config = dataclasses.replace(spec.config, **config_changes)
    spec.proposer = OracleProposer(_refs(ref, prompts), bad=3)
    spy_proposer = spec.proposer
    if cost is not None:
        spec.cost = cost
    spy = spec.plan = _Spy(spec)
    try:
        engine.reset_stats()
        got = _drain(engine, reqs, on_step=check_memory)
        spy.proposals = spy_proposer.calls
        return ref, got, spy, engine.stats(), dict(spec.verifier.trace_count)
    finally:
        spec.config, spec.proposer, spec.cost = old[:3]
        del spec.plan  # the instance attribute: the method again
        spec.acceptance = None


def test_batch_size_table_greedy_equals_plain_one_program_per_bucket():
    table = ((1, 1, 4), (2, 2, 1), (4, 4, 0))  # B = 3 is in the gap: k(2) = 1
    ref, got, spy, stats, traces = _run_with({"num_speculative_tokens_per_batch_size": table})
    _assert_same(ref, got)
    want = {1: 4, 2: 1, 3: 1, 4: 0}
    assert all(k <= want[b] for b, k in spy.seen), spy.seen
    assert {k for _, k in spy.seen} >= {0, 1, 4}, spy.seen  # every entry was exercised
    assert stats["spec_accepted_tokens"] > 0
    assert all(v == 1 for v in traces.values()), traces  # no program per k


class _FixedCost:
    """A cost table that does not learn: a verifying step costs ``verify`` plain ones."""

    def __init__(self, verify: float):
        self.verify = verify

    def observe(self, key, seconds) -> None:
        pass

    def estimate(self, key) -> float:
        return self.verify if key[0] else 1.0

    def stale(self, key) -> bool:
        return False


@pytest.mark.parametrize("verify_cost", [10.0, 1.0])
def test_auto_rule_greedy_equals_plain_down_to_zero(verify_cost):
    ref, got, spy, stats, _ = _run_with({"auto_num_speculative_tokens": True},
                                        cost=_FixedCost(verify_cost))  # fmt: skip
    _assert_same(ref, got)
    if verify_cost > 5:  # never pays: k = 0, plain steps only, and no proposal is made
        assert stats["spec_proposed_tokens"] == 0 and stats["spec_steps"] == 0
        assert {k for _, k in spy.seen} == {0}
        assert spy.proposals == 0  # plan's pre-check (_auto_may_draft) skipped the proposer
    else:  # free drafts always pay (alpha > 0): every row keeps its proposals
        assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
        assert spy.proposals > 0


# ---------------------------------------------------------------- trees (by levels)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 1.0), st.lists(st.integers(1, 3), max_size=3)),
             min_size=1, max_size=3),
    st.integers(1, 4),
    st.lists(st.floats(0.5, 4.0), min_size=28, max_size=28),
)  # fmt: skip
def test_allocate_levels_is_the_brute_force_optimum(rows, base, steps):
    """Every vector of depth prefixes tried: the rate of the allocation is the best."""
    alpha = np.array([a for a, _ in rows])
    widths = [np.array(w, np.int64) for _, w in rows]
    table = np.cumsum(steps)  # cost(n) for n nodes

    def rate(ds) -> float:
        gain = sum(alpha[r] ** j for r, d in enumerate(ds) for j in range(1, d + 1))
        return (base + gain) / table[sum(int(widths[r][:d].sum()) for r, d in enumerate(ds))]

    got = allocate_levels(alpha, widths, base, lambda n: float(table[n]))
    assert all(0 <= d <= len(w) for d, w in zip(got, widths, strict=True))
    best = max(rate(ds) for ds in itertools.product(*(range(len(w) + 1) for w in widths)))
    assert rate(got) >= best * (1 - 1e-9)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 4)), min_size=1, max_size=4),
       st.lists(st.floats(0.5, 4.0), min_size=17, max_size=17))  # fmt: skip
def test_allocate_levels_on_chains_is_allocate(rows, steps):
    """A chain is a tree of width 1 at every depth: the same optimum as ``allocate``."""
    alpha, caps = np.array([a for a, _ in rows]), np.array([c for _, c in rows])
    table = np.cumsum(steps)
    chain = allocate(alpha, caps, 2, lambda n: float(table[n]))
    tree = allocate_levels(alpha, [np.ones(c, np.int64) for c in caps], 2,
                           lambda n: float(table[n]))  # fmt: skip
    def rate(ks) -> float:  # ties may split differently between rows: compare the rates
        gain = sum(alpha[r] ** j for r, k in enumerate(ks) for j in range(1, k + 1))
        return (2 + gain) / table[sum(ks)]

    assert rate(tree) == pytest.approx(rate(chain), rel=1e-9)
    assert sum(tree) == sum(chain)  # the same n: the smallest at the best rate
    assert allocate_levels(alpha, [np.ones(c, np.int64) for c in caps], 2,
                           lambda n: None).tolist() == caps.tolist()  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 4), st.lists(st.integers(1, 3),
                                                                       max_size=4)),
             min_size=1, max_size=4),
    st.integers(1, 8),
    st.floats(1.0, 1.6),
    st.lists(st.floats(0.0, 0.1), min_size=40, max_size=40),
)  # fmt: skip
def test_no_drafts_on_full_chains_means_none_for_any_proposal(rows, base, jump, steps):
    """``plan``'s pre-check (``SpeculativeDecoder._auto_may_draft``): when ``allocate``
    gives no drafts on chains of each row's depth cap, neither ``allocate`` on the
    proposals' (shorter) chains nor ``allocate_levels`` on any trees within those depths
    (each level >= 1 node) gives any, so skipping the proposers changes nothing. Costs:
    a plain step 1, a verifying one ``jump`` plus increments (buckets rise with nodes)."""
    alpha = np.array([a for a, _, _ in rows])
    caps = np.array([c for _, c, _ in rows])
    widths = [np.array(w[:c], np.int64) for _, c, w in rows]
    table = np.concatenate([[1.0], jump + np.cumsum(steps)])

    def cost(n: int) -> float:
        return float(table[min(n, len(table) - 1)])

    if allocate(alpha, caps, base, cost).sum():
        return  # the pre-check lets the step draft: the real rule decides, as before
    assert allocate(alpha, np.array([len(w) for w in widths]), base, cost).sum() == 0
    assert allocate_levels(alpha, widths, base, cost).sum() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1, 30), min_size=1, max_size=16))
def test_bfs_order_keeps_the_tree_and_puts_levels_first(raw):
    """Any parents-first tree: the breadth-first layout is parents-first, depth-sorted,
    and the same tree (each node's path of old indices maps to the new one's)."""
    parents = [p if p < i else -1 for i, p in enumerate(raw)]
    order, new_par, depth = bfs_order(parents)
    assert sorted(order.tolist()) == list(range(len(parents)))
    assert np.all(np.diff(depth) >= 0)
    assert all(p < i for i, p in enumerate(new_par))
    np.testing.assert_array_equal(depth, node_levels(parents)[order])
    for i, p in enumerate(new_par):  # the same edges, renumbered
        assert (parents[order[i]] == -1) if p < 0 else (parents[order[i]] == order[p])
    for d in range(1, int(depth.max()) + 1):  # depths 1..d are a prefix: a tree
        n = int((depth <= d).sum())
        assert all(p < n for p in new_par[:n])


def _rotating_level_cap(monkeypatch) -> None:
    """The rule's levels per row capped at (call + row) mod 5: every cut gets made."""
    from pagedjax.engine.spec import decoder

    calls = []

    def rotating(alpha, widths, rows, cost):
        keep = allocate_levels(alpha, widths, rows, cost)
        calls.append(len(calls))
        return np.minimum(keep, [(len(calls) + r) % 5 for r in range(len(widths))])

    monkeypatch.setattr(decoder, "allocate_levels", rotating)


@pytest.mark.tier2  # an engine (14 s cold); the allocation's unit tests stay in the default
def test_auto_rule_with_trees_greedy_and_seeded_equal_plain(monkeypatch):
    """N-gram trees (an oracle trie: a decoy branch, the right one, a sibling) under the
    automatic rule, nodes breadth-first and cut by levels: greedy and seeded outputs equal
    the plain run's through chunked prefill and preemption, block invariants after every
    step (the tree path, mask and compaction in CI's second tier). The tiny engine has one token
    bucket (a flat cost: the rule keeps all or nothing), so the levels each row keeps are
    the rule's capped by a rotating cap (0, 1, ... levels): whole trees, trees cut by
    levels and no drafts all go through the engine."""
    from pagedjax.sampling import SamplingParams

    _rotating_level_cap(monkeypatch)
    from tests.test_spec_tree import OracleTree
    from tests.test_spec_tree import _engine as tree_engine
    from tests.test_spec_tree import _reference as tree_reference

    prompts = dict(enumerate(_prompts(1, 4, lo=6, hi=40)))  # some over BUDGET: chunked
    reqs = [(str(i), p, _greedy(24)) for i, p in prompts.items()]
    reqs.append(("s", prompts[0], SamplingParams(temperature=0.9, top_k=50, seed=3,
                                                 max_tokens=16, ignore_eos=True)))  # fmt: skip
    ref = tree_reference(reqs)
    engine = tree_engine((8, 2))
    spec = engine.speculator
    old = (spec.config, spec.tree_proposer, spec.cost)
    spec.config = dataclasses.replace(spec.config, auto_num_speculative_tokens=True)
    spec.tree_proposer = OracleTree(_refs(ref, {**prompts, "s": prompts[0]}), bad=100)
    spec.cost = _FixedCost(1.0)  # drafts are free: the rule keeps every level
    cuts = []  # (nodes proposed, nodes kept) of every row the rule saw

    def auto(core, key, lookahead, drafts):
        before, parents = lookahead.copy(), spec._parents.copy()
        real_auto(core, key, lookahead, drafts)
        for slot in np.flatnonzero(before):
            b, a = int(before[slot]), int(lookahead[slot])
            cuts.append((b, a))
            depth = node_levels(parents[slot, :b])  # the kept nodes: whole levels first
            assert a in (0, b) or depth[:a].max() < depth[a:].min(), (depth, a)

    real_auto, spec._auto = spec._auto, auto
    try:
        engine.reset_stats()
        before = engine.num_preemptions
        got = _drain(engine, reqs, on_step=check_memory)
        stats = engine.stats()
        assert engine.num_preemptions > before, "the pool was meant to force preemption"
    finally:
        spec.config, spec.tree_proposer, spec.cost = old[:3]
        del spec._auto
        spec.acceptance = None
    _assert_same({k: v for k, v in ref.items() if k != "s"},
                 {k: v for k, v in got.items() if k != "s"})  # fmt: skip
    assert got["s"].outputs[0].token_ids == ref["s"].outputs[0].token_ids
    assert stats["spec_accepted_tokens"] > 0
    assert engine.num_free_blocks() == engine.num_usable_blocks()
    assert any(a == b for b, a in cuts), cuts  # whole trees kept
    assert any(0 < a < b for b, a in cuts), cuts  # trees cut by levels
    assert any(a == 0 for b, a in cuts), cuts  # and none


@pytest.mark.tier2  # an EAGLE engine and the dense head recomputation (17 s cold)
def test_eagle_steps_without_drafts_keep_the_head_exact_and_are_measured(tmp_path):
    """A head method with steps where no row drafts (two in every four, as the automatic
    rule or the batch-size table may leave them), then drafting again: no proposal runs
    on those steps, yet after every step each decoding sequence's head feature equals the
    head recomputed from scratch over its committed tokens (so its head KV is complete,
    and the next proposals are what an unpaused run would make); greedy outputs equal
    the plain run's. Then under the automatic rule the cost table holds the no-draft key
    (drafts False): the head's catch-up step is what the rule compares drafting with."""
    from tests.test_spec_eagle import _check_head_features, _head_dir
    from tests.test_spec_eagle import _engine as eagle_engine

    engine = eagle_engine(_head_dir(str(tmp_path)))
    spec = engine.speculator
    prompts = dict(enumerate(_prompts(12, 2, lo=8, hi=14)))
    reqs = [(str(i), p, _greedy(16)) for i, p in prompts.items()]
    ref = _reference(reqs)
    real_plan, planned, checked = spec.plan, [], []

    def paused(core):
        lookahead, drafts = real_plan(core)
        if len(planned) % 4 in (1, 2):
            lookahead[:] = 0
        planned.append(int(lookahead.sum()))
        return lookahead, drafts

    spec.plan = paused
    try:
        engine.reset_stats()
        got = _drain(engine, reqs, on_step=lambda e: checked.append(_check_head_features(e)))
    finally:
        del spec.plan
    _assert_same(ref, got)
    assert engine.stats()["spec_proposed_tokens"] > 0
    paused_steps = [i for i, n in enumerate(planned) if n == 0 and i % 4 in (1, 2)]
    assert any(checked[i] for i in paused_steps) and any(checked[i + 1] for i in paused_steps)

    spec.config = dataclasses.replace(spec.config, auto_num_speculative_tokens=True)
    try:
        _assert_same(ref, _drain(engine, reqs))
    finally:
        spec.config = dataclasses.replace(spec.config, auto_num_speculative_tokens=False)
        spec.acceptance = None
    assert any(not key[0] for key in spec.cost.seconds), spec.cost.seconds


@pytest.mark.slow  # ~5 s warm: the n-gram tree case (tier2) covers the plumbing
@pytest.mark.parametrize("dynamic", [False, True])
def test_auto_rule_with_eagle_trees_greedy_equals_plain(monkeypatch, tmp_path, dynamic):
    """EAGLE trees (level-major already; the EAGLE-2 dynamic tree too: the same depths)
    cut by levels under the automatic rule: greedy outputs equal the plain run's; some
    rows drafted part of their levels."""
    from tests.test_spec_eagle import _head_dir
    from tests.test_spec_tree import _eagle_tree_engine

    _rotating_level_cap(monkeypatch)
    engine = _eagle_tree_engine(_head_dir(str(tmp_path)), dynamic=dynamic)
    spec = engine.speculator
    spec.config = dataclasses.replace(spec.config, auto_num_speculative_tokens=True)
    spec.cost = _FixedCost(1.0)
    prompts = dict(enumerate(_prompts(4, 3, lo=6, hi=20)))
    reqs = [(str(i), p, _greedy(16)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine.reset_stats()
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    s = engine.stats()
    assert 0 < s["spec_proposed_tokens"] < s["spec_rows"] * spec.k, s
