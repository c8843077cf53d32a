"""Loader for the Azure LLM inference trace 2023, conversation service (data/traces/)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pagedjax.workloads.record import Workload

DEFAULT_AZURE_CONV_PATH = (
    Path(__file__).resolve().parents[2] / "data" / "traces" / "azure_conv_2023.csv"
)
_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


def load_azure_conv(
    path: str | Path | None = None,
    *,
    start_s: float = 0.0,
    end_s: float | None = None,
    rate_scale: float = 1.0,
) -> Workload:
    """Reads the trace: arrival times (s) and prompt/output lengths per request.

    Args:
        path: the CSV (columns arrived_at, num_prefill_tokens, num_decode_tokens);
            default data/traces/azure_conv_2023.csv in this repository.
        start_s, end_s: keep requests with start_s <= arrived_at < end_s (trace seconds,
            before rate scaling); times are re-based so the window starts at 0.
        rate_scale: > 1 compresses time (arrivals / rate_scale), multiplying the rate
            while keeping the burst pattern.

    Returns:
        A Workload (source_len = the longest prompt + output in the window).
    """
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale must be a positive finite number, got {rate_scale}")
    if not (math.isfinite(start_s) and start_s >= 0):
        raise ValueError(f"start_s must be finite and >= 0, got {start_s}")
    if end_s is not None and not end_s > start_s:
        raise ValueError(f"end_s must be > start_s ({start_s}), got {end_s}")
    path = Path(DEFAULT_AZURE_CONV_PATH if path is None else path)
    if not path.is_file():
        raise ValueError(f"path: no trace file at {path}")
    with path.open() as f:
        header = f.readline().strip().split(",")
    missing = [c for c in _COLUMNS if c not in header]
    if missing:
        raise ValueError(f"path: {path} lacks columns {missing} (has {header})")
    cols = [header.index(c) for c in _COLUMNS]
    data = np.loadtxt(path, delimiter=",", skiprows=1, usecols=cols, ndmin=2)
    arrived, prompt, output = data[:, 0], data[:, 1], data[:, 2]
    order = np.argsort(arrived, kind="stable")  # the file is sorted; do not rely on it
    arrived, prompt, output = arrived[order], prompt[order], output[order]
    keep = arrived >= start_s
    if end_s is not None:
        keep &= arrived < end_s
    arrived, prompt, output = arrived[keep], prompt[keep], output[keep]
    source_len = int((prompt + output).max()) if len(prompt) else 1
    return Workload(
        (arrived - start_s) / rate_scale,
        prompt.astype(np.int32),
        output.astype(np.int32),
        source_len=source_len,
        name="azure_conv",
    )
