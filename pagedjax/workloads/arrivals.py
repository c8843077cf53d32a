"""Arrival processes: Poisson, gamma (burstiness), all-at-once (rate = inf).

Gaps are drawn as unit-rate variates divided by the rate, so one seed gives the same
underlying stream at every rate (common random numbers across a rate sweep). The first
request arrives at t = 0; request i arrives after i gaps (vLLM sends, then sleeps).
"""

from __future__ import annotations

import math

import numpy as np

PROCESSES = ("poisson", "gamma")
_CHUNK = 4096


def _check(rate: float, process: str, burstiness: float) -> None:
    if process not in PROCESSES:
        raise ValueError(f"process must be one of {PROCESSES}, got {process!r}")
    if not (rate > 0):  # also rejects NaN
        raise ValueError(f"rate must be > 0 requests/s (or inf), got {rate}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")


def interarrival_gaps(
    num: int,
    rate: float,
    rng: np.random.Generator | int,
    process: str = "poisson",
    burstiness: float = 1.0,
) -> np.ndarray:
    """float64[num] gaps in seconds, mean 1/rate.

    poisson: Exponential(mean 1/rate). gamma: Gamma(shape=burstiness,
    scale=1/(rate*burstiness)), coefficient of variation 1/sqrt(burstiness); burstiness 1
    is Poisson. rate = inf gives zeros.
    """
    _check(rate, process, burstiness)
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if math.isinf(rate):
        return np.zeros(num)
    rng = np.random.default_rng(rng)
    if process == "poisson":
        return rng.standard_exponential(num) / rate
    return rng.standard_gamma(burstiness, num) / (rate * burstiness)


def arrival_times(
    num: int,
    rate: float,
    rng: np.random.Generator | int,
    process: str = "poisson",
    burstiness: float = 1.0,
) -> np.ndarray:
    """float64[num] non-decreasing arrival times, the first at 0."""
    gaps = interarrival_gaps(max(num - 1, 0), rate, rng, process, burstiness)
    return np.concatenate([np.zeros(min(num, 1)), np.cumsum(gaps)])


def arrivals_until(
    duration_s: float,
    rate: float,
    rng: np.random.Generator | int,
    process: str = "poisson",
    burstiness: float = 1.0,
) -> np.ndarray:
    """float64[K] arrival times in [0, duration_s), the first at 0 (K ~ rate * duration_s)."""
    _check(rate, process, burstiness)
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s}")
    if math.isinf(rate):
        raise ValueError(
            "rate=inf with duration_s gives infinitely many requests; use num_requests"
        )
    rng = np.random.default_rng(rng)
    chunks = [np.zeros(1)]
    last = 0.0
    while last < duration_s:
        times = last + np.cumsum(interarrival_gaps(_CHUNK, rate, rng, process, burstiness))
        chunks.append(times)
        last = float(times[-1])
    times = np.concatenate(chunks)
    return times[times < duration_s]
