"""Multi-LoRA serving at paper scale, simulated: S-LoRA's comparison (issue 39).

Setup (config section ``lora``; model and assumptions in pagedjax/simulator/lora.py and
docs/lora.md, "Simulated: S-LoRA at paper scale"): one GPU profile (default Llama-7B's
shapes on an A100-80GB, as S-LoRA's Table 3) with one device budget for KV blocks and
adapters; S-LoRA's synthetic trace (Zipf popularity, uniform lengths, one trace for every
adapter count). For each rank set and adapter count the trace is served under unified
memory and under separate adapter pools of each ``separate_max_loras``: requests/s,
output tok/s, the largest and the mean batch, adapter loads / evictions and their copy
time. 0 adapters is the base model alone (the reference for the LoRA cost).

Claims (experiments/claims.py, ``lora.*``): S-LoRA's throughput at 2,000 adapters over
that at 5 (unified), for its S1 and S2 settings. Everything here is simulated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from experiments.common import SIM_LABEL, save_fig, write_csv
from experiments.config import ExperimentConfig
from pagedjax.simulator.cost_model import roofline
from pagedjax.simulator.lora import AdapterSpec, LoRASimConfig, simulate_lora
from pagedjax.workloads.adapters import slora_workload

GIB = 1 << 30
KEEP = ("requests_per_s", "output_tok_per_s", "max_batch", "mean_batch", "kv_blocks",
        "loads", "evictions", "load_gb", "load_s", "skips", "mean_latency_s")  # fmt: skip


def arms(s: Any) -> list[tuple[str, str, int]]:
    """(label, memory, max_loras) of each memory arm."""
    return [("unified", "unified", 1)] + [
        (f"separate_{m}", "separate", m) for m in s.separate_max_loras
    ]


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.lora
    cm = roofline(s.gpu, s.model)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {
        "executor": SIM_LABEL,
        "setup": dict(
            gpu=s.gpu,
            model=s.model,
            budget_gib=s.budget_gib,
            rate=s.rate,
            num_requests=s.num_requests,
            alpha=s.alpha,
            kernel=s.kernel,
            load=s.load,
            target_modules=list(s.target_modules),
        ),  # fmt: skip
        "rank_sets": {},
    }
    traces = {n: slora_workload(s.num_requests, s.rate, n, s.alpha, tuple(s.input_range),
                                tuple(s.output_range), s.seed)
              for n in s.num_adapters}  # fmt: skip
    jobs = [(name, ranks, n) for name, ranks in s.rank_sets.items() for n in s.num_adapters]
    for name, ranks, n in progress(jobs, desc="lora", leave=False):
        spec = AdapterSpec(tuple(ranks), tuple(s.target_modules))
        per = summary["rank_sets"].setdefault(name, {"ranks": list(ranks)})
        for label, memory, max_loras in arms(s) if n else [("unified", "none", 1)]:
            conf = LoRASimConfig(
                s.budget_gib * GIB, memory, max_loras, s.block_size,
                s.max_num_batched_tokens, s.max_num_seqs, s.kernel, s.load,
            )  # fmt: skip
            try:
                res = simulate_lora(traces[n], cm, spec, conf).summary()
            except ValueError as e:  # a separate pool that leaves no KV block
                per.setdefault(label, {})[str(n)] = {"status": str(e)}
                continue
            kept = {k: round(res[k], 4) for k in KEEP}
            per.setdefault(label, {})[str(n)] = kept
            rows.append(dict(executor=SIM_LABEL, rank_set=name, ranks="/".join(map(str, ranks)),
                             num_adapters=n, memory=label, **kept))  # fmt: skip
        if n == 0:  # the base model is every arm's reference
            for label, _, _ in arms(s)[1:]:
                per.setdefault(label, {})["0"] = per["unified"]["0"]
    for per in summary["rank_sets"].values():
        base = per.get("unified", {}).get("0", {}).get("requests_per_s")
        counts = [str(n) for n in s.num_adapters if n]
        for label, _, _ in arms(s):
            pts = per.get(label, {})
            if base:
                per[f"{label}_vs_base"] = {
                    n: round(pts[n]["requests_per_s"] / base, 4)
                    for n in counts
                    if "requests_per_s" in pts.get(n, {})
                }
        u = per.get("unified", {})
        if "5" in u and "2000" in u:
            per["unified_2000_over_5"] = round(
                u["2000"]["requests_per_s"] / u["5"]["requests_per_s"], 4
            )
    write_csv(out / "lora.csv", rows)
    _plot(summary, s, out / "lora.png")
    return summary


def _plot(summary: dict[str, Any], s: Any, path: Path) -> None:
    sets = summary["rank_sets"]
    fig, axes = plt.subplots(2, len(sets), figsize=(4.5 * len(sets), 7), squeeze=False)
    counts = [n for n in s.num_adapters if n]
    for j, (name, per) in enumerate(sets.items()):
        for label, _, _ in arms(s):
            pts = [(n, per.get(label, {}).get(str(n), {})) for n in counts]
            pts = [(n, p) for n, p in pts if "requests_per_s" in p]
            if not pts:
                continue
            xs = [n for n, _ in pts]
            axes[0, j].plot(xs, [p["requests_per_s"] for _, p in pts], "o-", label=label)
            axes[1, j].plot(xs, [p["mean_batch"] for _, p in pts], "o-", label=label)
        base = per.get("unified", {}).get("0", {})
        if base:
            axes[0, j].axhline(base["requests_per_s"], color="gray", lw=0.8, label="base model")
            axes[1, j].axhline(base["mean_batch"], color="gray", lw=0.8, label="base model")
        axes[0, j].set_title(f"{name} ranks {per['ranks']} ({SIM_LABEL})", fontsize=9)
        axes[0, j].set_ylabel("requests/s (capacity)")
        axes[1, j].set_ylabel("mean batch (sequences)")
        for ax in axes[:, j]:
            ax.set_xscale("log")
            ax.set_xlabel("adapters")
            ax.legend(fontsize=7)
    save_fig(fig, path)


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for name, per in summary["rank_sets"].items():
        u = per.get("unified", {})
        for key, vs in per.items():
            if not key.endswith("_vs_base"):
                continue
            txt = " ".join(f"{n}:{v:.2f}" for n, v in vs.items() if int(n) >= 100)
            rows.append((f"{name} {key[:-8]} tput/base @100/1000/2000", txt, ""))
        if "unified_2000_over_5" in per:
            rows.append(
                (f"{name} unified 2000/5 adapters", f"{per['unified_2000_over_5']:.3f}", "")
            )
        if "1000" in u:
            rows.append((f"{name} unified max batch @1000", f"{u['1000']['max_batch']:.0f}", ""))
    return rows
