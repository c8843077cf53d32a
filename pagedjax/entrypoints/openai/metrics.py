"""Prometheus metrics of the server: vLLM's names under the ``pagedjax:`` prefix.

Counters and histograms are fed by the engine thread through ``StatsSink`` (timings of
each step's outputs, see pagedjax/entrypoints/async_engine.py). Gauges and the engine's own counters
(preemptions, prefix-cache tokens) are read from the engine when /metrics is scraped
(``AsyncLLMEngine.metrics_snapshot``: between steps, one round trip per engine core
process), so a scrape costs nothing while nobody scrapes.

Each server has its own ``CollectorRegistry`` (several servers in one process, as in
the tests, do not collide).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.request_stats import FinishedRequestStats

PREFIX = "pagedjax:"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0]  # fmt: skip
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


class ServerMetrics:
    """The metric families and the StatsSink that feeds them."""

    def __init__(self, model_name: str):
        disable_created_metrics()  # no *_created series (vLLM turns them off too)
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model_name = model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, lab + list(extra), registry=r)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, lab, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(PREFIX + name, doc, lab, buckets=buckets, registry=r).labels(
                model_name
            )

        self.running = gauge("num_requests_running", "Requests holding a scheduler slot.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a scheduler slot.")
        self.swapped = gauge(
            "num_requests_swapped", "Requests swapped out to the host KV pool (pagedjax's own)."
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "KV-cache usage: 1 = every block in use (cached free = free)."
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in tokens."
        ).labels(model_name)
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens.").labels(
            model_name
        )
        self.preemptions = counter("num_preemptions", "Preempted sequences.").labels(model_name)
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens of requests.").labels(
            model_name
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(
            model_name
        )
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", _ITL)
        self.tpot = hist(
            "request_time_per_output_token_seconds", "Per-request mean time per output token.",
            _ITL,
        )  # fmt: skip
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY)
        self.queue_time = hist(
            "request_queue_time_seconds", "Time from arrival to a scheduler slot.", _LATENCY
        )
        # Speculative decoding (vLLM V1's names; zero without speculative_config).
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Sequence-steps that verified drafts."
        ).labels(model_name)
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified."
        ).labels(model_name)
        self.spec_accepted = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        ).labels(model_name)
        # The host tier (pagedjax's own names; zero without kv_offloading_size):
        # docs/kv_tiers.md. Host hits are also counted in prefix_cache_hits.
        self.host_hits = counter(
            "prefix_cache_host_hits", "Prefix cache hits loaded from the host tier, in tokens."
        ).labels(model_name)
        self.offloaded = counter(
            "kv_offload_blocks", "KV blocks copied device -> host tier."
        ).labels(model_name)
        self.reloaded = counter(
            "kv_reload_blocks", "KV blocks copied host tier -> device."
        ).labels(model_name)
        self.offloaded_bytes = counter(
            "kv_offload_bytes", "KV bytes copied device -> host tier."
        ).labels(model_name)
        self.reloaded_bytes = counter(
            "kv_reload_bytes", "KV bytes copied host tier -> device."
        ).labels(model_name)
        self.disk_written = counter(
            "kv_disk_written_blocks", "KV blocks written to the disk tier's files."
        ).labels(model_name)
        self.disk_loaded = counter(
            "kv_disk_loaded_blocks", "KV blocks read from the disk tier into the host tier."
        ).labels(model_name)
        # Requests refused before the engine (pagedjax's own: vLLM has no such counter):
        # queue_full (--max-num-queued-reqs), shutting_down, too_large, engine_restarting.
        self.request_rejected = counter(
            "request_rejected", "Requests answered 503 / 413 before reaching the engine.",
            ("reason",),
        )  # fmt: skip
        # pagedjax's own: programs compiled for the engine since it started. Growth under
        # steady traffic means a batch shape the warm-up did not compile (its time is
        # charged to the requests that met it).
        self.compilations = gauge(
            "engine_compilations", "Programs compiled for the engine's jitted functions."
        )
        # pagedjax's own: engine iterations since it started (vLLM's closest is the
        # iteration_tokens_total histogram). Read with the token counters, it gives tokens
        # per step: how the server's arrivals batched.
        self.engine_steps = gauge("engine_steps", "Engine iterations run since start.")
        # Last engine counter values seen (engine counters -> Prometheus deltas).
        self._seen = dict(
            preemptions=0, queries=0, hits=0, spec_drafts=0, spec_draft_tokens=0, spec_accepted=0,
            host_hits=0, offloaded=0, reloaded=0, offloaded_bytes=0, reloaded_bytes=0,
            disk_written=0, disk_loaded=0,
        )

    # ------------------------------------------------------------- StatsSink

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_inter_token(self, seconds: float, count: int) -> None:
        for _ in range(count):
            self.itl.observe(seconds)

    def on_finished(self, s: FinishedRequestStats) -> None:
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.generation_tokens)
        self.request_success.labels(self.model_name, s.finish_reason).inc()
        self.e2e.observe(s.e2e)
        if s.tpot is not None:
            self.tpot.observe(s.tpot)
        if s.queue_time is not None:
            self.queue_time.observe(s.queue_time)

    def rejected(self, reason: str) -> None:
        self.request_rejected.labels(self.model_name, reason).inc()

    def summary(self) -> str:
        """Finished and rejected requests by reason, one line (logged at shutdown)."""
        parts = []
        for family, label in ((self.request_success, "finished_reason"),
                              (self.request_rejected, "reason")):  # fmt: skip
            for metric in family.collect():
                for s in metric.samples:
                    if s.name.endswith("_total"):
                        parts.append(f"{s.name}{{{label}={s.labels[label]}}}={s.value:g}")
        return ", ".join(parts) or "no requests"

    # ------------------------------------------------------------- scrape

    async def render(self, engine: AsyncLLMEngine) -> bytes:
        """Read the engine's gauges and counters (between steps), then the text format."""
        if engine.is_healthy:
            try:
                snap = await engine.metrics_snapshot()
            except Exception:  # noqa: BLE001 - the engine died meanwhile: last values stay
                snap = None
            if snap is not None:
                self._apply(snap)
        return generate_latest(self.registry)

    def _apply(self, raw: dict[str, Any]) -> None:
        snap = _flatten(raw)
        self.running.set(snap["running"])
        self.waiting.set(snap["waiting"])
        self.swapped.set(snap["swapped"])
        self.kv_usage.set(snap["kv_usage"])
        self.compilations.set(snap["compilations"])
        self.engine_steps.set(snap["engine_steps"])
        for key, metric in (
            ("preemptions", self.preemptions),
            ("queries", self.prefix_queries),
            ("hits", self.prefix_hits),
            ("spec_drafts", self.spec_drafts),
            ("spec_draft_tokens", self.spec_draft_tokens),
            ("spec_accepted", self.spec_accepted),
            ("host_hits", self.host_hits),
            ("offloaded", self.offloaded),
            ("reloaded", self.reloaded),
            ("offloaded_bytes", self.offloaded_bytes),
            ("reloaded_bytes", self.reloaded_bytes),
            ("disk_written", self.disk_written),
            ("disk_loaded", self.disk_loaded),
        ):
            delta = snap[key] - self._seen[key]
            if delta < 0:  # the engine's stats were reset: count from there
                delta = snap[key]
            metric.inc(delta)
            self._seen[key] = snap[key]


def _flatten(snap: dict[str, Any]) -> dict[str, Any]:
    """protocol.metrics_snapshot's numbers as the metric values."""
    counts, stats, usable = snap["counts"], snap["stats"], snap["usable"]
    return dict(
        running=counts["running"],
        waiting=counts["waiting"],
        swapped=counts["swapped"],
        kv_usage=1.0 - snap["free"] / usable if usable else 0.0,
        preemptions=int(snap["preemptions"]),
        queries=int(stats["prefix_cache_query_tokens"]),
        hits=int(stats["prefix_cache_hit_tokens"]),
        spec_drafts=int(stats.get("spec_rows", 0)),
        spec_draft_tokens=int(stats.get("spec_proposed_tokens", 0)),
        spec_accepted=int(stats.get("spec_accepted_tokens", 0)),
        compilations=int(stats.get("compilations", 0)),
        engine_steps=int(stats.get("engine_steps", 0)),
        host_hits=int(stats.get("prefix_cache_host_hit_tokens", 0)),
        offloaded=int(stats.get("kv_offloaded_blocks", 0)),
        reloaded=int(stats.get("kv_reloaded_blocks", 0)),
        offloaded_bytes=int(stats.get("kv_offloaded_bytes", 0)),
        reloaded_bytes=int(stats.get("kv_reloaded_bytes", 0)),
        disk_written=int(stats.get("kv_disk_written_blocks", 0)),
        disk_loaded=int(stats.get("kv_disk_loaded_blocks", 0)),
    )
