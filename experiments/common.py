"""Shared pieces of the experiments: systems, traces, simulated runs, metrics, output.

A *system* is a memory policy plus scheduler settings, run by the simulated executor
with a cost model of the configured GPU; the named systems, cost models and metrics live
in the package (``pagedjax.simulator.systems``), built here from the experiment config's
``ServerSettings``.

Every number produced here is simulated; the writers label files and figures so.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.config import ServerSettings  # noqa: E402
from pagedjax.scheduler import SchedulerLimits  # noqa: E402
from pagedjax.simulator import systems  # noqa: E402
from pagedjax.simulator.simulate import (  # noqa: E402
    SimResult,
    make_trace,
    simulate,
)
from pagedjax.workloads import Workload, load_azure_conv, make_workload  # noqa: E402
from pagedjax.workloads.image_chat import image_chat  # noqa: E402

SIM_LABEL = systems.SIM_LABEL
SYSTEM_LABELS = systems.SYSTEM_LABELS
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
) -> tuple[Any, SchedulerLimits]:
    """The (memory policy, SchedulerLimits) of a named system on ``server``
    (``pagedjax.simulator.systems.build_system``, which documents the systems)."""
    return systems.build_system(
        system,
        kv_slots=server.pool_slots,  # kv_slots unless the cache is 8-bit
        block_size=server.block_size if block_size is None else block_size,
        max_model_len=server.max_model_len,
        slots=server.slots,
        max_num_batched_tokens=server.max_num_batched_tokens,
        max_num_seqs=server.max_num_seqs,
        watermark=server.watermark,
        swap_space_gib=swap_space_gib,
        model=server.model,
        tp=server.tp,
        kv_cache_dtype=server.kv_cache_dtype,
        prompt_steps=server.prompt_steps,
    )


def cost_model(server: ServerSettings) -> Any:
    """The step-time model named by server.cost_model (hashable, jit-static)."""
    return systems.make_cost_model(
        server.gpu, server.model, server.tp, calibration=server.cost_model,
        step_overhead_s=server.step_overhead_s, kv_cache_dtype=server.kv_cache_dtype,
        block_cost=server.block_cost,
    )  # fmt: skip


def workload(
    dataset: str, rate: float, duration_s: float, seed: int, spread: float, max_len: int
) -> Workload:
    """A synthetic workload (docs/workloads.md), scaled to max_len if it is under 2048.

    "chatbot" (Fig. 17): ShareGPT-like arrivals and outputs (capped at CHAT_MAX_OUTPUT),
    each prompt a conversation's history plus its query cut to its last CHAT_PROMPT
    tokens (section 6.5). The history lengths are the repository's one real multi-turn
    source, the Azure 2023 conversation trace's prompt lengths (data/traces/; a
    production chat service's prompts, which carry the conversation so far), drawn
    i.i.d. with the workload's seed and cut to CHAT_PROMPT (``chat_prompt_lens``).
    "chatbot_cap": every prompt at the cap (the assumption before issue 34: the paper
    says most prompts hit it).
    "image_chat:<family>" (issue 37): 1-4 images of that vision family's tokens plus
    ShareGPT-like text (pagedjax/workloads/image_chat.py), drawn within max_len."""
    if dataset in ("chatbot", "chatbot_cap"):
        w = make_workload("sharegpt", rate, duration_s=duration_s, seed=seed, spread_scale=spread)
        prompts = np.full(len(w), CHAT_PROMPT, np.int32)
        if dataset == "chatbot":
            prompts = chat_prompt_lens(len(w), seed)
        w = Workload(
            w.arrival_time,
            prompts,
            np.minimum(w.output_len, CHAT_MAX_OUTPUT).astype(np.int32),
            source_len=w.source_len,
            name="chatbot",
        )
    elif dataset.startswith(IMAGE_CHAT):  # "image_chat:<family>", already in max_len
        return image_chat(dataset[len(IMAGE_CHAT) :], rate, duration_s=duration_s, seed=seed,
                          max_len=max_len, spread_scale=spread)  # fmt: skip
    else:
        w = make_workload(dataset, rate, duration_s=duration_s, seed=seed, spread_scale=spread)
    return w.scale_to_context(max_len) if max_len < w.source_len else w


IMAGE_CHAT = "image_chat:"  # + a family of pagedjax.workloads.image_chat.FAMILIES


CHAT_PROMPT, CHAT_MAX_OUTPUT = 1024, 1024  # Fig. 17 (section 6.5)
_AZURE_PROMPTS: list[np.ndarray] = []  # the trace's prompt lengths, read once


def chat_prompt_lens(n: int, seed: int) -> np.ndarray:
    """int32[n] Fig. 17 prompt lengths: the Azure 2023 conversation trace's prompt lengths
    (19,366 requests, mean 1,155, median 1,020) drawn i.i.d. (rng seeded by (seed, 17),
    apart from the arrivals' and outputs' streams) and cut to the last CHAT_PROMPT tokens:
    49 % of them are at the cap, the mean is 737."""
    if not _AZURE_PROMPTS:
        _AZURE_PROMPTS.append(np.asarray(load_azure_conv().prompt_len, np.int32))
    rng = np.random.default_rng([seed, 17])
    return np.minimum(rng.choice(_AZURE_PROMPTS[0], size=n), CHAT_PROMPT).astype(np.int32)


@dataclass
class Run:
    """One simulated trace: its workload and the SimResult (numpy)."""

    workload: Workload
    result: SimResult
    duration_s: float
    stop_latency: float = math.inf  # the early-stop bound the run was given


def worker_count() -> int:
    """Threads for independent simulations: the CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_threads(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` on up to ``worker_count()`` threads, in order.

    Why threads: a simulation is one jitted XLA loop, and JAX releases the GIL while it
    runs, so independent traces (other systems, other rates) use the other cores; with
    the result caches below, a later call for the same arguments returns at once
    (measured: two systems' 200-s ShareGPT traces 23.7 s one after the other, 13.0 s on
    two threads, 2-core box). Exceptions propagate to the caller.
    """
    items = list(items)
    n = min(len(items), worker_count())
    if n <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="experiment") as pool:
        return list(pool.map(fn, items))


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
    speculative: Any = None,
    cost: Any = None,
) -> list[Run]:
    """Simulate traces (dataset, rate, duration_s, seed, spread) of one system.

    drain=False stops each at its last arrival
    (enough for window averages); otherwise at horizon_factor x duration.
    stop_latency: stop a run once its mean normalized latency provably exceeds this
    (s/token; a knee search only needs to know it exploded).
    speculative: a ``pagedjax.simulator.speculative.SpecModel`` (speculative decoding,
    simulated; experiments/speculative_curves.py) or None.
    cost: a step-time model to use instead of the server's (sensitivity runs, e.g.
    experiments/fig13_alpaca_cap.py); None: ``cost_model(server)``.
    Results are cached per arguments, so experiments sharing runs pay once.
    """
    if system in systems.SYSTEM_SERVER:  # an ablation that changes the server (paged_fp8)
        if cost is not None:
            raise ValueError(
                f"{system} changes the server's {sorted(systems.SYSTEM_SERVER[system])}, which"
                " its cost model depends on; run it without cost="
            )
        server = dataclasses.replace(server, **systems.SYSTEM_SERVER[system])
    key = (system, server, tuple(specs), block_size, drain, swap_space_gib, stop_latency,
           speculative, cost)  # fmt: skip
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
    cm = cost_model(server) if cost is None else cost
    # One trace at a time through one compiled loop (same padded shape). simulate_many
    # (vmap) is slower on CPU: under vmap every lax.cond of the scheduler becomes a select
    # that runs both branches, incl. the preemption loop (measured 9x per step for 3 lanes).
    runs = []
    for w, tr, spec in zip(loads, traces, specs, strict=True):
        res = SimResult(
            *(np.asarray(x) for x in simulate(policy, cfg, cm, tr, speculative=speculative))
        )
        runs.append(Run(w, res, spec[2], stop_latency))
    _CACHE[key] = runs
    return runs


def latency_metrics(run: Run) -> dict[str, float]:
    """``pagedjax.simulator.systems.latency_metrics`` of one run."""
    return systems.latency_metrics(run.workload, run.result, run.stop_latency)


def usage_pcts(run: Run, capacity: int) -> dict[str, float]:
    """``pagedjax.simulator.systems.usage_pcts`` of one run (Fig. 2 shares)."""
    return systems.usage_pcts(run.result, capacity)


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
