"""What caps Fig. 13's Alpaca bar: the paged system's batch at 30 req/s, with the limits
that could bind (scheduler rows, max_num_seqs, token budget) raised one at a time, and
Little's law beside it (arrival rate x mean time in system). Simulated, opt13b.yaml's
server (OPT-13B, A100-40GB, vllm2023 cost model), Alpaca-like 30 req/s for 120 s.

    python experiments/fig13_alpaca_cap.py [--duration 120]

If a limit capped the batch, raising it would raise the batch; if none does, the batch is
set by the step time (time in system = output tokens x step time). docs/experiments.md
("Known gaps") gives the measured numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import run_sim, usage_pcts  # noqa: E402
from experiments.config import ExperimentConfig  # noqa: E402
from pagedjax.config import load_yaml  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--rate", type=float, default=30.0)
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    cfg = load_yaml(ExperimentConfig, root / "configs" / "opt13b.yaml", [])
    base = dataclasses.replace(cfg.server, slots=256)
    variants = [
        ("base: rows 256, max_num_seqs 256, budget 2560", base, ("paged", "orca_oracle")),
        ("rows 512, max_num_seqs 512", dataclasses.replace(base, slots=512, max_num_seqs=512),
         ("paged",)),
        ("budget 8192", dataclasses.replace(base, max_num_batched_tokens=8192), ("paged",)),
    ]  # fmt: skip
    for label, server, systems in variants:
        for system in systems:
            (r,) = run_sim(system, server, [("alpaca", a.rate, a.duration, 0, 1.0)], drain=False)
            res, w = r.result, r.workload
            u = usage_pcts(r, server.pool_slots)
            n = len(w)
            fin = res.finish_time[:n].astype(float)
            first = res.first_token_time[:n].astype(float)
            ok = np.isfinite(fin)
            resid = (fin - w.arrival_time)[ok]
            ttft = (first - w.arrival_time)[np.isfinite(first)]
            print(
                f"{label} | {system}: batched {float(res.win_batched):.1f}"
                f" | {a.rate:g} req/s x {resid.mean():.2f} s in system"
                f" = {a.rate * resid.mean():.1f}"
                f" | mean step {1000 * float(res.busy_time) / int(res.steps):.1f} ms,"
                f" {int(res.steps)} steps | TTFT {ttft.mean():.3f} s | free {u['free_pct']:.1f} %"
                f" | preemptions {int(res.num_preemptions.sum())}"
                f" | mean prompt {w.prompt_len.mean():.1f}, output {w.output_len.mean():.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
