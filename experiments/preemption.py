"""Fig. 19b: end-to-end normalized latency with recompute vs swap preemption by block size.

The paged system at a rate that causes preemptions, once preempting by recompute and once
by swap into a host pool of ``swap_space_gib`` (every request is a single sequence, so
the swap runs force swap mode, as the paper's ablation does). A swap costs the cost
model's ``swap_time``: one copy per block, layer and K/V (a fixed cost each, as vLLM 0.1
issued them) plus the bytes over PCIe; a recompute costs the prefill it redoes.
Simulated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from experiments.common import SIM_LABEL, latency_metrics, run_sim, save_fig, write_csv
from experiments.config import ExperimentConfig

MODES = ("recompute", "swap")


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.preemption
    rows = []
    summary: dict[str, Any] = {
        "executor": SIM_LABEL,
        "rate": s.rate,
        "dataset": s.dataset,
        "duration_s": s.duration_s,
        "swap_space_gib": s.swap_space_gib,
        "recompute": {},
        "swap": {},
    }
    runs = [(m, b) for b in s.block_sizes for m in MODES]
    for mode, b in progress(runs, desc="preemption", leave=False):
        swap = s.swap_space_gib if mode == "swap" else None
        (r,) = run_sim(
            "paged",
            cfg.server,
            [(s.dataset, s.rate, s.duration_s, s.seed, 1.0)],
            block_size=b,
            swap_space_gib=swap,
        )
        m = latency_metrics(r)
        rows.append(dict(executor=SIM_LABEL, mode=mode, block_size=b, rate=s.rate, **m))
        summary[mode][str(b)] = {
            "norm_latency": round(m["norm_latency_s_per_token"], 4),
            "preemptions": m["preemptions"],
        }
    write_csv(out / "preemption.csv", rows)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for mode in MODES:
        v = summary[mode]
        ax.plot([int(b) for b in v], [x["norm_latency"] for x in v.values()], "o-", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"Fig. 19b preemption ({SIM_LABEL})")
    ax.legend(fontsize=7)
    save_fig(fig, out / "preemption.png")
    return summary


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (f"{mode} nl bs={b} ({v['preemptions']} preempted)", f"{v['norm_latency']:.3f}", "")
        for mode in MODES
        for b, v in summary[mode].items()
    ]
