"""Tests for pagedjax.workloads: lengths, arrivals, loaders, builder."""

import json

import numpy as np
import pytest

from pagedjax.workloads import (
    Workload,
    arrival_times,
    arrivals_until,
    interarrival_gaps,
    load_azure_conv,
    load_sharegpt,
    make_workload,
    sample_lengths,
    valid_pairs,
)

PAPER_MEANS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}


@pytest.mark.parametrize("dataset", ["sharegpt", "alpaca"])
@pytest.mark.parametrize("spread_scale", [0.75, 1.0, 1.25])
def test_means_match_paper_and_rules_hold(dataset, spread_scale):
    prompt, output = sample_lengths(dataset, 20_000, seed_rng(7), spread_scale)
    assert prompt.shape == output.shape == (20_000,)
    assert prompt.dtype == output.dtype == np.int32
    mean_in, mean_out = PAPER_MEANS[dataset]
    assert abs(prompt.mean() / mean_in - 1) < 0.03
    assert abs(output.mean() / mean_out - 1) < 0.03
    assert valid_pairs(prompt, output).all()
    assert prompt.min() >= 4 and output.min() >= 4
    assert prompt.max() <= 1024 and (prompt + output).max() <= 2048


def seed_rng(seed):
    return np.random.default_rng(seed)


def test_spread_scale_widens_distribution():
    stds = [sample_lengths("sharegpt", 5_000, 1, s)[1].std() for s in (0.75, 1.0, 1.25)]
    assert stds[0] < stds[1] < stds[2]


def test_valid_pairs_boundaries():
    p = np.array([3, 4, 1024, 1025, 1000, 1000, 4])
    o = np.array([10, 4, 4, 4, 1048, 1049, 3])
    assert valid_pairs(p, o).tolist() == [False, True, True, False, True, False, False]


def test_lengths_deterministic_and_prefix_stable():
    a = sample_lengths("alpaca", 1000, 3)
    b = sample_lengths("alpaca", 1000, 3)
    c = sample_lengths("alpaca", 10_000, 3)
    d = sample_lengths("alpaca", 1000, 4)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[0], c[0][:1000])
    assert not np.array_equal(a[0], d[0])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="dataset"):
        sample_lengths("lmsys", 10, 0)
    with pytest.raises(ValueError, match="spread_scale"):
        sample_lengths("sharegpt", 10, 0, spread_scale=0.0)
    with pytest.raises(ValueError, match="rate"):
        arrival_times(10, 0.0, 0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(10, 1.0, 0, "gamma", burstiness=-1.0)
    with pytest.raises(ValueError, match="process"):
        arrival_times(10, 1.0, 0, "uniform")
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("sharegpt", 1.0, num_requests=10, duration_s=10.0)
    with pytest.raises(ValueError, match="trace"):
        make_workload("alpaca", 1.0, num_requests=10, arrival="trace")
    with pytest.raises(ValueError, match="non-decreasing"):
        Workload(np.array([1.0, 0.0]), np.array([5, 5]), np.array([5, 5]))


def test_poisson_gaps():
    gaps = interarrival_gaps(50_000, 4.0, 0)
    assert abs(gaps.mean() * 4.0 - 1) < 0.02
    assert abs(gaps.std() / gaps.mean() - 1) < 0.03  # exponential: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness(burstiness):
    gaps = interarrival_gaps(50_000, 2.0, 0, "gamma", burstiness)
    assert abs(gaps.mean() * 2.0 - 1) < 0.03
    # Gamma(k, 1/(rate k)): variance = 1 / (k rate^2), CV^2 = 1/k.
    cv2 = gaps.var() / gaps.mean() ** 2
    assert abs(cv2 * burstiness - 1) < 0.06


def test_arrivals_start_at_zero_and_scale_with_rate():
    t1 = arrival_times(100, 1.0, 5)
    t2 = arrival_times(100, 2.0, 5)
    assert t1[0] == 0.0 and np.all(np.diff(t1) > 0)
    np.testing.assert_allclose(t2, t1 / 2)  # common random numbers across rates
    np.testing.assert_array_equal(arrival_times(5, float("inf"), 0), np.zeros(5))
    t = arrivals_until(1000.0, 3.0, 0)
    assert t.max() < 1000.0 and abs(len(t) / 3000 - 1) < 0.06


def test_make_workload_synthetic():
    w = make_workload("sharegpt", 2.0, duration_s=600.0, seed=1)
    assert abs(len(w) / 1200 - 1) < 0.1 and w.arrival_time.max() < 600.0
    w2 = make_workload("sharegpt", 8.0, num_requests=len(w), seed=1)
    np.testing.assert_array_equal(w.prompt_len, w2.prompt_len)  # lengths independent of rate
    w3 = make_workload("alpaca", float("inf"), num_requests=50, seed=1, arrival="gamma")
    assert np.all(w3.arrival_time == 0) and w3.name == "alpaca"


def test_scale_to_context():
    w = make_workload("sharegpt", 1.0, num_requests=2000, seed=2)
    s = w.scale_to_context(256)
    assert s.source_len == 256
    assert s.prompt_len.min() >= 1 and s.output_len.min() >= 1
    assert s.total_len.max() <= 256
    ratio = s.total_len.mean() / w.total_len.mean()
    assert abs(ratio / (256 / 2048) - 1) < 0.02
    with pytest.raises(ValueError, match="max_len"):
        w.scale_to_context(1)


def test_azure_trace_loader():
    w = load_azure_conv()
    assert len(w) == 19_366
    assert w.arrival_time[0] == 0.0 and np.all(np.diff(w.arrival_time) >= 0)
    assert abs(w.prompt_len.mean() - 1155) < 1 and abs(w.output_len.mean() - 211) < 1
    win = load_azure_conv(start_s=600.0, end_s=1200.0, rate_scale=2.0)
    assert 0 < len(win) < len(w) and win.arrival_time.max() < 300.0
    with pytest.raises(ValueError, match="rate_scale"):
        load_azure_conv(rate_scale=0)


def test_azure_replay_rate_and_synthetic_arrivals():
    w = make_workload("azure_conv", 11.0, arrival="trace", duration_s=600.0)
    assert abs(len(w) / (11.0 * 600) - 1) < 0.15  # trace rate varies over the hour
    full = load_azure_conv()
    np.testing.assert_array_equal(w.prompt_len, full.prompt_len[: len(w)])
    p = make_workload("azure_conv", 3.0, num_requests=500, arrival="poisson", seed=0)
    assert len(p) == 500 and p.arrival_time[0] == 0.0


def _write_sharegpt(path):
    # Tokenizer = whitespace split, so lengths are word counts.
    words = lambda n: " ".join(["w"] * n)
    convs = [
        {
            "conversations": [
                {"from": "human", "value": words(10)},
                {"from": "gpt", "value": words(20)},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": words(3)},
                {"from": "gpt", "value": words(20)},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": words(10)},
                {"from": "gpt", "value": words(3)},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": words(1025)},
                {"from": "gpt", "value": words(5)},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": words(1000)},
                {"from": "gpt", "value": words(1049)},
            ]
        },
        {"conversations": [{"from": "human", "value": words(50)}]},
        {
            "conversations": [
                {"from": "human", "value": words(1024)},
                {"from": "gpt", "value": words(1024)},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": words(4)},
                {"from": "gpt", "value": words(4)},
                {"from": "human", "value": words(99)},
            ]
        },
    ]
    path.write_text(json.dumps(convs))


def test_sharegpt_loader_rules(tmp_path):
    path = tmp_path / "sharegpt.json"
    _write_sharegpt(path)
    tok = lambda s: [len(w) for w in s.split()]
    sample = load_sharegpt(path, tok, 3, seed=0)
    pairs = sorted(zip(sample.prompt_len.tolist(), sample.output_len.tolist(), strict=True))
    assert pairs == [(4, 4), (10, 20), (1024, 1024)]
    assert [len(t) for t in sample.prompt_token_ids] == sample.prompt_len.tolist()
    assert all(len(p.split()) == n for p, n in zip(sample.prompts, sample.prompt_len, strict=True))
    # Seeded shuffle: order differs between some seeds, but is reproducible.
    orders = {tuple(load_sharegpt(path, tok, 3, seed=s).prompt_len) for s in range(6)}
    assert len(orders) > 1
    np.testing.assert_array_equal(
        load_sharegpt(path, tok, 2, seed=3).prompt_len,
        load_sharegpt(path, tok, 2, seed=3).prompt_len,
    )
    assert len(sample.to_workload()) == 3
    with pytest.raises(ValueError, match="num_requests"):
        load_sharegpt(path, tok, 4)


def test_sharegpt_loader_rejects_malformed(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human"}, {"from": "gpt"}]}]))
    with pytest.raises(ValueError, match="value"):
        load_sharegpt(path, str.split, 1)
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="list"):
        load_sharegpt(path, str.split, 1)
