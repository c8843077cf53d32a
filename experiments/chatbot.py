"""Fig. 17: a chatbot, paged vs the three Orca variants (simulated).

The paper serves OPT-13B with ShareGPT conversations: each request's prompt is the
history plus the last query, cut to the last 1024 tokens, with at most 1024 output
tokens; most prompts hit 1024, so every Orca variant's buddy chunk is 2048 slots
whatever it predicts, and vLLM sustains 2x their request rate. Here: the "chatbot"
workload of experiments/common.py (prompts: the Azure 2023 conversation trace's history
lengths cut to 1024, or with ``chatbot.prompts: cap`` every prompt 1024 tokens;
ShareGPT-like outputs capped at 1024; Poisson arrivals), each system's knee at 0.5
s/token found by the same search as Fig. 12 (throughput_vs_rate.search), and the knee
ratio paged / each variant. Simulated, under the server's cost model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from experiments.common import (
    SIM_LABEL,
    SYSTEM_COLORS,
    SYSTEM_LABELS,
    save_fig,
    workload,
    write_csv,
)
from experiments.config import ExperimentConfig
from experiments.knee_search import ratio_text
from experiments.throughput_vs_rate import OPERATING_THRESHOLD, prefetch_searches, search
from pagedjax.memory.reservation import KINDS, ReservationPolicy, next_pow2


def settings(cfg: ExperimentConfig) -> Any:
    """throughput_vs_rate's search settings on the chatbot workload (one threshold)."""
    c = cfg.chatbot
    return dataclasses.replace(
        cfg.throughput_vs_rate,
        dataset="chatbot" if cfg.chatbot.prompts == "azure_conv" else "chatbot_cap",
        systems=list(c.systems),
        duration_s=c.duration_s,
        thresholds=[OPERATING_THRESHOLD],
        spread_scales=[],
        also_cost_models=[],
    )


def footprint_ratios(
    prompt: np.ndarray, output: np.ndarray, block_size: int, max_len: int
) -> dict[str, float]:
    """The memory arithmetic under the knee ratios: for each Orca variant, the KV slots
    its buddy chunks hold summed over every decode step of every request (pow2(R) x
    output tokens, R by the variant's own ``ReservationPolicy.reservation``), over the
    paged system's (prompt + tokens so far, plus half a block of slack on average).
    prompt, output: int[N]. This is the ratio of requests a memory-bound pool holds when
    both pools are the same size; Orca's usable pool is smaller (``orca_pool_factor`` in
    run's summary), and the paged system's bigger batches make each step longer."""
    p, o = prompt.astype(np.float64), output.astype(np.float64)
    total = (prompt + output).astype(np.int32)
    held = {}
    for kind in KINDS:
        policy = ReservationPolicy(kind, 1, max_len, max_len)
        chunk = np.asarray(next_pow2(policy.reservation(prompt, total)), np.float64)
        held[f"orca_{kind}"] = float(np.sum(chunk * o))
    paged = np.sum(p * o + o * (o + 1) / 2 + o * (block_size - 1) / 2)
    return {k: v / paged for k, v in held.items()}


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = settings(cfg)
    server = cfg.server
    systems = ["paged"] + [x for x in s.systems if x != "paged"]
    prefetch_searches(server, s, [(1.0, x) for x in systems])
    rows, knees, curves = [], {}, {}
    for system in progress(systems, desc="chatbot", leave=False):
        found, metrics = search(system, server, s, 1.0)
        knees[system] = found.knees[OPERATING_THRESHOLD]
        curves[system] = sorted(metrics.items())
        for rate, m in curves[system]:
            rows.append(dict(executor=SIM_LABEL, system=system, rate=rate, **m))
    ratios = {
        f"paged/{x}": ratio_text(knees["paged"], knees[x])[1] for x in systems if x != "paged"
    }
    # The searched trace at the paged knee (its lengths; the rate sets how many requests).
    footprint: dict[str, float] = {}
    if knees["paged"].lo is not None:
        w = workload(s.dataset, knees["paged"].lo, s.duration_s, s.seed, 1.0,
                     server.max_model_len)  # fmt: skip
        footprint = footprint_ratios(
            w.prompt_len, w.output_len, server.block_size, server.max_model_len
        )
    # Orca's buddy arena is the pool rounded up to a power of two with the tail past the
    # pool allocated for good, so chunks of pow2(max_model_len) fit only floor(pool / L)
    # times: the paged pool's usable slots over that, a memory-only estimate of how much
    # the smaller pool adds to the footprint ratio.
    pool, length = server.pool_slots, int(next_pow2(server.max_model_len))
    paged_usable = pool // server.block_size * server.block_size
    pool_factor = paged_usable / max(pool // length * length, 1)
    summary: dict[str, Any] = {
        "executor": SIM_LABEL,
        "cost_model": server.cost_model,
        "setup": {
            "prompts": cfg.chatbot.prompts,
            "max_prompt": 1024,
            "max_output": 1024,
            "duration_s": s.duration_s,
            "prompt_steps": server.prompt_steps,
        },
        f"knee@{OPERATING_THRESHOLD}": {
            "text": {x: k.text() for x, k in knees.items()},
            "ratio_text": ratios,
        },
        "kv_footprint_ratio": {
            f"paged/{x}": round(footprint[x], 3) for x in systems if x in footprint
        },
        "orca_pool_factor": round(pool_factor, 3),
    }
    write_csv(out / "chatbot.csv", rows)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for x, pts in curves.items():
        ax.plot([r for r, _ in pts], [m["norm_latency_s_per_token"] for _, m in pts], "o-",
                color=SYSTEM_COLORS[x], label=f"{SYSTEM_LABELS[x]} (knee {knees[x].text()})",
                ms=3)  # fmt: skip
    ax.axhline(OPERATING_THRESHOLD, color="k", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.2)
    ax.set_xlabel("request rate (req/s), log scale; dots = probes")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"Fig. 17 chatbot, {server.model} ({SIM_LABEL}, {server.cost_model})", fontsize=9)
    ax.legend(fontsize=7)
    save_fig(fig, out / "chatbot.png")
    return summary


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    e = summary[f"knee@{OPERATING_THRESHOLD}"]
    rows = [(f"chatbot knee ratio {k} @0.5", v, "2x") for k, v in e["ratio_text"].items()]
    return rows + [
        (f"chatbot KV footprint ratio {k} (equal pools)", f"{v:.2f}", "-")
        for k, v in summary.get("kv_footprint_ratio", {}).items()
    ]
