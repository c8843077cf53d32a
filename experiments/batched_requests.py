"""Fig. 13: average number of batched (scheduled) requests per step, time-weighted over
the steady window, for ShareGPT-like at 2 req/s and Alpaca-like at 30 req/s (config
section ``batched_requests``). Same systems, pool and window as memory_waste; the
ShareGPT runs are shared with it when the settings agree. Simulated.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from experiments import paper_values
from experiments.common import SIM_LABEL, SYSTEM_LABELS, run_sim, save_fig, write_csv
from experiments.config import ExperimentConfig

SYSTEMS = ("orca_max", "orca_pow2", "orca_oracle", "paged")


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.batched_requests
    spreads = [1.0] + [x for x in s.spread_scales if x != 1.0]
    summary: dict[str, Any] = {"executor": SIM_LABEL}
    rows = []
    jobs = [(w, sys) for w in s.workloads for sys in SYSTEMS]
    for w, system in progress(jobs, desc="batched_requests", leave=False):
        dur = w.duration_s or s.duration_s
        sp = [(w.dataset, w.rate, dur, s.seed, x) for x in spreads]
        server = cfg.server
        if w.slots is not None:  # Alpaca needs more rows than ShareGPT (132 run at once)
            n = w.slots
            server = dataclasses.replace(
                server,
                slots=n,
            )
        runs = run_sim(system, server, sp, drain=False)
        for x, r in zip(spreads, runs, strict=True):
            b = float(r.result.win_batched)
            rows.append(
                dict(
                    executor=SIM_LABEL,
                    workload=w.dataset,
                    rate=w.rate,
                    duration_s=s.duration_s,
                    system=system,
                    spread_scale=x,
                    avg_batched=b,
                    window_s=float(r.result.win_time),
                )
            )
            entry = summary.setdefault(w.dataset, {})
            if x == 1.0:
                entry[system] = round(b, 2)
            else:
                entry.setdefault("spread", {}).setdefault(str(x), {})[system] = round(b, 2)
    for w in s.workloads:
        e = summary[w.dataset]
        e["paged/orca_oracle"] = round(e["paged"] / e["orca_oracle"], 2)
        e["paged/orca_max"] = round(e["paged"] / e["orca_max"], 2)
        e["rate"] = w.rate
        e["duration_s"] = w.duration_s or s.duration_s
    write_csv(out / "batched_requests.csv", rows)
    _plot(summary, [w.dataset for w in s.workloads], out / "batched_requests.png")
    return summary


def _plot(summary: dict[str, Any], loads: list[str], path: Path) -> None:
    fig, axes = plt.subplots(1, len(loads), figsize=(4.5 * len(loads), 3.8), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        vals = [summary[load][s] for s in SYSTEMS]
        paper = [paper_values.FIG13.get(load, {}).get(s, np.nan) for s in SYSTEMS]
        x = np.arange(len(SYSTEMS))
        ax.bar(x - 0.2, vals, 0.4, label=f"ours ({SIM_LABEL})", color="tab:blue")
        ax.bar(x + 0.2, paper, 0.4, label="paper", color="lightgray")
        for i, v in enumerate(vals):
            ax.text(i - 0.2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [SYSTEM_LABELS[s] for s in SYSTEMS], fontsize=7, rotation=15)
        ax.set_title(f"{load} @ {summary[load]['rate']} req/s")
        ax.set_ylabel("avg batched requests")
        ax.legend(fontsize=7)
    fig.suptitle(f"Fig. 13 batched requests ({SIM_LABEL})", fontsize=10)
    save_fig(fig, path)


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for load, paper in paper_values.FIG13.items():
        if load not in summary:
            continue
        for s in SYSTEMS:
            rows.append((f"batched {load} {s}", f"{summary[load][s]:.2f}", f"{paper[s]:.2f}"))
        rows.append(
            (
                f"batched {load} paged/oracle",
                f"{summary[load]['paged/orca_oracle']:.2f}",
                f"{paper['paged'] / paper['orca_oracle']:.2f}",
            )
        )
    return rows
