"""Multi-LoRA traffic: requests that each name an adapter, drawn from a Zipf-like popularity.

S-LoRA's synthetic workload (Sheng et al., MLSys 2024; github.com/S-LoRA/S-LoRA,
benchmarks/exp_suite.py): ``num_adapters`` adapters whose request rates follow a power
law of exponent ``alpha`` (adapter i, counted from 1, gets a share proportional to
i ** -alpha: Zipf), Poisson arrivals of a total ``rate`` (cv 1), prompt and output lengths
uniform on ``input_range`` / ``output_range`` ([8, 512] in every S-LoRA run). Each request
draws its adapter independently from the popularity (the superposition of the per-adapter
Poisson processes is the same process).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedjax.workloads.arrivals import arrival_times
from pagedjax.workloads.record import Workload


def zipf_popularity(num_adapters: int, alpha: float) -> np.ndarray:
    """float64[num_adapters]: adapter i's share of requests, proportional to (i + 1) ** -alpha
    (sums to 1). alpha 0 is uniform. ValueError for num_adapters < 1 or alpha < 0."""
    if num_adapters < 1:
        raise ValueError(f"num_adapters must be >= 1, got {num_adapters}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    w = np.arange(1, num_adapters + 1, dtype=np.float64) ** -float(alpha)
    return w / w.sum()


@dataclass(frozen=True, eq=False)
class AdapterWorkload:
    """A Workload plus each request's adapter: int64[N] in [0, num_adapters), or -1 for a
    base-model request (num_adapters 0)."""

    requests: Workload
    adapter: np.ndarray
    num_adapters: int

    def __post_init__(self) -> None:
        a = np.asarray(self.adapter, np.int64)
        if a.shape != (len(self.requests),):
            raise ValueError(f"adapter must be [{len(self.requests)}], got shape {a.shape}")
        if len(a) and (a.min() < -1 or a.max() >= max(self.num_adapters, 0)):
            if not (self.num_adapters == 0 and np.all(a == -1)):
                raise ValueError(f"adapter ids must be in [-1, {self.num_adapters})")
        object.__setattr__(self, "adapter", a)

    def __len__(self) -> int:
        return len(self.requests)


def slora_workload(
    num_requests: int,
    rate: float,
    num_adapters: int,
    alpha: float = 1.0,
    input_range: tuple[int, int] = (8, 512),
    output_range: tuple[int, int] = (8, 512),
    seed: int = 0,
) -> AdapterWorkload:
    """S-LoRA's synthetic trace (module docstring): ``num_requests`` requests at ``rate``
    req/s (inf: all at t = 0), adapters Zipf(alpha) over ``num_adapters`` (0: every request
    is a base-model request, adapter -1), lengths uniform on the closed ranges. The lengths
    and arrivals do not depend on ``num_adapters`` (separate streams of one seed), so runs
    with different adapter counts serve the same requests."""
    for name, (lo, hi) in (("input_range", input_range), ("output_range", output_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be 1 <= lo <= hi, got {(lo, hi)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    root = np.random.SeedSequence(seed)
    s_len, s_arr, s_ad = (np.random.default_rng(s) for s in root.spawn(3))
    prompt = s_len.integers(input_range[0], input_range[1] + 1, num_requests)
    output = s_len.integers(output_range[0], output_range[1] + 1, num_requests)
    arrival = arrival_times(num_requests, rate, s_arr)
    if num_adapters == 0:
        adapter = np.full(num_requests, -1, np.int64)
    else:
        adapter = s_ad.choice(num_adapters, num_requests, p=zipf_popularity(num_adapters, alpha))
    w = Workload(arrival, prompt, output, name=f"slora-{num_adapters}a")
    return AdapterWorkload(w, adapter, num_adapters)
