"""Fig. 18b: mean normalized latency of the paged system vs block size (simulated).

Two sides of the trade-off: large blocks waste up to block_size - 1 slots per sequence
(internal fragmentation), so fewer sequences fit and latency rises; small blocks cost
the kernel a fixed cost per block visited and, as its loads run over whole blocks, the
last block's unused slots. The second side is in the step time only when
``server.block_cost: kernel`` (pagedjax/simulator/systems.py BLOCK_COSTS: a fixed cost
of 3.7 tokens' HBM time per block visit, from the paper's Fig. 18a 20-26 % kernel
overhead at block 16); with ``none`` only the memory side shows. ``cpu_cross_check``
also times the native CPU kernel at the swept block sizes and fits its own per-block
cost (experiments/block_cost_cpu.py; real, measured).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from experiments import paper_values
from experiments.common import SIM_LABEL, latency_metrics, run_sim, save_fig, write_csv
from experiments.config import ExperimentConfig


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.block_size
    rows, summary = [], {"executor": SIM_LABEL, "duration_s": s.duration_s}
    jobs = [(w, b) for w in s.workloads for b in s.block_sizes]
    for w, b in progress(jobs, desc="block_size", leave=False):
        dur = w.duration_s or s.duration_s
        server = cfg.server
        if w.slots is not None:
            server = dataclasses.replace(
                server,
                slots=w.slots,
            )
        (r,) = run_sim("paged", server, [(w.dataset, w.rate, dur, s.seed, 1.0)], block_size=b)
        m = latency_metrics(r)
        rows.append(
            dict(
                executor=SIM_LABEL,
                dataset=w.dataset,
                rate=w.rate,
                duration_s=dur,
                block_size=b,
                avg_batched=float(r.result.win_batched),
                **m,
            )
        )
        e = summary.setdefault(w.dataset, {"rate": w.rate, "norm_latency": {}})
        e["norm_latency"][str(b)] = round(m["norm_latency_s_per_token"], 4)
    for w in s.workloads:
        lat = summary[w.dataset]["norm_latency"]
        summary[w.dataset]["best_block_size"] = int(min(lat, key=lat.get))
    summary["block_cost"] = cfg.server.block_cost
    if s.cpu_cross_check:
        from experiments import block_cost_cpu

        summary["cpu_cross_check"] = block_cost_cpu.measure(list(s.block_sizes))
    write_csv(out / "block_size.csv", rows)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for w in s.workloads:
        lat = summary[w.dataset]["norm_latency"]
        ax.plot([int(b) for b in lat], list(lat.values()), "o-", label=f"{w.dataset} {w.rate}/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"Fig. 18b block size ({SIM_LABEL})")
    ax.legend(fontsize=7)
    save_fig(fig, out / "block_size.png")
    return summary


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = [
        (f"best block size {k}", str(v["best_block_size"]), paper_values.FIG18B[:30])
        for k, v in summary.items()
        if isinstance(v, dict) and "best_block_size" in v
    ]
    if "cpu_cross_check" in summary:
        from experiments.block_cost_cpu import describe

        rows.append(("CPU kernel per-block cost (real)", describe(summary["cpu_cross_check"]),
                     "GPU setting 3.7 tokens"))  # fmt: skip
    return rows
