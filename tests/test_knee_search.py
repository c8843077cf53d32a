"""Knee search (bracketing + bisection) on synthetic inputs (claims: test_claims.py)."""

import math

import pytest

from experiments.knee_search import find_knees, ratio_text


def curve(knee_rate: float):
    """A monotone latency curve crossing 0.5 s/token at knee_rate (0.25 * (r / k)^3 + 0.25)."""
    calls: list[list[float]] = []

    def probe(rates):
        calls.append(list(rates))
        return [0.25 + 0.25 * (r / knee_rate) ** 3 for r in rates]

    return probe, calls


def true_knee(knee_rate: float, th: float) -> float:
    return knee_rate * ((th - 0.25) / 0.25) ** (1 / 3) if th > 0.25 else 0.0


@pytest.mark.parametrize("knee_rate", [0.3, 1.0, 3.7, 11.0])
def test_knees_are_bracketed_to_the_resolution(knee_rate):
    probe, calls = curve(knee_rate)
    found = find_knees(
        probe, [0.5, 1.0], start=2.0, rate_min=0.0625, rate_max=64.0, resolution=0.03
    )
    for th, k in found.knees.items():
        assert k.bracketed, k
        assert k.hi / k.lo <= 1.03 + 1e-9
        assert k.lo <= true_knee(knee_rate, th) < k.hi  # the true crossing is inside
        assert k.rate == k.lo and k.text() == f"{k.lo:.3g}"
    rates = [r for c in calls for r in c]
    assert len(rates) == len(set(rates))  # never probes a rate twice
    assert len(rates) <= 20
    # Both thresholds propose in the same round once bracketed: batched probe calls.
    assert max(len(c) for c in calls) == 2


def test_unbracketed_knees_are_bounds_never_ratios():
    probe, _ = curve(1000.0)  # never exceeds 0.5 below rate_max
    high = find_knees(probe, [0.5], start=2.0, rate_min=0.5, rate_max=16.0).knees[0.5]
    assert high.bound == ">=" and high.lo == 16.0 and high.rate is None
    assert high.text() == ">= 16"
    probe, _ = curve(0.01)  # exceeds 0.5 everywhere above rate_min
    low = find_knees(probe, [0.5], start=2.0, rate_min=0.5, rate_max=16.0).knees[0.5]
    assert low.bound == "<" and low.hi == 0.5 and low.rate is None
    probe, _ = curve(2.0)
    mid = find_knees(probe, [0.5], start=2.0, rate_min=0.5, rate_max=16.0).knees[0.5]
    assert ratio_text(mid, mid)[0] == pytest.approx(1.0)
    r, text = ratio_text(high, mid)  # numerator a lower bound: the ratio is one too
    assert r is None and text == f">= {16.0 / mid.hi:.2f}"
    r, text = ratio_text(mid, low)
    assert r is None and text.startswith(">= ")
    assert ratio_text(low, high) == (None, f"< {0.5 / 16.0:.2f}")


def test_search_rejects_bad_arguments():
    probe, _ = curve(1.0)
    with pytest.raises(ValueError, match="rate_min"):
        find_knees(probe, [0.5], start=0.1, rate_min=0.5, rate_max=4.0)
    with pytest.raises(ValueError, match="thresholds"):
        find_knees(probe, [], start=1.0, rate_min=0.5, rate_max=4.0)


def test_nan_latency_counts_as_exceeded():
    def probe(rates):
        return [math.nan if r > 3 else 0.1 for r in rates]

    k = find_knees(probe, [0.5], start=1.0, rate_min=0.5, rate_max=64.0).knees[0.5]
    assert k.bracketed and k.lo <= 3 < k.hi


def test_knee_rate_needs_the_search_configured():
    from experiments.config import ExperimentConfig
    from pagedjax.config import ConfigError, load_dataclass

    ok = load_dataclass(
        ExperimentConfig,
        {"memory_waste": {"rate": "knee"}, "throughput_vs_rate": {"search": {"start": 1.0}}},
    )
    assert ok.memory_waste.rate == "knee" and ok.throughput_vs_rate.search.resolution == 0.03
    with pytest.raises(ConfigError, match="throughput_vs_rate.search"):
        load_dataclass(ExperimentConfig, {"memory_waste": {"rate": "knee"}})
    with pytest.raises(ConfigError, match="memory_waste.rate"):
        load_dataclass(ExperimentConfig, {"memory_waste": {"rate": "fast"}})
    with pytest.raises(ConfigError, match="stop_latency"):
        load_dataclass(
            ExperimentConfig,
            {"throughput_vs_rate": {"search": {"start": 1.0, "stop_latency": 0.9}}},
        )
    with pytest.raises(ConfigError, match="held_out"):
        load_dataclass(ExperimentConfig, {"simulator_validation": {"held_out": ["sharegpt"]}})
