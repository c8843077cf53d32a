"""Fig. 15 (real executor): KV blocks saved by sharing, parallel sampling n and beam
search width k, on Alpaca-like lengths.

Runs benchmarks/sharing_memory.py's loops (closed loop of ``concurrency`` requests in
flight through the real engine on a small random model; prefix caching off, so the only
sharing is within a request; nothing preempted) and reports the saving
1 - blocks referenced / blocks without sharing, averaged over steps, for the whole run
and for the steady part (steps while requests were still to be added), beside the
paper's Fig. 15 (OPT-13B, Alpaca).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from experiments.common import save_fig, write_csv
from experiments.config import ExperimentConfig

LABEL = "real"


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    from benchmarks import sharing_memory as sm
    from pagedjax import LLM

    s = cfg.sharing
    block = 16
    try:
        llm = LLM(
            model=s.model,
            load_format="dummy",
            dtype="float32",
            block_size=block,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=256,
            num_gpu_blocks_override=1 + s.max_num_seqs * -(-s.max_model_len // block),
            watermark=0.0,
            seed=s.seed,
            enable_prefix_caching=False,  # Fig. 15 measures sample / beam sharing alone
        )
    except Exception as e:  # noqa: BLE001 - report, do not fake numbers
        return {"executor": LABEL, "status": f"not available: {type(e).__name__}: {e}"}
    reqs = sm.workload(s.num_requests, s.max_model_len, s.max_output, s.seed)
    summary: dict[str, Any] = {
        "executor": LABEL,
        "model": s.model,
        "num_requests": len(reqs),
        "mean_prompt": round(float(np.mean([len(p) for p, _ in reqs])), 2),
        "mean_output": round(float(np.mean([o for _, o in reqs])), 2),
        "parallel": {},
        "beam": {},
    }
    rows = []
    runs = [("parallel", n) for n in s.parallel_n] + [("beam", k) for k in s.beam_widths]
    for mode, k in progress(runs, desc="sharing", leave=False):
        fn = sm.run_parallel if mode == "parallel" else sm.run_beam
        r = fn(llm, reqs, k, s.concurrency)
        paper = sm.PAPER.get((mode, k))
        summary[mode][str(k)] = {
            "saved_pct": round(r["saved"], 2),
            "steady_saved_pct": round(r["steady"], 2),
            "steps": r["steps"],
            "preemptions": r["preemptions"],
            "paper_pct": paper,
        }
        rows.append(dict(executor=LABEL, mode=mode, width=k, **summary[mode][str(k)]))
    write_csv(out / "sharing.csv", rows)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    labels = [f"{m} {k}" for m, k in runs]
    x = np.arange(len(runs))
    ours = [summary[m][str(k)]["steady_saved_pct"] for m, k in runs]
    paper = [sm.PAPER.get((m, k)) or 0.0 for m, k in runs]
    ax.bar(x - 0.2, ours, 0.4, label=f"ours, steady ({LABEL}, {s.model})")
    ax.bar(x + 0.2, paper, 0.4, label="paper (OPT-13B)")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("memory saved by sharing (%)")
    ax.set_title("Fig. 15: blocks saved, Alpaca-like")
    ax.legend(fontsize=7)
    save_fig(fig, out / "sharing.png", simulated=False)
    return summary


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    if "status" in summary:
        return [("sharing", summary["status"][:40], "")]
    rows = []
    for mode in ("parallel", "beam"):
        for k, v in summary[mode].items():
            paper = v["paper_pct"]
            rows.append(
                (
                    f"blocks saved, {mode} {k}, steady (real)",
                    f"{v['steady_saved_pct']:.1f}%",
                    f"{paper:.1f}%" if paper is not None else "",
                )
            )
    return rows
