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
from experiments.common import (
    SIM_LABEL,
    SYSTEM_LABELS,
    run_sim,
    run_threads,
    save_fig,
    write_csv,
)
from experiments.config import ExperimentConfig
from experiments.throughput_vs_rate import resolve_rate

SYSTEMS = ("orca_max", "orca_pow2", "orca_oracle", "paged")


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.batched_requests
    spreads = [1.0] + [x for x in s.spread_scales if x != 1.0]
    summary, rows = _run_one(cfg, cfg.server, spreads, progress)
    summary["cost_model"] = cfg.server.cost_model
    for cm in s.also_cost_models:  # the same runs under another step-time model, spread 1
        if cm == cfg.server.cost_model:
            continue
        server = dataclasses.replace(cfg.server, cost_model=cm)
        sub, sub_rows = _run_one(cfg, server, [1.0], progress)
        summary[f"cost_model={cm}"] = sub
        rows += sub_rows
    write_csv(out / "batched_requests.csv", rows)
    _plot(summary, [w.dataset for w in s.workloads], out / "batched_requests.png")
    return summary


def _run_one(
    cfg: ExperimentConfig, base: Any, spreads: list[float], progress: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    s = cfg.batched_requests
    summary: dict[str, Any] = {"executor": SIM_LABEL}
    rows = []
    jobs = []
    for w in s.workloads:
        dur = w.duration_s or s.duration_s
        rate, op = resolve_rate(cfg, w.rate)  # the operating point is searched under
        if op is not None:  # the primary cost model, so both models share one rate
            summary.setdefault(w.dataset, {})["operating_point"] = op
        sp = [(w.dataset, rate, dur, s.seed, x) for x in spreads]
        server = base
        if w.slots is not None:  # Alpaca needs more rows than ShareGPT (132 run at once)
            server = dataclasses.replace(server, slots=w.slots)
        jobs += [(w, system, server, sp) for system in SYSTEMS]
    run_threads(lambda j: run_sim(j[1], j[2], j[3], drain=False), jobs)  # cached for below
    for w, system, server, sp in progress(
        jobs, desc=f"batched_requests ({base.cost_model})", leave=False
    ):
        runs = run_sim(system, server, sp, drain=False)
        _, rate, dur, _, _ = sp[0]
        for x, r in zip(spreads, runs, strict=True):
            b = float(r.result.win_batched)
            rows.append(
                dict(
                    executor=SIM_LABEL,
                    cost_model=base.cost_model,
                    workload=w.dataset,
                    rate=rate,
                    duration_s=dur,
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
        e["rate"] = resolve_rate(cfg, w.rate)[0]
        e["duration_s"] = w.duration_s or s.duration_s
    return summary, rows


def _plot(summary: dict[str, Any], loads: list[str], path: Path) -> None:
    fig, axes = plt.subplots(1, len(loads), figsize=(4.5 * len(loads), 3.8), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        series = [(f"ours, {summary.get('cost_model', 'roofline')} ({SIM_LABEL})", summary)]
        series += [
            (f"ours, {k[11:]} ({SIM_LABEL})", v)
            for k, v in summary.items()
            if k.startswith("cost_model=") and load in v
        ]
        paper = [paper_values.FIG13.get(load, {}).get(s, np.nan) for s in SYSTEMS]
        x = np.arange(len(SYSTEMS))
        width = 0.8 / (len(series) + 1)
        for j, (label, summ) in enumerate(series):
            vals = [summ[load][s] for s in SYSTEMS]
            ax.bar(x + (j - len(series) / 2) * width, vals, width, label=label)
            for i, v in enumerate(vals):
                xi = i + (j - len(series) / 2) * width
                ax.text(xi, v, f"{v:.1f}", ha="center", va="bottom", fontsize=6)
        ax.bar(x + len(series) / 2 * width, paper, width, label="paper", color="lightgray")
        ax.set_xticks(x, [SYSTEM_LABELS[s] for s in SYSTEMS], fontsize=7, rotation=15)
        ax.set_title(f"{load} @ {summary[load]['rate']:.3g} req/s", fontsize=9)
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
        for key, sub in summary.items():
            if key.startswith("cost_model=") and load in sub:
                rows.append(
                    (
                        f"batched {load} paged/oracle [{key[11:]}]",
                        f"{sub[load]['paged/orca_oracle']:.2f}",
                        f"{paper['paged'] / paper['orca_oracle']:.2f}",
                    )
                )
    return rows
