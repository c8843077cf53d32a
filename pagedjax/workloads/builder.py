"""make_workload: dataset lengths + an arrival process -> Workload."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pagedjax.workloads.arrivals import PROCESSES, arrival_times, arrivals_until
from pagedjax.workloads.azure import load_azure_conv
from pagedjax.workloads.lengths import LENGTH_SPECS, MAX_TOTAL_LEN, sample_lengths
from pagedjax.workloads.record import Workload

DATASETS = (*LENGTH_SPECS, "azure_conv")
ARRIVALS = (*PROCESSES, "trace")


def make_workload(
    dataset: str,
    rate: float,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    spread_scale: float = 1.0,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    trace_path: str | Path | None = None,
) -> Workload:
    """Builds a workload.

    Args:
        dataset: "sharegpt" | "alpaca" (synthetic lengths, docs/workloads.md) or
            "azure_conv" (the trace's lengths, in trace order).
        rate: mean requests/s; inf sends everything at t = 0. For a trace replay, a finite
            rate rescales the trace's time axis to that mean rate; inf keeps it as recorded.
        num_requests, duration_s: how many requests / keep arrivals in [0, duration_s).
            Synthetic datasets need exactly one; the trace takes either, both (the first
            num_requests inside the window) or neither (the whole trace).
        seed: lengths and arrivals come from independent streams of this seed, so the same
            seed gives the same lengths at every rate.
        spread_scale: multiplies the lognormal sigmas (synthetic datasets only).
        arrival: "poisson" | "gamma" | "trace" (trace replay, "azure_conv" only).
        burstiness: gamma shape (1 = Poisson; < 1 burstier).
        trace_path: CSV for "azure_conv" (default: data/traces/azure_conv_2023.csv).
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (or inf), got {rate}")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s}")
    len_seed, arr_seed = np.random.SeedSequence(seed).spawn(2)
    len_rng, arr_rng = np.random.default_rng(len_seed), np.random.default_rng(arr_seed)

    if dataset == "azure_conv":
        trace = load_azure_conv(trace_path)
        if arrival == "trace":
            if math.isfinite(rate) and len(trace) > 1:
                native_rate = (len(trace) - 1) / trace.duration_s
                trace = trace.with_arrivals(trace.arrival_time * native_rate / rate)
            if duration_s is not None:
                trace = trace.head(int(np.searchsorted(trace.arrival_time, duration_s)))
            if num_requests is not None:
                if num_requests > len(trace):
                    raise ValueError(
                        f"num_requests={num_requests} exceeds the {len(trace)} trace requests"
                    )
                trace = trace.head(num_requests)
            return trace
        times = _synthetic_arrivals(num_requests, duration_s, rate, arr_rng, arrival, burstiness)
        if len(times) > len(trace):
            raise ValueError(
                f"{len(times)} requests asked but the trace has {len(trace)}; lower "
                "num_requests, duration_s or rate"
            )
        return trace.head(len(times)).with_arrivals(times)

    if arrival == "trace":
        raise ValueError(f"arrival='trace' needs dataset='azure_conv', got {dataset!r}")
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    times = _synthetic_arrivals(num_requests, duration_s, rate, arr_rng, arrival, burstiness)
    prompt, output = sample_lengths(dataset, len(times), len_rng, spread_scale)
    return Workload(times, prompt, output, source_len=MAX_TOTAL_LEN, name=dataset)


def _synthetic_arrivals(
    num_requests: int | None,
    duration_s: float | None,
    rate: float,
    rng: np.random.Generator,
    process: str,
    burstiness: float,
) -> np.ndarray:
    if duration_s is not None:
        times = arrivals_until(duration_s, rate, rng, process, burstiness)
        return times if num_requests is None else times[:num_requests]
    if num_requests is None:
        raise ValueError("give num_requests or duration_s")
    return arrival_times(num_requests, rate, rng, process, burstiness)
