"""Serving timings of requests: what the engine thread reports to a ``StatsSink``.

``AsyncLLMEngine``'s thread keeps a ``Tracked`` per request in flight and calls
``observe`` with each output (time to first token, inter-token latency, and at the
finish the request's ``FinishedRequestStats``) and ``observe_abort`` for a request that
ends without finishing (aborted, failed). The sink (the server's ``ServerMetrics``) turns
them into Prometheus metrics; keep it cheap, it runs between steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from pagedjax.engine.outputs import RequestOutput


@dataclass
class FinishedRequestStats:
    """Timings of one finished (or aborted) request, in seconds on the monotonic clock.

    queue_time: arrival -> first scheduler slot (None if it never got one).
    ttft: arrival -> first output token read back (None without a token).
    e2e: arrival -> finish. tpot: (finish - first token) / (generated tokens - 1) of
    sample 0 (None with fewer than two tokens), vLLM's time per output token.
    finish_reason: sample 0's ("stop", "length") or "abort".
    """

    request_id: str
    prompt_tokens: int
    generation_tokens: int
    queue_time: float | None
    ttft: float | None
    e2e: float
    tpot: float | None
    finish_reason: str


class StatsSink(Protocol):
    """Receives timings from the engine thread (keep it cheap: it runs between steps)."""

    def on_first_token(self, ttft: float) -> None: ...

    def on_inter_token(self, seconds: float, count: int) -> None: ...

    def on_finished(self, stats: FinishedRequestStats) -> None: ...


@dataclass
class Tracked:
    """Engine-thread bookkeeping of one request in flight."""

    stream: Any  # async_engine._Stream
    arrival: float
    generated: int = 0  # output tokens over all samples, so far
    prompt_tokens: int = 0  # known from the first output on
    first_token: float | None = None
    last_token: float | None = None


def observe_abort(stats: StatsSink | None, rid: str, tracked: Tracked) -> None:
    """Report an aborted (or failed) request's timings, finish reason "abort"."""
    if stats is not None:
        now = time.monotonic()
        ttft = _since(tracked.first_token, tracked)
        stats.on_finished(
            FinishedRequestStats(
                rid, tracked.prompt_tokens, tracked.generated, None, ttft,
                now - tracked.arrival, None, "abort",
            )
        )  # fmt: skip


def observe(stats: StatsSink, tracked: Tracked, out: RequestOutput, now: float) -> None:
    """Report one output's timings (first token, inter-token, the finish)."""
    total = sum(len(c.token_ids) for c in out.outputs)
    tracked.prompt_tokens = len(out.prompt_token_ids)
    new = total - tracked.generated
    if new > 0:
        if tracked.first_token is None:
            tracked.first_token = now
            stats.on_first_token(now - tracked.arrival)
            if new > 1:
                stats.on_inter_token(0.0, new - 1)  # n > 1 samples of the same step
        else:
            stats.on_inter_token((now - tracked.last_token) / new, new)
        tracked.last_token = now
        tracked.generated = total
    if out.finished:
        first = out.outputs[0] if out.outputs else None
        m = out.metrics
        queue_time = (
            m.first_scheduled_time - tracked.arrival
            if m is not None and m.first_scheduled_time is not None
            else None
        )
        n0 = len(first.token_ids) if first is not None else 0
        tpot = (
            (now - tracked.first_token) / (n0 - 1)
            if tracked.first_token is not None and n0 > 1
            else None
        )
        stats.on_finished(
            FinishedRequestStats(
                out.request_id,
                len(out.prompt_token_ids),
                total,
                max(queue_time, 0.0) if queue_time is not None else None,
                _since(tracked.first_token, tracked),
                now - tracked.arrival,
                tpot,
                (first.finish_reason if first is not None else None) or "stop",
            )
        )


def _since(t: float | None, tracked: Tracked) -> float | None:
    return None if t is None else t - tracked.arrival


__all__ = ["FinishedRequestStats", "StatsSink", "Tracked", "observe", "observe_abort"]
