"""The workload record: one row per request (arrival time, prompt length, output length)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Workload:
    """A batch of requests as parallel arrays, sorted by arrival time.

    Attributes:
        arrival_time: float64[N], seconds from the start of the workload, non-decreasing.
        prompt_len: int32[N], prompt tokens per request (>= 1).
        output_len: int32[N], tokens to generate per request (>= 1; sent with ignore_eos).
        source_len: the context length the lengths were drawn for (2048 for the paper's
            datasets); `scale_to_context` scales relative to it.
        name: a label for tables and plots.
    """

    arrival_time: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    source_len: int = 2048
    name: str = ""

    def __post_init__(self) -> None:
        arrival = np.asarray(self.arrival_time, dtype=np.float64)
        prompt = np.asarray(self.prompt_len)
        output = np.asarray(self.output_len)
        for label, arr in (
            ("arrival_time", arrival),
            ("prompt_len", prompt),
            ("output_len", output),
        ):
            if arr.ndim != 1:
                raise ValueError(f"{label} must be 1-D, got shape {arr.shape}")
        if not (len(arrival) == len(prompt) == len(output)):
            raise ValueError(
                "arrival_time, prompt_len and output_len must have equal lengths, got "
                f"{len(arrival)}, {len(prompt)}, {len(output)}"
            )
        if len(arrival) and (not np.all(np.isfinite(arrival)) or arrival.min() < 0):
            raise ValueError("arrival_time must be finite and >= 0")
        if np.any(np.diff(arrival) < 0):
            raise ValueError("arrival_time must be non-decreasing")
        if len(prompt) and (prompt.min() < 1 or output.min() < 1):
            raise ValueError("prompt_len and output_len must be >= 1")
        if self.source_len < 1:
            raise ValueError(f"source_len must be >= 1, got {self.source_len}")
        object.__setattr__(self, "arrival_time", arrival)
        object.__setattr__(self, "prompt_len", prompt.astype(np.int32))
        object.__setattr__(self, "output_len", output.astype(np.int32))

    def __len__(self) -> int:
        return len(self.arrival_time)

    @property
    def total_len(self) -> np.ndarray:
        """int32[N]: prompt + output tokens per request."""
        return self.prompt_len + self.output_len

    @property
    def duration_s(self) -> float:
        """Time of the last arrival (0 for an empty or all-at-once workload)."""
        return float(self.arrival_time[-1]) if len(self) else 0.0

    def scale_to_context(self, max_len: int, source_len: int | None = None) -> Workload:
        """Scales lengths from `source_len` (default `self.source_len`) to `max_len`.

        Each length is multiplied by max_len / source_len and rounded; both stay >= 1 and
        the output is trimmed so that prompt + output <= max_len (the prompt is first
        capped at max_len - 1). Arrival times are unchanged.
        """
        if max_len < 2:
            raise ValueError(
                f"max_len must be >= 2 (one prompt and one output token), got {max_len}"
            )
        src = self.source_len if source_len is None else source_len
        if src < 1:
            raise ValueError(f"source_len must be >= 1, got {src}")
        factor = max_len / src
        prompt = np.clip(np.rint(self.prompt_len * factor), 1, max_len - 1).astype(np.int32)
        output = np.rint(self.output_len * factor).astype(np.int64)
        output = np.clip(output, 1, max_len - prompt).astype(np.int32)
        return Workload(self.arrival_time, prompt, output, source_len=max_len, name=self.name)

    def with_arrivals(self, arrival_time: np.ndarray) -> Workload:
        """Returns the same requests with new arrival times (float64[N], non-decreasing)."""
        return Workload(
            arrival_time,
            self.prompt_len,
            self.output_len,
            source_len=self.source_len,
            name=self.name,
        )

    def head(self, num_requests: int) -> Workload:
        """The first `num_requests` requests."""
        if num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {num_requests}")
        return Workload(
            self.arrival_time[:num_requests],
            self.prompt_len[:num_requests],
            self.output_len[:num_requests],
            source_len=self.source_len,
            name=self.name,
        )
