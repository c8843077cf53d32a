"""Fig. 2: share of KV memory holding token states, reserved, internal and external
fragmentation, for Orca (Max / Pow2 / Oracle) and paged, averaged over the steady window.

Setup (config section ``memory_waste``): OPT-13B geometry, the server's KV pool
(15,728 slots = 12 GiB), a ShareGPT-like trace at ``rate`` for ``duration_s``, paper-mode
scheduling. Shares are of the whole pool, time-weighted over the window
[max(warm-up, first completion), last arrival]. ``token_of_allocated_pct`` is the token
share of the memory the system holds (pool minus external fragmentation and free).
Results at spread_scale 0.75 / 1.25 show the sensitivity to the assumed length spread.
Simulated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from experiments import paper_values
from experiments.common import (
    SIM_LABEL,
    SYSTEM_LABELS,
    run_sim,
    run_threads,
    save_fig,
    usage_pcts,
    write_csv,
)
from experiments.config import ExperimentConfig
from experiments.throughput_vs_rate import resolve_rate

SYSTEMS = ("orca_max", "orca_pow2", "orca_oracle", "paged")
CATS = ("token_states_pct", "reserved_pct", "internal_frag_pct", "external_frag_pct")


def specs(cfg: ExperimentConfig) -> list[tuple[str, float, float, int, float]]:
    """Trace specs: spread 1.0 first, then the sensitivity spreads (rate resolved)."""
    s = cfg.memory_waste
    rate, _ = resolve_rate(cfg, s.rate)
    spreads = [1.0] + [x for x in s.spread_scales if x != 1.0]
    return [(s.dataset, rate, s.duration_s, s.seed, sp) for sp in spreads]


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    sp = specs(cfg)
    summary: dict[str, Any] = {"executor": SIM_LABEL}
    _, op = resolve_rate(cfg, cfg.memory_waste.rate)
    if op is not None:
        summary["operating_point"] = op
    rows = []
    run_threads(lambda system: run_sim(system, cfg.server, sp, drain=False), SYSTEMS)  # cached
    for system in progress(SYSTEMS, desc="memory_waste", leave=False):
        runs = run_sim(system, cfg.server, sp, drain=False)
        for (_, rate, dur, seed, spread), r in zip(sp, runs, strict=True):
            u = usage_pcts(r, cfg.server.pool_slots)
            rows.append(
                dict(
                    executor=SIM_LABEL,
                    system=system,
                    dataset=sp[0][0],
                    rate=rate,
                    duration_s=dur,
                    seed=seed,
                    spread_scale=spread,
                    avg_batched=float(r.result.win_batched),
                    **u,
                )
            )
            if spread == 1.0:
                summary[system] = {k: round(v, 2) for k, v in u.items()}
            else:
                summary[system][f"token_states_pct@spread{spread}"] = round(
                    u["token_states_pct"], 2
                )
    summary["setup"] = dict(
        dataset=sp[0][0],
        rate=sp[0][1],
        duration_s=sp[0][2],
        kv_slots=cfg.server.pool_slots,
        kv_cache_dtype=cfg.server.kv_cache_dtype,
        model=cfg.server.model,
        window="max(warmup_frac*duration, first completion) .. last arrival",
        warmup_frac=cfg.server.warmup_frac,
    )
    write_csv(out / "memory_waste.csv", rows)
    plot_shares(summary, out / "memory_waste.png")
    return summary


def plot_shares(summary: dict[str, Any], path: Path, paper: bool = True) -> None:
    """The stacked bars; ``paper``: label each bar with the paper's Fig. 2 value (off for
    workloads the paper did not run, e.g. image chat)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [SYSTEM_LABELS[s] for s in SYSTEMS]
    bottom = [0.0] * len(SYSTEMS)
    # The paper's last category ("external frag. & others") is drawn in two parts, so
    # an idle (free) pool never reads as waste.
    cats = (*CATS[:3], "external_only_pct", "free_pct")
    colors = ("tab:green", "tab:olive", "tab:red", "tab:purple", "lightgray")
    labels = ("token states", "reserved", "internal frag.", "external frag.", "free")
    for cat, color, label in zip(cats, colors, labels, strict=True):
        vals = [summary[s][cat] for s in SYSTEMS]
        ax.bar(names, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, s in enumerate(SYSTEMS):
        ax.text(
            i,
            summary[s]["token_states_pct"] / 2,
            f"{summary[s]['token_states_pct']:.1f}",
            ha="center",
            fontsize=8,
        )
        if paper:
            ax.text(i, 101, f"paper {paper_values.FIG2[s]['token_states_pct']}", ha="center",
                    fontsize=7)  # fmt: skip
    ax.set_ylabel("% of KV memory (steady window)")
    ax.set_ylim(0, 110)
    setup = summary["setup"]
    ax.set_title(
        f"Fig. 2 memory waste, {setup['model']} {setup['dataset']} @ {setup['rate']:.3g} req/s"
        f" ({SIM_LABEL})",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.tick_params(axis="x", labelsize=8)
    save_fig(fig, path)


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for s in SYSTEMS:
        paper = paper_values.FIG2[s]["token_states_pct"]
        rows.append((f"token states % {s}", f"{summary[s]['token_states_pct']:.1f}", f"{paper}"))
    rows.append(
        ("paged token % of allocated", f"{summary['paged']['token_of_allocated_pct']:.1f}", "96.3")
    )
    rows.append(("paged free % of pool", f"{summary['paged']['free_pct']:.1f}", ""))
    return rows
