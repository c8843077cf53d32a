"""Fig. 12: mean normalized latency (s/token) vs request rate for every system, and the
knee: the highest rate whose normalized latency is <= a threshold (0.2, 0.5, 1.0).

Two modes. Search (``throughput_vs_rate.search`` set): each system's knees are found by
bracketing and bisection on the rate (experiments/knee_search.py) to a stated
resolution; every probe is a row of the CSV and a dot on the figure; a knee that could
not be bracketed inside [rate_min, rate_max] is a bound (">= X"), and a ratio with it is
a bound, never a number. Grid (no search): the knee is the highest swept rate under the
threshold, so a ratio is only known to the grid's step.

The rates share requests and arrival pattern (common random numbers, docs/workloads.md),
which keeps the latency curve close to monotone. Unfinished requests at the horizon
count with their latency so far, so an exploded point is a lower bound (its row says how
many were unfinished). The knee ratios paged/X compare request rates sustained at equal
latency, as section 6.2. ``operating_point`` gives Fig. 2 / Fig. 13 their rate: the
paged knee at 0.5 s/token. Simulated.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from experiments import paper_values
from experiments.common import (
    SIM_LABEL,
    SYSTEM_COLORS,
    SYSTEM_LABELS,
    latency_metrics,
    run_sim,
    run_threads,
    save_fig,
    write_csv,
)
from experiments.config import ExperimentConfig
from experiments.knee_search import KneeSearch, find_knees, ratio_text

# The operating point of Fig. 2 and Fig. 13 (issue 17's rule): the request rate at the
# paged system's knee at this normalized latency, where every system is loaded.
OPERATING_THRESHOLD = 0.5


def knee(rates: list[float], lat: list[float], threshold: float) -> float:
    """Grid mode: highest swept rate with normalized latency <= threshold (0 if none)."""
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
    """Grid mode: run one system over the rates (ascending); returns (rates run, metrics).

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


_SEARCHES: dict[str, tuple[KneeSearch, dict[float, dict[str, Any]]]] = {}


def search(
    system: str, server: Any, s: Any, spread: float
) -> tuple[KneeSearch, dict[float, dict[str, Any]]]:
    """Search mode: the knees of one system at every threshold (and at the operating
    threshold); returns the search and each probed rate's metrics. Cached per arguments,
    so memory_waste / batched_requests reuse the paged search for their operating point.
    """
    key = repr((system, server, s, spread))
    if key in _SEARCHES:
        return _SEARCHES[key]
    metrics: dict[float, dict[str, Any]] = {}

    def probe(rates: list[float]) -> list[float]:
        specs = [(s.dataset, r, s.duration_s, s.seed, spread) for r in rates]
        runs = run_sim(system, server, specs, stop_latency=s.search.stop_latency)
        out = []
        for rate, r in zip(rates, runs, strict=True):
            metrics[rate] = latency_metrics(r)
            out.append(metrics[rate]["norm_latency_s_per_token"])
        return out

    k = s.search
    found = find_knees(
        probe,
        sorted({*s.thresholds, OPERATING_THRESHOLD}),
        start=k.start,
        rate_min=k.rate_min,
        rate_max=k.rate_max,
        resolution=k.resolution,
        growth=k.growth,
    )
    _SEARCHES[key] = (found, metrics)
    return found, metrics


def prefetch_searches(server: Any, s: Any, jobs: list[tuple[float, str]]) -> None:
    """Run the knee searches of ``jobs`` ((spread, system) pairs) on parallel threads
    (``run_threads``); ``search`` caches each, so the callers' later calls return at once."""
    run_threads(lambda job: search(job[1], server, s, job[0]), jobs)


def operating_point(cfg: ExperimentConfig) -> dict[str, Any]:
    """The rate rule of Fig. 2 / Fig. 13: the paged system's knee at 0.5 s/token on
    throughput_vs_rate's dataset and duration (searched if not yet). If the knee is not
    bracketed (still under 0.5 at rate_max) the rate is that bound, flagged."""
    s = cfg.throughput_vs_rate
    if s.search is None:
        raise ValueError("rate: knee needs throughput_vs_rate.search (the knee search)")
    # Every system's search at once (paged first): the others are needed by Fig. 12 later
    # in the run and fill the other cores meanwhile.
    systems = ["paged"] + [x for x in s.systems if x != "paged"]
    prefetch_searches(server_for(cfg), s, [(1.0, x) for x in systems])
    found, _ = search("paged", server_for(cfg), s, 1.0)
    k = found.knees[OPERATING_THRESHOLD]
    rate = k.lo if k.lo is not None else k.hi
    return {
        "rate": rate,
        "rule": f"paged knee at {OPERATING_THRESHOLD} s/token ({s.dataset}, {s.duration_s:g} s"
        f" traces, resolution {100 * s.search.resolution:g} %)",
        "knee": k.to_json(),
        "bracketed": k.bracketed,
    }


def resolve_rate(cfg: ExperimentConfig, rate: float | str) -> tuple[float, dict[str, Any] | None]:
    """A configured rate: a number as is, or "knee" -> the operating point."""
    if rate != "knee":
        return float(rate), None
    op = operating_point(cfg)
    return float(op["rate"]), op


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.throughput_vs_rate
    server = server_for(cfg)
    spreads = [1.0] + [x for x in s.spread_scales if x != 1.0]
    summary, rows, curves = _run_one(server, s, spreads, progress)
    summary["cost_model"] = server.cost_model
    plots = [(server.cost_model, curves, summary)]
    for cm in s.also_cost_models:  # the same sweep under another step-time model, spread 1
        if cm == server.cost_model:
            continue
        sub, sub_rows, sub_curves = _run_one(
            dataclasses.replace(server, cost_model=cm), s, [1.0], progress
        )
        summary[f"cost_model={cm}"] = sub
        rows += sub_rows
        plots.append((cm, sub_curves, sub))
    write_csv(out / "throughput_vs_rate.csv", rows)
    _plot(plots, out / "throughput_vs_rate.png", s.dataset, server)
    return summary


def _run_one(server: Any, s: Any, spreads: list[float], progress: Any):
    rows, curves, searches = [], {}, {}
    jobs = [(sp, system) for sp in spreads for system in s.systems]
    if s.search is not None:
        prefetch_searches(server, s, jobs)
    for sp, system in progress(jobs, desc=f"throughput_vs_rate ({server.cost_model})", leave=False):
        if s.search is None:
            rates, ms = sweep(system, server, s, sp)
        else:
            found, by_rate = search(system, server, s, sp)
            searches.setdefault(sp, {})[system] = found
            rates = sorted(by_rate)
            ms = [by_rate[r] for r in rates]
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
        "mode": "grid" if s.search is None else "search",
        "duration_s": s.duration_s,
        "dataset": s.dataset,
        "gpu": server.gpu,
        "model": server.model,
    }
    if s.search is None:
        summary["rates"] = list(s.rates)
    else:
        summary["search"] = dataclasses.asdict(s.search)
    for sp in spreads:
        entry: dict[str, Any] = {
            "norm_latency": {
                k: {str(r): round(v, 4) for r, v in zip(*c, strict=True)}
                for k, c in curves[sp].items()
            }
        }
        ths = sorted({*s.thresholds, OPERATING_THRESHOLD}) if s.search else s.thresholds
        for th in ths:
            if s.search is None:
                entry[f"knee@{th}"] = _grid_knees(curves[sp], th)
            else:
                entry[f"knee@{th}"] = _searched_knees(searches[sp], th)
        if s.search is not None:
            entry["probes"] = {k: len(f.probes) for k, f in searches[sp].items()}
        summary["spread_1.0" if sp == 1.0 else f"spread_{sp}"] = entry
    return summary, rows, {"curves": curves[1.0], "searches": searches.get(1.0, {})}


def _grid_knees(curves: dict[str, Any], th: float) -> dict[str, Any]:
    """Knees read off the grid; a ratio is limited by the grid's step."""
    knees = {k: knee(*c, th) for k, c in curves.items()}
    ratios = {}
    if "paged" in knees:
        for k, v in knees.items():
            if k != "paged":
                ratios[f"paged/{k}"] = round(knees["paged"] / v, 2) if v else math.inf
    return {"rates": knees, "ratios": ratios}


def _searched_knees(found: dict[str, KneeSearch], th: float) -> dict[str, Any]:
    """Searched knees: numbers only when bracketed; ratios only between bracketed knees,
    otherwise the bound the probes prove (``ratio_text``)."""
    knees = {k: f.knees[th] for k, f in found.items()}
    entry: dict[str, Any] = {
        "rates": {k: v.rate for k, v in knees.items()},
        "text": {k: v.text() for k, v in knees.items()},
        "brackets": {k: [v.lo, v.hi] for k, v in knees.items()},
        "ratios": {},
        "ratio_text": {},
    }
    if "paged" in knees:
        for k, v in knees.items():
            if k == "paged":
                continue
            r, text = ratio_text(knees["paged"], v)
            if r is not None:
                entry["ratios"][f"paged/{k}"] = round(r, 2)
            entry["ratio_text"][f"paged/{k}"] = text
    return entry


def _plot(plots, path: Path, dataset: str, server: Any) -> None:
    """One panel per cost model: every probed (rate, latency) point, and in search mode
    each system's knee at the operating threshold (a star; hollow when only a bound)."""
    fig, axes = plt.subplots(1, len(plots), figsize=(5.8 * len(plots), 4.2), squeeze=False)
    for ax, (cm, data, _sub) in zip(axes[0], plots, strict=True):
        searches = data["searches"]
        for k, (rates, lat) in data["curves"].items():
            shown = [min(v, 1.15) for v in lat]  # exploded points pinned at the top edge
            label = SYSTEM_LABELS[k]
            if k in searches:
                kn = searches[k].knees[OPERATING_THRESHOLD]
                label += f" (knee {kn.text()})"
                if kn.lo is not None:
                    ax.plot(
                        [kn.lo],
                        [OPERATING_THRESHOLD],
                        "*",
                        ms=11,
                        color=SYSTEM_COLORS[k],
                        mfc=SYSTEM_COLORS[k] if kn.bracketed else "none",
                    )
            ax.plot(rates, shown, "o-", color=SYSTEM_COLORS[k], label=label, ms=3, lw=1)
        for th in (0.2, 0.5, 1.0):
            ax.axhline(th, color="k", lw=0.5, ls=":")
        ax.set_ylim(0, 1.2)
        if searches:
            ax.set_xscale("log")
            plain = FuncFormatter(lambda x, _: f"{x:g}")
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(plain)
            ax.tick_params(axis="x", which="both", labelsize=6)
        ax.set_xlabel("request rate (req/s)" + (", log scale; dots = probes" if searches else ""))
        ax.set_ylabel("normalized latency (s/token)")
        title = f"Fig. 12 {server.model} {server.gpu} {dataset}, {cm} ({SIM_LABEL})"
        if searches:
            title += f"\nstars: knee at {OPERATING_THRESHOLD} s/token (hollow: a bound)"
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
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
                text = e.get("ratio_text", {}).get(name)
                if text is None and name in e["ratios"]:
                    text = f"{e['ratios'][name]}"
                if text is not None:
                    rng = paper_values.format_ratio_range(lo, hi)
                    rows.append((f"knee ratio {name} @{th} s/tok [{cm}]", text, rng))
    for sp in ("spread_0.75", "spread_1.25"):
        if sp in summary:
            e = summary[sp]["knee@0.5"]
            for name in ("paged/orca_oracle", "paged/orca_max"):
                text = e.get("ratio_text", {}).get(name, e["ratios"].get(name))
                if text is not None:
                    rows.append((f"knee ratio {name} @0.5 {sp}", f"{text}", ""))
    return rows
