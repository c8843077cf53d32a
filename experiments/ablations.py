"""Ablations the paper could not run (simulated): the paged system beside vAttention-style
contiguous virtual memory (64 KiB and 2 MiB pages), an fp8 KV pool and a block size
chosen per request (``simulator/request_blocks.py``), at the paper's
scale (the server section: OPT-13B or Llama-2-7B geometry, 15,728 16-bit slots).

Each is a named system of ``pagedjax.simulator.systems`` (``ABLATIONS``). Every system
serves the same ShareGPT-like trace at the operating point of Fig. 2 (``memory_waste``'s
rate: the paged knee at 0.5 s/token when ``rate: knee``), drained to the horizon, and
is reported by mean normalized latency, throughput, average batched requests in the
steady window, token share of the KV memory and preemptions: one row each.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from experiments.common import (
    SIM_LABEL,
    SYSTEM_LABELS,
    latency_metrics,
    run_sim,
    run_threads,
    usage_pcts,
    write_csv,
)
from experiments.config import ExperimentConfig
from experiments.throughput_vs_rate import resolve_rate
from pagedjax.simulator.systems import SYSTEM_SERVER

SYSTEMS = ("paged", "vattention_64k", "vattention_2m", "paged_fp8", "paged_block_per_request")


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    m = cfg.memory_waste
    rate, _ = resolve_rate(cfg, m.rate)
    spec = [(m.dataset, rate, m.duration_s, m.seed, 1.0)]
    run_threads(lambda x: run_sim(x, cfg.server, spec), SYSTEMS)  # fills the cache
    summary: dict[str, Any] = {"executor": SIM_LABEL, "rate": rate, "dataset": m.dataset}
    rows = []
    for system in progress(SYSTEMS, desc="ablations", leave=False):
        (r,) = run_sim(system, cfg.server, spec)
        lat = latency_metrics(r)
        # Shares of the same KV memory: an fp8 pool's capacity is in fp8 tokens, so its
        # token share counts 8-bit tokens of that memory.
        cap = dataclasses.replace(cfg.server, **SYSTEM_SERVER.get(system, {})).pool_slots
        u = usage_pcts(r, cap)
        row = {
            "norm_latency_s_per_token": round(lat["norm_latency_s_per_token"], 4),
            "throughput_tok_s": round(lat["throughput_tok_s"], 1),
            "avg_batched": round(float(r.result.win_batched), 2),
            "token_states_pct": round(u["token_states_pct"], 1),
            "preemptions": int(lat["preemptions"]),
        }
        summary[system] = row
        rows.append(dict(executor=SIM_LABEL, system=system, rate=rate, **row))
    write_csv(out / "ablations.csv", rows)
    return summary


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (
            f"{SYSTEM_LABELS[x]} @ {summary['rate']:.3g} req/s: s/token, batched, token %",
            f"{v['norm_latency_s_per_token']} / {v['avg_batched']} / {v['token_states_pct']}",
            "-",
        )
        for x in SYSTEMS
        if (v := summary.get(x))
    ]
