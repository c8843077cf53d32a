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


def sweep(
    system: str, server: Any, s: Any, spread: float
) -> tuple[list[float], list[dict[str, Any]]]:
    """Run one system over the rates (ascending); returns (rates run, metrics).

    With stop_after_exceed the sweep ends after the first rate whose normalized latency is
    above the largest threshold: the knees are already determined, and exploded runs are
    the slowest to simulate (they run to the horizon).
    """
    rates, ms = [], []
    for rate in s.rates:
        (r,) = run_sim(system, server, [(s.dataset, rate, s.duration_s, s.seed, spread)])
        m = latency_metrics(r)
        rates.append(rate)
        ms.append(m)
        if s.stop_after_exceed and m["norm_latency_s_per_token"] > max(s.thresholds):
            break
    return rates, ms


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.throughput_vs_rate
    server = server_for(cfg)
    spreads = [1.0] + [x for x in s.spread_scales if x != 1.0]
    summary, rows, curves = _run_one(server, s, spreads, progress)
    summary["cost_model"] = server.cost_model
    plots = [(server.cost_model, curves)]
    for cm in s.also_cost_models:  # the same sweep under another step-time model, spread 1
        if cm == server.cost_model:
            continue
        sub, sub_rows, sub_curves = _run_one(
            dataclasses.replace(server, cost_model=cm), s, [1.0], progress
        )
        summary[f"cost_model={cm}"] = sub
        rows += sub_rows
        plots.append((cm, sub_curves))
    write_csv(out / "throughput_vs_rate.csv", rows)
    _plot(plots, out / "throughput_vs_rate.png", s.dataset, server)
    return summary


def _run_one(server: Any, s: Any, spreads: list[float], progress: Any):
    rows, curves = [], {}
    jobs = [(sp, system) for sp in spreads for system in s.systems]
    for sp, system in progress(jobs, desc=f"throughput_vs_rate ({server.cost_model})", leave=False):
        rates, ms = sweep(system, server, s, sp)
        for rate, m in zip(rates, ms, strict=True):
            rows.append(
                dict(
                    executor=SIM_LABEL,
                    cost_model=server.cost_model,
                    system=system,
                    dataset=s.dataset,
                    rate=rate,
                    duration_s=s.duration_s,
                    seed=s.seed,
                    spread_scale=sp,
                    **m,
                )
            )
        curves.setdefault(sp, {})[system] = (rates, [m["norm_latency_s_per_token"] for m in ms])
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
            "norm_latency": {
                k: {str(r): round(v, 4) for r, v in zip(*c, strict=True)}
                for k, c in curves[sp].items()
            }
        }
        for th in s.thresholds:
            knees = {k: knee(*c, th) for k, c in curves[sp].items()}
            ratios = {}
            if "paged" in knees:
                for k, v in knees.items():
                    if k != "paged":
                        ratios[f"paged/{k}"] = round(knees["paged"] / v, 2) if v else math.inf
            entry[f"knee@{th}"] = {"rates": knees, "ratios": ratios}
        summary["spread_1.0" if sp == 1.0 else f"spread_{sp}"] = entry
    return summary, rows, curves[1.0]


def _plot(plots, path: Path, dataset: str, server: Any) -> None:
    fig, axes = plt.subplots(1, len(plots), figsize=(5.5 * len(plots), 4), squeeze=False)
    for ax, (cm, curves) in zip(axes[0], plots, strict=True):
        for k, (rates, lat) in curves.items():
            ax.plot(rates, lat, "o-", color=SYSTEM_COLORS[k], label=SYSTEM_LABELS[k], ms=3)
        ax.axhline(0.5, color="k", lw=0.5, ls=":")
        ax.set_ylim(0, 1.0)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        title = f"Fig. 12 {server.model} {server.gpu} {dataset}, {cm} ({SIM_LABEL})"
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=7)
    save_fig(fig, path)


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    subs = [(summary.get("cost_model", "roofline"), summary)] + [
        (k[11:], v) for k, v in summary.items() if k.startswith("cost_model=")
    ]
    for cm, sub in subs:
        for th in ("0.2", "0.5", "1.0"):
            e = sub["spread_1.0"].get(f"knee@{float(th)}")
            if not e:
                continue
            for name, (lo, hi) in paper_values.FIG12_RATIO_RANGES.items():
                if name in e["ratios"]:
                    rng = paper_values.format_ratio_range(lo, hi)
                    rows.append(
                        (f"knee ratio {name} @{th} s/tok [{cm}]", f"{e['ratios'][name]}", rng)
                    )
    for sp in ("spread_0.75", "spread_1.25"):
        if sp in summary:
            r = summary[sp]["knee@0.5"]["ratios"]
            for name in ("paged/orca_oracle", "paged/orca_max"):
                if name in r:
                    rows.append((f"knee ratio {name} @0.5 {sp}", f"{r[name]}", ""))
    return rows
