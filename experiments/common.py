"""Shared pieces of the experiments: systems, traces, simulated runs, metrics, output.

A *system* is a memory policy plus scheduler settings, run by the simulated executor
(``pagedjax.simulator.simulate``) with a roofline cost model of the configured GPU:

| system | memory policy | scheduler |
|---|---|---|
| paged | PagedPolicy (block_size) | paper mode: FCFS, 2560 tokens, 256 seqs, 1% watermark |
| orca_max / orca_pow2 / orca_oracle | ReservationPolicy (buddy) | the same paper mode |
| ft_static | Orca Max reservations | static mode: batches of B = pool // max_len |

Every number produced here is simulated; the writers label files and figures so.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.config import ServerSettings  # noqa: E402
from pagedjax.memory.paged_policy import PagedPolicy  # noqa: E402
from pagedjax.memory.reservation import ReservationPolicy  # noqa: E402
from pagedjax.memory.static_batching import static_batch_size  # noqa: E402
from pagedjax.scheduler import SchedulerConfig  # noqa: E402
from pagedjax.simulator.cost_model import calibrated, model_geometry, roofline  # noqa: E402
from pagedjax.simulator.simulate import (  # noqa: E402
    SimResult,
    make_trace,
    simulate,
)
from pagedjax.workloads import Workload, make_workload  # noqa: E402

SIM_LABEL = "simulated"
SYSTEM_LABELS = {
    "orca_max": "Orca (Max)",
    "orca_pow2": "Orca (Pow2)",
    "orca_oracle": "Orca (Oracle)",
    "paged": "paged (vLLM)",
    "ft_static": "FasterTransformer-like (static)",
}
SYSTEM_COLORS = {
    "orca_max": "red",
    "orca_pow2": "orange",
    "orca_oracle": "green",
    "paged": "blue",
    "ft_static": "#808080",
}


def build_system(
    system: str,
    server: ServerSettings,
    block_size: int | None = None,
    swap_space_gib: float | None = None,
) -> tuple[Any, SchedulerConfig]:
    """The (memory policy, scheduler config) of a named system.

    swap_space_gib (paged only): preempt by swap into a host pool of that size (capped
    at every slot's whole block table) instead of by recompute.
    """
    bs = server.block_size if block_size is None else block_size
    n, mlen, cap = server.slots, server.max_model_len, server.kv_slots
    cfg = dict(
        max_seqs=n,
        max_num_batched_tokens=server.max_num_batched_tokens,
        max_num_seqs=min(server.max_num_seqs, n),
        max_model_len=mlen,
        mode="paper",
    )
    if swap_space_gib is not None and system != "paged":
        raise ValueError(f"swap preemption is simulated for the paged system, not {system!r}")
    if system == "paged" and swap_space_gib is not None:
        geom = model_geometry(server.model, server.tp)
        per_block = bs * geom.kv_bytes_per_token // geom.tp  # one GPU's share
        host = min(int(swap_space_gib * (1 << 30)) // per_block, n * -(-mlen // bs))
        policy = PagedPolicy(
            cap // bs + 1, bs, n, -(-mlen // bs), server.watermark, num_host_blocks=host
        )
        cfg.update(preemption_mode="swap")
    elif system == "paged":
        policy = PagedPolicy(cap // bs + 1, bs, n, -(-mlen // bs), server.watermark)
    elif system in ("orca_max", "orca_pow2", "orca_oracle"):
        policy = ReservationPolicy(system.split("_")[1], n, cap, mlen, server.watermark)
    elif system == "ft_static":
        b = min(static_batch_size(cap, mlen), n)
        policy = ReservationPolicy("max", n, cap, mlen, server.watermark)
        # The budget must take B whole prompts: a static batch is prefilled at once.
        cfg.update(mode="static", static_batch_size=b, max_num_batched_tokens=b * mlen)
    else:
        raise ValueError(f"unknown system {system!r}")
    return policy, SchedulerConfig(**cfg)


def cost_model(server: ServerSettings) -> Any:
    """The step-time model named by server.cost_model (hashable, jit-static)."""
    if server.cost_model != "roofline":
        return calibrated(server.cost_model, server.gpu, server.model, server.tp)
    return roofline(server.gpu, server.model, server.tp, step_overhead_s=server.step_overhead_s)


def workload(
    dataset: str, rate: float, duration_s: float, seed: int, spread: float, max_len: int
) -> Workload:
    """A synthetic workload (docs/workloads.md), scaled to max_len if it is under 2048."""
    w = make_workload(dataset, rate, duration_s=duration_s, seed=seed, spread_scale=spread)
    return w.scale_to_context(max_len) if max_len < w.source_len else w


@dataclass
class Run:
    """One simulated trace: its workload and the SimResult (numpy)."""

    workload: Workload
    result: SimResult
    duration_s: float
    stop_latency: float = math.inf  # the early-stop bound the run was given


_CACHE: dict[tuple, list[Run]] = {}


def run_sim(
    system: str,
    server: ServerSettings,
    specs: list[tuple[str, float, float, int, float]],
    *,
    block_size: int | None = None,
    drain: bool = True,
    swap_space_gib: float | None = None,
    stop_latency: float = math.inf,
) -> list[Run]:
    """Simulate traces (dataset, rate, duration_s, seed, spread) of one system.

    drain=False stops each at its last arrival
    (enough for window averages); otherwise at horizon_factor x duration.
    stop_latency: stop a run once its mean normalized latency provably exceeds this
    (s/token; a knee search only needs to know it exploded).
    Results are cached per arguments, so experiments sharing runs pay once.
    """
    key = (system, server, tuple(specs), block_size, drain, swap_space_gib, stop_latency)
    if key in _CACHE:
        return _CACHE[key]
    policy, cfg = build_system(system, server, block_size, swap_space_gib)
    loads = [workload(d, r, dur, s, sp, server.max_model_len) for d, r, dur, s, sp in specs]
    pad = max(len(w) for w in loads)
    # Powers of two from 512: few shapes, so experiments share compiled simulators.
    pad = max(512, 1 << max(pad - 1, 0).bit_length())
    traces = []
    for w, (_, _, dur, _, _) in zip(loads, specs, strict=True):
        horizon = dur * server.horizon_factor if drain else float(w.arrival_time[-1])
        # Steady window: from max(warm-up, first completion) to the last arrival.
        start = server.warmup_frac * dur
        traces.append(
            make_trace(
                w.arrival_time, w.prompt_len, w.output_len, pad, horizon, start, stop_latency
            )
        )
    cm = cost_model(server)
    # One trace at a time through one compiled loop (same padded shape). simulate_many
    # (vmap) is slower on CPU: under vmap every lax.cond of the scheduler becomes a select
    # that runs both branches, incl. the preemption loop (measured 9x per step for 3 lanes).
    runs = []
    for w, tr, spec in zip(loads, traces, specs, strict=True):
        res = SimResult(*(np.asarray(x) for x in simulate(policy, cfg, cm, tr)))
        runs.append(Run(w, res, spec[2], stop_latency))
    _CACHE[key] = runs
    return runs


def latency_metrics(run: Run) -> dict[str, float]:
    """Mean normalized latency (s/token), throughput and completion of one run.

    Unfinished requests at the horizon count with their latency so far, a lower bound;
    ``unfinished`` says how many, so an exploded point is recognisable.
    """
    w, r = run.workload, run.result
    n = len(w)
    fin = r.finish_time[:n].astype(np.float64)
    ok = np.isfinite(fin) & ~r.rejected[:n]
    # Unfinished: the wait so far; not yet arrived (a run stopped early): 0. Both lower
    # bounds, so the mean is one too.
    end = np.maximum(np.where(np.isfinite(fin), fin, float(r.clock)), w.arrival_time)
    lat = end - w.arrival_time
    norm = lat / w.output_len
    first = r.first_token_time[:n].astype(np.float64)
    ttft = (first - w.arrival_time)[np.isfinite(first)]
    t_end = float(np.max(fin[ok])) if ok.any() else float(r.clock)
    return {
        "requests": n,
        "finished": int(ok.sum()),
        "unfinished": int(n - ok.sum() - r.rejected[:n].sum()),
        "rejected": int(r.rejected[:n].sum()),
        "norm_latency_s_per_token": float(np.mean(norm)) if n else math.nan,
        "mean_latency_s": float(np.mean(lat)) if n else math.nan,
        "mean_ttft_s": float(np.mean(ttft)) if len(ttft) else math.nan,
        "throughput_req_s": float(ok.sum() / t_end) if t_end > 0 else math.nan,
        "throughput_tok_s": float(w.output_len[ok].sum() / t_end) if t_end > 0 else math.nan,
        "preemptions": int(r.num_preemptions[:n].sum()),
        "steps": int(r.steps),
        "sim_time_s": float(r.clock),
        "stopped_early": bool(float(r.latency_bound) > run.stop_latency),
    }


def usage_pcts(run: Run, capacity: int) -> dict[str, float]:
    """Fig. 2 shares (% of the pool) over the steady window, and the token share of the
    allocated memory (pool minus external fragmentation and free).

    ``external_frag_pct`` is the paper's last category, "external fragmentation &
    others" (free memory included, as Orca (Max)'s 8.9 % is); ``free_pct`` is its free
    part (held by nothing) and ``external_only_pct`` the rest (buddy rounding slack)."""
    u = run.result.win_usage.astype(np.float64)
    pct = 100.0 * u / capacity
    alloc = u[0] + u[1] + u[2]
    free = 100.0 * float(run.result.win_free) / capacity
    return {
        "token_states_pct": float(pct[0]),
        "reserved_pct": float(pct[1]),
        "internal_frag_pct": float(pct[2]),
        "external_frag_pct": float(pct[3]),
        "free_pct": free,
        "external_only_pct": max(float(pct[3]) - free, 0.0),
        "token_of_allocated_pct": float(100.0 * u[0] / alloc) if alloc > 0 else math.nan,
        "window_s": float(run.result.win_time),
    }


# --- output -------------------------------------------------------------------------


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Rows of dicts to CSV (columns: union of keys in first-seen order)."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with path.open("w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=cols)
        wr.writeheader()
        wr.writerows(rows)
    return path


def save_fig(fig: plt.Figure, path: Path, simulated: bool = True) -> Path:
    if simulated:
        fig.text(0.99, 0.01, SIM_LABEL.upper(), ha="right", va="bottom", fontsize=8, color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def dump_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
