"""Loaders for Azure-format request traces: the bundled conversation trace (data/traces/)
and any CSV with the Azure LLM inference trace's columns.

Two spellings of the columns are read: vidur's (``arrived_at`` in seconds,
``num_prefill_tokens``, ``num_decode_tokens``; the bundled file) and the public Azure
dataset's (``TIMESTAMP`` as a date-time such as ``2023-11-16 18:15:46.6805900`` or as
seconds, ``ContextTokens``, ``GeneratedTokens``). Date-times become seconds since the
earliest request.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pagedjax.workloads.record import Workload

DEFAULT_AZURE_CONV_PATH = (
    Path(__file__).resolve().parents[2] / "data" / "traces" / "azure_conv_2023.csv"
)
_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def load_azure_conv(
    path: str | Path | None = None,
    *,
    start_s: float = 0.0,
    end_s: float | None = None,
    rate_scale: float = 1.0,
) -> Workload:
    """The conversation trace (default data/traces/azure_conv_2023.csv in this
    repository) as a Workload named "azure_conv"; arguments as ``load_trace``."""
    path = DEFAULT_AZURE_CONV_PATH if path is None else path
    return load_trace(path, start_s=start_s, end_s=end_s, rate_scale=rate_scale,
                      name="azure_conv")  # fmt: skip


def load_trace(
    path: str | Path,
    *,
    start_s: float = 0.0,
    end_s: float | None = None,
    rate_scale: float = 1.0,
    name: str | None = None,
) -> Workload:
    """Reads an Azure-format trace: arrival times (s) and prompt/output lengths per request.

    Args:
        path: a CSV with vidur's columns (arrived_at, num_prefill_tokens,
            num_decode_tokens) or the Azure dataset's (TIMESTAMP, ContextTokens,
            GeneratedTokens); other columns are ignored.
        start_s, end_s: keep requests with start_s <= arrival < end_s (trace seconds,
            before rate scaling); times are re-based so the window starts at 0.
        rate_scale: > 1 compresses time (arrivals / rate_scale), multiplying the rate
            while keeping the burst pattern.
        name: the Workload's name (default: the file's stem).

    Returns:
        A Workload (source_len = the longest prompt + output in the window). Raises
        ValueError (naming the argument) for a missing file, missing columns or bad values.
    """
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale must be a positive finite number, got {rate_scale}")
    if not (math.isfinite(start_s) and start_s >= 0):
        raise ValueError(f"start_s must be finite and >= 0, got {start_s}")
    if end_s is not None and not end_s > start_s:
        raise ValueError(f"end_s must be > start_s ({start_s}), got {end_s}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: no trace file at {path}")
    arrived, prompt, output = _read_columns(path)
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
        name=path.stem if name is None else name,
    )


def _read_columns(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival seconds, prompt lengths, output lengths) as float64 arrays."""
    with path.open() as f:
        header = [c.strip() for c in f.readline().strip().split(",")]
    for names in (_COLUMNS, AZURE_COLUMNS):
        if all(c in header for c in names):
            break
    else:
        raise ValueError(
            f"path: {path} lacks the columns {list(_COLUMNS)} or {list(AZURE_COLUMNS)}"
            f" (has {header})"
        )
    cols = [header.index(c) for c in names]
    if names == _COLUMNS:
        data = np.loadtxt(path, delimiter=",", skiprows=1, usecols=cols, ndmin=2)
        return data[:, 0], data[:, 1], data[:, 2]
    raw = np.loadtxt(path, delimiter=",", skiprows=1, usecols=cols, ndmin=2, dtype=str)
    lens = raw[:, 1:].astype(np.float64)
    try:
        arrived = raw[:, 0].astype(np.float64)
    except ValueError:  # date-times: seconds since the earliest request
        stamps = raw[:, 0].astype("datetime64[ns]")
        arrived = (stamps - stamps.min()).astype(np.float64) / 1e9
    return arrived, lens[:, 0], lens[:, 1]
