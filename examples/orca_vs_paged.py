"""Ablation (a): one Azure-format trace under Orca (Max / Oracle) and paged memory, in the
simulator, with a block size of our choosing.

    python examples/orca_vs_paged.py [--tiny] [--trace path.csv] [--block-size 32]

Any CSV with the Azure columns works (``pagedjax.load_trace``); the default is the
bundled conversation trace. Its prompts run past OPT-13B's 2,048-token context, so the
lengths are scaled into it. Every number printed is simulated (OPT-13B on one A100-40GB,
roofline cost model); the README explains the columns.
"""

from __future__ import annotations

import argparse

import pagedjax as pj
from pagedjax.workloads import DEFAULT_AZURE_CONV_PATH


def main(tiny: bool = False, trace: str | None = None, block_size: int = 32) -> dict:
    # The whole ablation: a trace, a cost model, three systems, one call each.
    w = pj.load_trace(trace or DEFAULT_AZURE_CONV_PATH, end_s=20 if tiny else 300)
    w = w.scale_to_context(2048)  # OPT-13B's context
    cm = pj.make_cost_model("A100-40GB", "opt-13b")
    runs = {name: pj.simulate_system(name, w, cost_model=cm, block_size=block_size)
            for name in ("orca_max", "orca_oracle", "paged")}  # fmt: skip
    print(f"{len(w)} requests over {w.arrival_time[-1]:.0f} s, block_size={block_size} (simulated)")
    print(f"{'system':<12} {'s/token':>8} {'req/s':>7} {'preempt':>7} {'finished':>8}")
    out = {}
    for name, run in runs.items():
        m = out[name] = run.metrics()
        print(f"{name:<12} {m['norm_latency_s_per_token']:>8.3f} {m['throughput_req_s']:>7.2f}"
              f" {m['preemptions']:>7d} {m['finished']:>8d}")  # fmt: skip
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="20 s of the trace (CI)")
    ap.add_argument("--trace", default=None, help="an Azure-format CSV")
    ap.add_argument("--block-size", type=int, default=32)
    a = ap.parse_args()
    main(a.tiny, a.trace, a.block_size)
