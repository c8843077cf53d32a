"""KV tiers, simulated at paper scale: TTFT and throughput against the working set.

Setup (config section ``kv_tiers``; model and assumptions in
pagedjax/simulator/kv_tiers.py and docs/kv_tiers.md, "Simulated tiers"): for each GPU
profile (a dense geometry on its roofline, a device KV pool of ``device_pool_gib``, a
host tier of ``host_tier_gib`` with that GPU's host link), conversations of the chosen
workload are added until their working set (distinct blocks of every prompt and reply)
reaches each multiple of the device pool. Each point is served twice per arm (host tier
off / on):

- at the profile's ``rate`` (req/s, arrivals in rounds, closed loop per conversation):
  TTFT p50 / p90 and the hit rate per tier;
- at rate = inf (every conversation's first turn at t = 0, each next turn as soon as its
  reply ends): output tokens per second, the server's throughput with that many
  conversations in flight.

``real_engine: true`` also runs benchmarks/kv_tiers.py (the real engine on a small model,
tier off / on) in a subprocess and records its printed lines; it is off by default
(minutes on CPU). Simulated numbers are labelled so.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from experiments.common import SIM_LABEL, save_fig, write_csv
from experiments.config import ExperimentConfig, KvTiersSettings, TierProfile
from pagedjax.simulator.cost_model import roofline
from pagedjax.simulator.kv_tiers import TierSimConfig, host_link, simulate_tiers
from pagedjax.workloads.conversations import ConversationWorkload, agentic, multi_turn

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def make_workload(s: KvTiersSettings, p: TierProfile, n: int, rate: float) -> ConversationWorkload:
    """``n`` conversations of the section's workload (the first n of one population)."""
    if s.workload == "agentic":
        return agentic(n, s.turns, rate, seed=s.seed, context_len=s.agent_context_len,
                       max_len=p.max_model_len)  # fmt: skip
    return multi_turn(n, s.turns, rate, seed=s.seed, max_len=p.max_model_len)


def conversation_counts(s: KvTiersSettings, p: TierProfile, targets: list[float]) -> list[int]:
    """For each target (blocks), the fewest conversations whose working set reaches it:
    one population, grown by doubling until it covers the largest target."""
    n = 8
    while True:
        cum = make_workload(s, p, n, 1.0).cumulative_working_set(s.block_size)
        if cum[-1] >= max(targets):
            return [int(np.searchsorted(cum, t)) + 1 for t in targets]
        n *= 2


def _blocks(gib: float, p: TierProfile, block_size: int) -> int:
    geom = roofline(p.gpu, p.model).model
    return int(gib * GIB // (block_size * geom.kv_bytes_per_token_per_gpu))


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.kv_tiers
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"executor": SIM_LABEL, "workload": s.workload, "profiles": {}}
    for p in s.profiles:
        cm = roofline(p.gpu, p.model)
        dev = _blocks(p.device_pool_gib, p, s.block_size)
        host = _blocks(p.host_tier_gib, p, s.block_size)
        link = host_link(p.gpu)
        key = f"{p.gpu}/{p.model}"
        prof: dict[str, Any] = dict(
            gpu=p.gpu, model=p.model, device_blocks=dev, host_blocks=host,
            device_pool_gib=p.device_pool_gib, host_tier_gib=p.host_tier_gib, rate=p.rate,
            host_link_gb_per_s=link.effective_bytes_per_s / 1e9,
            copy_latency_us=link.copy_latency_s * 1e6, points=[],
        )  # fmt: skip
        arms = [("off", 0)] + ([("on", host)] if host else [])
        counts = conversation_counts(s, p, [x * dev for x in s.working_set_multiples])
        points = list(zip(s.working_set_multiples, counts, strict=True))
        for x, n in progress(points, desc=f"kv_tiers {key}", leave=False):
            point: dict[str, Any] = {"working_set_x": x, "conversations": n}
            w = make_workload(s, p, n, p.rate)
            w_sat = make_workload(s, p, n, math.inf)
            for arm, h in arms:
                tc = TierSimConfig(dev, h, s.block_size, s.max_num_batched_tokens,
                                   s.max_num_seqs, s.reload)  # fmt: skip
                at_rate = simulate_tiers(w, cm, tc, link).summary()
                sat = simulate_tiers(w_sat, cm, tc, link).summary()
                row = dict(
                    executor=SIM_LABEL, gpu=p.gpu, model=p.model, workload=s.workload,
                    working_set_x=x, working_set_blocks=w.working_set_blocks(s.block_size),
                    device_blocks=dev, host_blocks=h, conversations=n, requests=len(w),
                    rate=p.rate, ttft_p50_ms=at_rate["ttft_p50_ms"],
                    ttft_p90_ms=at_rate["ttft_p90_ms"], device_hit_rate=at_rate["device_hit_rate"],
                    host_hit_rate=at_rate["host_hit_rate"], reloaded_gb=at_rate["reloaded_gb"],
                    served_req_per_s=at_rate["requests_per_s"],
                    saturated_output_tok_per_s=sat["output_tok_per_s"],
                    saturated_hit_rate=sat["hit_rate"],
                )  # fmt: skip
                rows.append(row)
                point[arm] = {k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()
                              if k not in ("executor", "gpu", "model", "workload")}  # fmt: skip
            if "on" in point:
                point["ttft_p50_ratio_off_on"] = round(
                    point["off"]["ttft_p50_ms"] / point["on"]["ttft_p50_ms"], 3
                )
                point["throughput_ratio_on_off"] = round(
                    point["on"]["saturated_output_tok_per_s"]
                    / point["off"]["saturated_output_tok_per_s"], 3
                )  # fmt: skip
            prof["points"].append(point)
        summary["profiles"][key] = prof
    write_csv(out / "kv_tiers.csv", rows)
    _plot(summary, out / "kv_tiers.png")
    if s.real_engine:
        summary["real_engine"] = run_real_engine(s)
    return summary


def run_real_engine(s: KvTiersSettings) -> dict[str, Any]:
    """benchmarks/kv_tiers.py in a subprocess (the real engine, tier off / on); its
    printed TTFT lines, parsed, and the raw output's last lines."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kv_tiers.py"), *s.real_engine_args]
    env_path = f"{ROOT}:{ROOT / 'benchmarks'}"
    env = dict(os.environ, PYTHONPATH=env_path + ":" + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=s.real_engine_timeout_s,
                              env=env, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {s.real_engine_timeout_s} s", "command": cmd}
    res: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": proc.returncode}
    res.update(parse_real_engine(proc.stdout))
    res["output_tail"] = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
    return res


_TIER_LINE = re.compile(
    r"tier (on|off)\s*: TTFT p50\s+([\d.]+) ms\s+p90\s+([\d.]+) ms\s+"
    r"prompt tokens computed\s+(\d+)"
)


def parse_real_engine(stdout: str) -> dict[str, Any]:
    """benchmarks/kv_tiers.py's printed lines -> {"off": {...}, "on": {...},
    "greedy_outputs_equal": bool}."""
    res: dict[str, Any] = {}
    for m in _TIER_LINE.finditer(stdout):
        res[m.group(1)] = dict(ttft_p50_ms=float(m.group(2)), ttft_p90_ms=float(m.group(3)),
                               prompt_tokens_computed=int(m.group(4)))  # fmt: skip
    res["greedy_outputs_equal"] = "greedy outputs equal: True" in stdout
    return res


def _plot(summary: dict[str, Any], path: Path) -> None:
    profs = summary["profiles"]
    fig, axes = plt.subplots(2, len(profs), figsize=(5 * len(profs), 7), squeeze=False)
    for j, (key, prof) in enumerate(profs.items()):
        xs = [pt["working_set_x"] for pt in prof["points"]]
        for arm, color in (("off", "tab:red"), ("on", "tab:blue")):
            if not all(arm in pt for pt in prof["points"]):
                continue
            label = "host tier " + arm
            p50 = [pt[arm]["ttft_p50_ms"] for pt in prof["points"]]
            p90 = [pt[arm]["ttft_p90_ms"] for pt in prof["points"]]
            tput = [pt[arm]["saturated_output_tok_per_s"] for pt in prof["points"]]
            axes[0, j].plot(xs, p50, "o-", color=color, label=f"{label}, p50")
            axes[0, j].plot(xs, p90, "s--", color=color, alpha=0.6, label=f"{label}, p90")
            axes[1, j].plot(xs, tput, "o-", color=color, label=label)
        axes[0, j].set_title(f"{key}, {prof['rate']} req/s ({SIM_LABEL})", fontsize=9)
        axes[0, j].set_ylabel("TTFT (ms)")
        axes[0, j].set_yscale("log")
        axes[1, j].set_ylabel("output tok/s at saturation")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("working set / device pool")
            ax.axvline(1.0, color="gray", lw=0.5)
            ax.legend(fontsize=7)
    save_fig(fig, path)


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for key, prof in summary["profiles"].items():
        for pt in prof["points"]:
            x = pt["working_set_x"]
            off = pt["off"]
            on = pt.get("on")
            ttft = f"{off['ttft_p50_ms']:.0f}" + (f"/{on['ttft_p50_ms']:.0f}" if on else "")
            rows.append((f"{key} {x:g}x TTFT p50 ms off/on", ttft, ""))
            if on:
                rows.append((f"{key} {x:g}x sat. tok/s off/on",
                             f"{off['saturated_output_tok_per_s']:.0f}/"
                             f"{on['saturated_output_tok_per_s']:.0f}", ""))  # fmt: skip
    if "real_engine" in summary:
        r = summary["real_engine"]
        for arm in ("off", "on"):
            if arm in r:
                rows.append((f"real engine TTFT p50 ms, tier {arm}",
                             f"{r[arm]['ttft_p50_ms']:.1f}", ""))  # fmt: skip
    return rows
