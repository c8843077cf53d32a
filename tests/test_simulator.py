"""The simulated executor: a whole trace in one while_loop (pagedjax/simulator/simulate.py)."""

import numpy as np
import pytest

from pagedjax.scheduler import SchedulerLimits
from pagedjax.scheduler.counting_policy import CountingPolicy
from pagedjax.simulator.cost_model import FittedCostModel
from pagedjax.simulator.simulate import (
    make_trace,
    simulate,
    simulate_many,
    simulate_recorded,
    stack_traces,
)

# 10 ms per step + 1 ms per prefill token: easy to reason about by hand.
COST = FittedCostModel((0.01, 0.001, 0.0, 0.0, 0.0))
N = 16
POLICY = CountingPolicy(N, 160)  # one policy and shape: one compilation per test file


def _cfg(**kw):
    return SchedulerLimits(
        max_seqs=N, max_num_batched_tokens=256, max_num_seqs=N, max_model_len=64, mode="paper", **kw
    )


def test_single_request_timing_by_hand():
    tr = make_trace(np.array([1.0]), np.array([10]), np.array([5]), pad_to=32)
    r = simulate(POLICY, _cfg(), COST, tr)
    # idle until t=1, prefill step 0.01 + 10*0.001, then 4 decode steps of 0.01.
    assert float(r.first_token_time[0]) == pytest.approx(1.02, abs=1e-5)
    assert float(r.finish_time[0]) == pytest.approx(1.06, abs=1e-5)
    assert int(r.steps) == 5
    assert np.isinf(np.asarray(r.finish_time[1:])).all()


def test_wake_cost_is_charged_once_per_idle_gap():
    """wake_s lands on the first step after the clock jumped over an idle gap: request
    0 arrives to an idle executor (woken), request 1 arrives while 0 runs (not woken),
    request 2 after both finished (woken again)."""
    wake = FittedCostModel((0.01, 0.001, 0.0, 0.0, 0.0), wake_s=0.5)
    tr = make_trace(np.array([1.0, 1.015, 5.0]), np.array([10, 10, 10]), np.array([3, 3, 3]), 32)
    plain, woken = simulate(POLICY, _cfg(), COST, tr), simulate(POLICY, _cfg(), wake, tr)
    shift = np.asarray(woken.finish_time)[:3] - np.asarray(plain.finish_time)[:3]
    # Request 1's prefill joins after the woken step, so its finish moves by one wake.
    np.testing.assert_allclose(shift, [0.5, 0.5, 0.5], atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(woken.first_token_time)[2] - 5.0, 0.5 + 0.02, atol=1e-5
    )  # the third request pays one wake (its own), not two
    assert int(woken.steps) == int(plain.steps)


def test_all_finish_and_usage_covers_the_pool():
    rng = np.random.default_rng(0)
    arr = np.sort(rng.uniform(0, 2, 30))
    p, o = rng.integers(2, 20, 30), rng.integers(2, 30, 30)
    r = simulate(POLICY, _cfg(), COST, make_trace(arr, p, o, pad_to=32))
    fin = np.asarray(r.finish_time)[:30]
    assert np.isfinite(fin).all() and (fin > arr).all()
    # 160 slots in units of 16 = 10 units; each sequence holds >= 1 unit.
    assert 0 < float(r.win_batched) <= 10.0 + 1e-6
    assert np.asarray(r.win_usage).sum() == pytest.approx(160, rel=1e-4)


def test_vmap_matches_single_runs():
    rng = np.random.default_rng(1)
    traces = []
    for rate in (5.0, 20.0):
        arr = np.cumsum(rng.exponential(1 / rate, 24))
        traces.append(make_trace(arr, rng.integers(2, 20, 24), rng.integers(2, 20, 24), 32))
    pol = POLICY
    many = simulate_many(pol, _cfg(), COST, stack_traces(traces))
    for i, t in enumerate(traces):
        one = simulate(pol, _cfg(), COST, t)
        np.testing.assert_allclose(np.asarray(many.finish_time[i]), np.asarray(one.finish_time))


def test_recorded_steps_sum_to_the_busy_time():
    # All requests at t = 0: the recorded cost-model inputs give the busy time exactly.
    rng = np.random.default_rng(2)
    tr = make_trace(np.zeros(20), rng.integers(2, 20, 20), rng.integers(2, 30, 20), pad_to=32)
    res, rec = simulate_recorded(POLICY, _cfg(), COST, tr, record=512)
    rec = np.asarray(rec)[: int(res.steps)]
    assert np.asarray(rec)[int(res.steps) :].sum() == 0
    total = float(np.sum(np.asarray(COST(*rec.T))))
    assert total == pytest.approx(float(res.busy_time), rel=1e-5)


def test_seq_overhead_is_charged_per_sequence_and_held_fixed_by_the_fit():
    from pagedjax.simulator.calibrate import fit
    from pagedjax.simulator.cost_model import roofline

    kw = dict(mem_efficiency=0.6, flop_efficiency=0.5, step_overhead_s=0.01)
    base = roofline("A100-40GB", "opt-13b", **kw)
    true = roofline("A100-40GB", "opt-13b", seq_overhead_s=1e-4, **kw)
    # 7 decode rows + 2 prompts in the step: 9 sequences' host work
    assert float(true(100, 7, 5000, 0, 2) - base(100, 7, 5000, 0, 2)) == pytest.approx(9e-4)
    rng = np.random.default_rng(4)
    dec = rng.integers(1, 30, 200).astype(float)
    pre = np.where(rng.random(200) < 0.2, 800.0, 0.0)
    rec = np.stack([pre, dec, dec * 600, pre * 256, (pre > 0).astype(float)], axis=1)
    anchor = {32: 1e5 / float(np.sum(np.asarray(true(*rec.T), np.float64)))}
    one = dict(mem_grid=np.array([0.6]), flop_grid=np.array([0.5]))
    cal = fit({32: (rec, 100_000)}, anchor, seq_overhead_s=1e-4, **one)
    assert cal.step_overhead_s == pytest.approx(0.01, rel=1e-3)
    assert cal.seq_overhead_s == 1e-4
    # without the per-sequence term the fit must put it into the per-step constant
    assert fit({32: (rec, 100_000)}, anchor, **one).step_overhead_s > 0.0105


def test_calibration_fit_reproduces_anchors_of_a_known_roofline():
    from pagedjax.simulator.calibrate import fit
    from pagedjax.simulator.cost_model import roofline

    rng = np.random.default_rng(3)
    true = roofline("A100-40GB", "opt-13b", mem_efficiency=0.6, flop_efficiency=0.5,
                    step_overhead_s=0.01)  # fmt: skip
    records, anchor = {}, {}
    for cap, n in ((32, 50), (512, 400)):
        dec = rng.integers(1, 30, n).astype(float)
        pre = np.where(rng.random(n) < 0.2, rng.integers(500, 4000, n), 0).astype(float)
        rec = np.stack([pre, dec, dec * 600, pre * 256, (pre > 0).astype(float)], axis=1)
        tokens = 100_000
        records[cap] = (rec, tokens)
        anchor[cap] = tokens / float(np.sum(np.asarray(true(*rec.T), np.float64)))
    cal = fit(records, anchor)
    assert cal.rms_rel_error < 0.01
    for cap in records:
        assert cal.predicted_tok_s[cap] == pytest.approx(anchor[cap], rel=0.01)


def _mean_norm_latency(r, arr, out):
    """Mean normalized latency, unfinished requests at their wait so far (>= 0)."""
    n = len(arr)
    fin = np.asarray(r.finish_time)[:n].astype(np.float64)
    end = np.maximum(np.where(np.isfinite(fin), fin, float(r.clock)), arr)
    return float(np.mean((end - arr) / out))


def test_early_stop_bound_is_a_lower_bound_and_stops_the_run():
    # Overloaded: 30 requests in 0.3 s, each needing ~10-40 steps of >= 10 ms.
    rng = np.random.default_rng(4)
    arr = np.sort(rng.uniform(0, 0.3, 30))
    p, o = rng.integers(2, 20, 30), rng.integers(10, 40, 30)
    full = simulate(POLICY, _cfg(), COST, make_trace(arr, p, o, pad_to=32))
    lat = _mean_norm_latency(full, arr, o)
    assert np.isfinite(np.asarray(full.finish_time)[:30]).all()
    assert float(full.latency_bound) == pytest.approx(lat, rel=1e-4)  # exact when done
    stop = lat / 2
    early = simulate(POLICY, _cfg(), COST, make_trace(arr, p, o, 32, stop_latency=stop))
    assert float(early.latency_bound) > stop
    assert int(early.steps) < int(full.steps) and float(early.clock) < float(full.clock)
    # The bound is what the metric reads off the stopped run, and below the true mean.
    got = _mean_norm_latency(early, arr, o)
    assert got == pytest.approx(float(early.latency_bound), rel=1e-3)
    assert stop < got <= lat
    same = simulate(POLICY, _cfg(), COST, make_trace(arr, p, o, 32, stop_latency=2 * lat))
    np.testing.assert_array_equal(np.asarray(same.finish_time), np.asarray(full.finish_time))
