"""The simulator's speculative mode (pagedjax/simulator/speculative.py)."""

import numpy as np
import pytest

from pagedjax.scheduler import SchedulerLimits
from pagedjax.scheduler.counting_policy import CountingPolicy
from pagedjax.simulator.cost_model import FittedCostModel
from pagedjax.simulator.simulate import make_trace, simulate
from pagedjax.simulator.speculative import MIN_PMF_WIDTH, SpecModel

# 10 ms per step + 1 ms per prefill-like token: easy to reason about by hand.
COST = FittedCostModel((0.01, 0.001, 0.0, 0.0, 0.0))
N = 16
POLICY = CountingPolicy(N, 160)
CFG = SchedulerLimits(
    max_seqs=N, max_num_batched_tokens=256, max_num_seqs=N, max_model_len=64, mode="paper"
)


def test_all_accepted_by_hand():
    """k = 4, every draft kept: prefill (token 1), then 1 + 4 tokens a step, the last
    step capped at the output length (never more tokens than asked)."""
    tr = make_trace(np.array([1.0]), np.array([10]), np.array([9]), pad_to=32)
    spec = SpecModel(4, (0.0, 0.0, 0.0, 0.0, 1.0))
    r = simulate(POLICY, CFG, COST, tr, speculative=spec)
    assert int(r.steps) == 3  # outputs 1 -> 6 -> 9
    # prefill 0.01 + 10 * 0.001, then two steps of 0.01 + 4 draft tokens * 0.001.
    assert float(r.finish_time[0]) == pytest.approx(1.0 + 0.02 + 2 * 0.014, abs=1e-5)


def test_draft_cost_fraction_by_hand():
    """The same run with the draft's cost at half the target's decode step: each of the
    two speculating steps adds k x 0.5 x 10 ms (the prefill step has no draft). Shares
    the compiled loop of the test above (the SpecModel's numbers are traced)."""
    tr = make_trace(np.array([1.0]), np.array([10]), np.array([9]), pad_to=32)
    spec = SpecModel(4, (0.0, 0.0, 0.0, 0.0, 1.0), draft_cost_fraction=0.5)
    r = simulate(POLICY, CFG, COST, tr, speculative=spec)
    assert int(r.steps) == 3
    assert float(r.finish_time[0]) == pytest.approx(1.0 + 0.02 + 2 * (0.014 + 0.02), abs=1e-5)


def test_tree_nodes_and_draft_width_by_hand():
    """A tree of depth 2 with 6 nodes (3 branches), every level kept: 6 verified draft
    tokens a step (6 ms), 1 + 2 tokens kept, outputs 1 -> 4 -> 7 -> 9 (the last step
    capped); the draft's 2 steps over 3 rows at half a decode step (10 ms) add 2 x 0.5 x
    10 ms each. The same compiled loop as the tests above."""
    tr = make_trace(np.array([1.0]), np.array([10]), np.array([9]), pad_to=32)
    spec = SpecModel(2, (0.0, 0.0, 1.0), nodes=6, draft_width=3, draft_cost_fraction=0.5)
    r = simulate(POLICY, CFG, COST, tr, speculative=spec)
    assert int(r.steps) == 4
    assert float(r.finish_time[0]) == pytest.approx(1.0 + 0.02 + 3 * (0.016 + 0.01), abs=1e-5)
    with pytest.raises(ValueError, match="nodes must be >= its depth"):
        SpecModel(2, (0.0, 0.0, 1.0), nodes=1)
    with pytest.raises(ValueError, match="draft_width"):
        SpecModel(2, (0.0, 0.0, 1.0), draft_width=0)
    tree = SpecModel.from_mean_accepted(4, 0.95, nodes=16)
    assert tree.nodes == 16 and tree.mean_accepted == pytest.approx(0.95, abs=1e-6)


@pytest.mark.slow  # one more compilation: the plain loop (~6 s, loaded 2-core box)
def test_nothing_accepted_costs_more_and_speculation_pays_when_accepted():
    rng = np.random.default_rng(0)
    arr = np.zeros(30)  # all at t = 0: the schedule does not depend on step times
    p, o = rng.integers(2, 20, 30), rng.integers(2, 30, 30)
    tr = make_trace(arr, p, o, pad_to=32)
    plain = simulate(POLICY, CFG, COST, tr)
    none_kept = simulate(POLICY, CFG, COST, tr, speculative=SpecModel.from_acceptance_rate(3, 0.0))
    good = simulate(POLICY, CFG, COST, tr, speculative=SpecModel.from_acceptance_rate(3, 0.8))
    fin = [np.asarray(x.finish_time)[:30] for x in (plain, none_kept, good)]
    assert all(np.isfinite(f).all() for f in fin)
    assert int(none_kept.steps) == int(plain.steps)
    # k = 0 through the speculative loop is the plain simulation, exactly.
    zero = simulate(POLICY, CFG, COST, tr, speculative=SpecModel.none())
    np.testing.assert_array_equal(np.asarray(zero.finish_time), np.asarray(plain.finish_time))
    assert int(zero.steps) == int(plain.steps)
    assert fin[1].mean() > fin[0].mean()  # verification work for nothing
    assert int(good.steps) < int(plain.steps)
    assert fin[2].mean() < fin[0].mean()


def test_spec_model_checks():
    m = SpecModel.from_acceptance_rate(2, 0.5)
    assert m.accepted_pmf == pytest.approx((0.5, 0.25, 0.25))
    assert m.mean_accepted == pytest.approx(0.75)
    with pytest.raises(ValueError, match="k \\+ 1"):
        SpecModel(2, (1.0,))
    with pytest.raises(ValueError, match="distribution"):
        SpecModel(1, (0.5, 0.6))
    with pytest.raises(ValueError, match="draft_cost_fraction"):
        SpecModel(1, (0.5, 0.5), draft_cost_fraction=-0.1)
    with pytest.raises(ValueError, match="mean_drafts"):
        SpecModel.from_mean_accepted(2, 2.5)
    assert SpecModel.none().params().log_pmf.shape == (MIN_PMF_WIDTH + 1,)


@pytest.mark.parametrize("k, mean", [(4, 2.67), (4, 1.0), (2, 0.36), (4, 0.0), (3, 3.0)])
def test_from_mean_accepted_reproduces_the_measured_mean(k, mean):
    """The engine reports accepted / proposed (``spec_acceptance_rate``); the
    first-rejection model at that same rate keeps fewer drafts on average, so a measured
    mean is matched by solving for the per-draft rate instead."""
    m = SpecModel.from_mean_accepted(k, mean)
    assert m.mean_accepted == pytest.approx(mean, abs=1e-6)
    if 0 < mean < k:
        assert SpecModel.from_acceptance_rate(k, mean / k).mean_accepted < mean


def test_speculation_refuses_a_per_sequence_host_cost():
    """vllm2023's per-sequence host cost would charge the verification's draft rows as
    sequences (they enter as logits rows), and 2023 vLLM did not speculate: refused."""
    from pagedjax.simulator.cost_model import calibrated

    tr = make_trace(np.array([1.0]), np.array([10]), np.array([9]), pad_to=32)
    with pytest.raises(ValueError, match="seq_overhead_s"):
        simulate(POLICY, CFG, calibrated("vllm2023", "A100-40GB", "opt-13b"), tr,
                 speculative=SpecModel(4, (0.0, 0.0, 0.0, 0.0, 1.0)))  # fmt: skip
