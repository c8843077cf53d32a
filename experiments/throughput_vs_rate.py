"""Fig. 12: mean normalized latency (s/token) vs request rate for every system, and the
knee: the highest swept rate whose normalized latency is <= a threshold (0.2, 0.5, 1.0).

Each system runs all rates (and the spread_scale 0.75 / 1.25 variants) in one vmapped
simulation; the rates share requests and arrival pattern (common random numbers,
docs/workloads.md). Unfinished requests at the horizon count with their latency so far,
so an exploded point is a lower bound (its row says how many were unfinished). The
knee ratios paged/X compare request rates sustained at equal latency, as section 6.2.
The resolution of a ratio is limited by the rate grid. Simulated.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from experiments import paper_values
from experiments.common import (
    SIM_LABEL,
    SYSTEM_COLORS,
    SYSTEM_LABELS,
    latency_metrics,
    run_sim,
    save_fig,
    write_csv,
)
from experiments.config import ExperimentConfig


def knee(rates: list[float], lat: list[float], threshold: float) -> float:
    """Highest rate with normalized latency <= threshold (0 if none)."""
    ok = [r for r, v in zip(rates, lat, strict=True) if v <= threshold]
    return max(ok) if ok else 0.0


def server_for(cfg: ExperimentConfig) -> Any:
    s = cfg.throughput_vs_rate
    if s.slots is None:
        return cfg.server
    return dataclasses.replace(
        cfg.server,
        slots=s.slots,
    )


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.throughput_vs_rate
    server = server_for(cfg)
    spreads = [1.0] + [x for x in s.spread_scales if x != 1.0]
    specs = [(s.dataset, r, s.duration_s, s.seed, sp) for sp in spreads for r in s.rates]
    rows, curves = [], {}
    for system in progress(s.systems, desc="throughput_vs_rate", leave=False):
        runs = run_sim(system, server, specs)
        for (_, rate, dur, seed, sp), r in zip(specs, runs, strict=True):
            m = latency_metrics(r)
            rows.append(
                dict(
                    executor=SIM_LABEL,
                    system=system,
                    dataset=s.dataset,
                    rate=rate,
                    duration_s=dur,
                    seed=seed,
                    spread_scale=sp,
                    **m,
                )
            )
            curves.setdefault(sp, {}).setdefault(system, []).append(m["norm_latency_s_per_token"])
    summary: dict[str, Any] = {
        "executor": SIM_LABEL,
        "rates": list(s.rates),
        "duration_s": s.duration_s,
        "dataset": s.dataset,
        "gpu": server.gpu,
        "model": server.model,
    }
    for sp in spreads:
        entry: dict[str, Any] = {
            "norm_latency": {k: [round(v, 4) for v in c] for k, c in curves[sp].items()}
        }
        for th in s.thresholds:
            knees = {k: knee(s.rates, c, th) for k, c in curves[sp].items()}
            ratios = {}
            if "paged" in knees:
                for k, v in knees.items():
                    if k != "paged":
                        ratios[f"paged/{k}"] = round(knees["paged"] / v, 2) if v else math.inf
            entry[f"knee@{th}"] = {"rates": knees, "ratios": ratios}
        summary["spread_1.0" if sp == 1.0 else f"spread_{sp}"] = entry
    write_csv(out / "throughput_vs_rate.csv", rows)
    _plot(s.rates, curves[1.0], out / "throughput_vs_rate.png", s.dataset, server)
    return summary


def _plot(rates, curves, path: Path, dataset: str, server: Any) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, c in curves.items():
        ax.plot(rates, c, "o-", color=SYSTEM_COLORS[k], label=SYSTEM_LABELS[k], ms=3)
    ax.axhline(0.5, color="k", lw=0.5, ls=":")
    ax.set_ylim(0, 1.0)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"Fig. 12 {server.model} {server.gpu} {dataset} ({SIM_LABEL})", fontsize=9)
    ax.legend(fontsize=7)
    save_fig(fig, path)


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for th in ("0.2", "0.5", "1.0"):
        e = summary["spread_1.0"].get(f"knee@{float(th)}")
        if not e:
            continue
        for name, (lo, hi) in paper_values.FIG12_RATIO_RANGES.items():
            if name in e["ratios"]:
                rng = f"{lo or ''}-{hi}x"
                rows.append((f"knee ratio {name} @{th} s/tok", f"{e['ratios'][name]}", rng))
    for sp in ("spread_0.75", "spread_1.25"):
        if sp in summary:
            r = summary[sp]["knee@0.5"]["ratios"]
            for name in ("paged/orca_oracle", "paged/orca_max"):
                if name in r:
                    rows.append((f"knee ratio {name} @0.5 {sp}", f"{r[name]}", ""))
    return rows
