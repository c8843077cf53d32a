"""Fig. 19b: end-to-end normalized latency with recompute vs swap preemption by block size.

Only recompute exists: swap preemption arrives with the sharing issue (issue 5), so the
swap column reads "not built" rather than a number. The rate is chosen to cause
preemptions in the paged system. Simulated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from experiments.common import SIM_LABEL, latency_metrics, run_sim, save_fig, write_csv
from experiments.config import ExperimentConfig

SWAP_STATUS = "not built: swap preemption awaits the sharing issue"


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.preemption
    rows = []
    summary: dict[str, Any] = {
        "executor": SIM_LABEL,
        "rate": s.rate,
        "dataset": s.dataset,
        "duration_s": s.duration_s,
        "swap": SWAP_STATUS,
        "recompute": {},
    }
    for b in progress(s.block_sizes, desc="preemption", leave=False):
        (r,) = run_sim(
            "paged", cfg.server, [(s.dataset, s.rate, s.duration_s, s.seed, 1.0)], block_size=b
        )
        m = latency_metrics(r)
        rows.append(dict(executor=SIM_LABEL, mode="recompute", block_size=b, rate=s.rate, **m))
        summary["recompute"][str(b)] = {
            "norm_latency": round(m["norm_latency_s_per_token"], 4),
            "preemptions": m["preemptions"],
        }
    write_csv(out / "preemption.csv", rows)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    rc = summary["recompute"]
    ax.plot([int(b) for b in rc], [v["norm_latency"] for v in rc.values()], "o-", label="recompute")
    ax.text(0.02, 0.95, "swap: " + SWAP_STATUS, transform=ax.transAxes, fontsize=7, va="top")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"Fig. 19b preemption ({SIM_LABEL})")
    ax.legend(fontsize=7)
    save_fig(fig, out / "preemption.png")
    return summary


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = [
        (f"recompute nl bs={b}", f"{v['norm_latency']:.3f}", "")
        for b, v in summary["recompute"].items()
    ]
    return rows + [("swap", "not built", "")]
