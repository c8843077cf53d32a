"""Real executor: tokens/s, TTFT and TPOT percentiles of pagedjax.LLM on this machine,
serving a ShareGPT-like Poisson trace scaled to the (small) model's context at each rate
of the ``engine`` section. These are measured, not simulated (executor: real); a
scaled-down model on CPU says nothing about GPU speed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from experiments.common import save_fig, write_csv
from experiments.config import ExperimentConfig
from experiments.real_serving import metrics, real_runs


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.engine
    try:
        real = real_runs(s, progress)
    except Exception as e:  # noqa: BLE001 - report, do not fake numbers
        return {"executor": "real", "status": f"not available: {type(e).__name__}: {e}"}
    rows = []
    summary: dict[str, Any] = {
        "executor": "real",
        "model": s.model,
        "max_model_len": s.max_model_len,
        "warmup": real["warmup"],
        "rates": {},
    }
    for rate, w, r in zip(s.rates, real["loads"], real["reals"], strict=True):
        m = metrics(w, r)
        rows.append(dict(executor="real", model=s.model, rate=rate, requests=len(w), **m))
        summary["rates"][str(rate)] = {k: round(v, 4) for k, v in m.items()}
    write_csv(out / "engine_throughput.csv", rows)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(s.rates, [r["throughput_tok_s"] for r in rows], "o-")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s (real, this CPU)")
    ax.set_title(f"engine throughput, {s.model} (real)")
    save_fig(fig, out / "engine_throughput.png", simulated=False)
    return summary


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    if "status" in summary:
        return [("engine", summary["status"][:40], "")]
    return [
        (f"tok/s @{r} req/s (real)", f"{m['throughput_tok_s']:.1f}", "")
        for r, m in summary["rates"].items()
    ]
