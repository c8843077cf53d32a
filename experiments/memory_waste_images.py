"""Fig. 2 / Fig. 13 for image traffic: KV memory by category and batched requests for
Orca (Max / Pow2 / Oracle) and paged on image-chat requests (issue 37), simulated.

Setup (config section ``memory_waste_images``): the server of the config (its model's
geometry, GPU and KV pool, paper-mode scheduling) with ``max_model_len`` as the context
(LLaVA-1.5-7B: 4,096; Orca (Max) reserves it per request); requests of 1-4 images of the
family's tokens plus ShareGPT-like text (pagedjax/workloads/image_chat.py) at ``rate``
(default "token_matched": the text experiment's operating point scaled to the same token
load; "knee": the paged system's knee on the image workload itself) for ``duration_s``.
Shares as memory_waste.py (steady window, whole pool); the batched requests per step are
Fig. 13's measure. No paper values: the paper ran text only, and no claim is judged on
these numbers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from experiments.common import (
    IMAGE_CHAT,
    SIM_LABEL,
    run_sim,
    run_threads,
    usage_pcts,
    workload,
    write_csv,
)
from experiments.config import ExperimentConfig
from experiments.memory_waste import SYSTEMS, plot_shares
from experiments.throughput_vs_rate import OPERATING_THRESHOLD, resolve_rate, search

MEAN_SAMPLE = 20_000  # requests drawn to compare mean tokens (token_matched)


def resolve_image_rate(cfg: ExperimentConfig) -> tuple[float, dict[str, Any]]:
    """The image workload's rate and how it was chosen."""
    s = cfg.memory_waste_images
    if s.rate == "knee":
        server = image_server(cfg)
        tv = dataclasses.replace(
            cfg.throughput_vs_rate, dataset=IMAGE_CHAT + s.family, systems=["paged"],
            duration_s=s.duration_s, seed=s.seed, thresholds=[OPERATING_THRESHOLD],
            spread_scales=[], also_cost_models=[],
        )  # fmt: skip
        found, _ = search("paged", server, tv, 1.0)
        k = found.knees[OPERATING_THRESHOLD]
        rate = k.lo if k.lo is not None else k.hi
        return float(rate), {
            "rule": f"knee: paged knee at {OPERATING_THRESHOLD} s/token on this workload",
            "knee": k.to_json(),
            "bracketed": k.bracketed,
        }
    if s.rate != "token_matched":
        return float(s.rate), {"rule": "set in the config"}
    text_rate, op = resolve_rate(cfg, cfg.memory_waste.rate)
    text = workload(cfg.memory_waste.dataset, 1.0, MEAN_SAMPLE, 0, 1.0, cfg.server.max_model_len)
    image = workload(IMAGE_CHAT + s.family, 1.0, MEAN_SAMPLE, 0, 1.0, s.max_model_len)
    t_mean = float(np.mean(text.total_len[:MEAN_SAMPLE]))
    i_mean = float(np.mean(image.total_len[:MEAN_SAMPLE]))
    return text_rate * t_mean / i_mean, {
        "rule": "token_matched: text operating point x mean text tokens / mean image tokens",
        "text_rate": text_rate,
        "text_mean_tokens": round(t_mean, 1),
        "image_mean_tokens": round(i_mean, 1),
        "text_operating_point": op,
    }


def image_server(cfg: ExperimentConfig) -> Any:
    """The config's server with the section's context. The step's token budget is raised
    to it if smaller: paper-mode scheduling (no chunked prefill) rejects a prompt larger
    than one step's budget, and vLLM 0.1 refused to start with max_num_batched_tokens <
    max_model_len for the same reason."""
    s = cfg.memory_waste_images
    budget = max(cfg.server.max_num_batched_tokens, s.max_model_len)
    return dataclasses.replace(
        cfg.server, max_model_len=s.max_model_len, max_num_batched_tokens=budget
    )


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.memory_waste_images
    server = image_server(cfg)
    rate, how = resolve_image_rate(cfg)
    spec = [(IMAGE_CHAT + s.family, rate, s.duration_s, s.seed, 1.0)]
    run_threads(lambda system: run_sim(system, server, spec, drain=False), SYSTEMS)  # cached
    summary: dict[str, Any] = {"executor": SIM_LABEL, "rate_choice": how}
    rows = []
    for system in progress(SYSTEMS, desc="memory_waste_images", leave=False):
        r = run_sim(system, server, spec, drain=False)[0]
        u = usage_pcts(r, server.pool_slots)
        batched = float(r.result.win_batched)
        rejected = int(np.asarray(r.result.rejected)[: len(r.workload)].sum())
        rows.append(
            dict(executor=SIM_LABEL, system=system, dataset=spec[0][0], rate=rate,
                 duration_s=s.duration_s, seed=s.seed, avg_batched=batched,
                 rejected=rejected, **u)
        )  # fmt: skip
        summary[system] = {k: round(v, 2) for k, v in u.items()} | {
            "avg_batched": round(batched, 2),
            "rejected": rejected,
        }
    w = run_sim("paged", server, spec, drain=False)[0].workload
    summary["batched_ratio_paged_over"] = {
        x: round(summary["paged"]["avg_batched"] / summary[x]["avg_batched"], 3)
        for x in SYSTEMS[:3]
        if summary[x]["avg_batched"] > 0
    }
    summary["setup"] = dict(
        dataset=spec[0][0], family=s.family, rate=rate, duration_s=s.duration_s,
        requests=len(w), mean_prompt=round(float(w.prompt_len.mean()), 1),
        mean_output=round(float(w.output_len.mean()), 1), kv_slots=server.pool_slots,
        model=server.model, max_model_len=s.max_model_len, warmup_frac=server.warmup_frac,
        max_num_batched_tokens=server.max_num_batched_tokens,
    )  # fmt: skip
    write_csv(out / "memory_waste_images.csv", rows)
    plot_shares(summary, out / "memory_waste_images.png", paper=False)
    return summary


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = [(f"token states % {x}", f"{summary[x]['token_states_pct']:.1f}", "") for x in SYSTEMS]
    rows += [(f"batched reqs {x}", f"{summary[x]['avg_batched']:.2f}", "") for x in SYSTEMS]
    rows += [(f"batched paged/{x}", f"{v:.2f}", "")
             for x, v in summary["batched_ratio_paged_over"].items()]  # fmt: skip
    return rows
