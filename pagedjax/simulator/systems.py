"""The paper's named systems, cost models by name, and one call to simulate a workload.

A *system* is a memory policy plus scheduler settings, run by the simulated executor
(``simulate.simulate``) with a step-time cost model:

| system | memory policy | scheduler |
|---|---|---|
| paged | PagedPolicy (block_size) | paper mode: FCFS, 2560 tokens, 256 seqs, 1% watermark |
| orca_max / orca_pow2 / orca_oracle | ReservationPolicy (buddy) | the same paper mode |

Paper mode composes steps by ``prompt_steps`` (``SchedulerLimits``): "mixed" (default;
the paper's section 4.3, its pre-release scheduler and vLLM v0.1.0-v0.1.2) or
"separate" (vLLM v0.1.3-v0.3's prompt-only / decode-only steps), the same for every
paper-mode system (the paper's Orca ran on the same engine and scheduler).
| ft_static | Orca Max reservations | static mode: batches of B = pool // max_len |

The defaults describe the paper's OPT-13B on one A100-40GB (15,728 KV slots). An
ablation outside the repository builds a system in one call and swaps one piece (a block
size, a policy of its own, a scheduler priority) without copying this code::

    import pagedjax as pj
    w = pj.load_trace("azure.csv", end_s=300)          # any CSV with the Azure columns
    cm = pj.make_cost_model("A100-40GB", "opt-13b")
    for name in ("paged", "orca_max", "orca_oracle"):
        print(name, pj.simulate_system(name, w, cost_model=cm).metrics())

Every number produced here is simulated (``SIM_LABEL``); label it so where it appears.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.memory.reservation import ReservationPolicy
from pagedjax.memory.static_batching import static_batch_size
from pagedjax.scheduler import SchedulerLimits
from pagedjax.simulator.cost_model import (
    KERNEL_BLOCK_OVERHEAD_TOKENS,
    calibrated,
    model_geometry,
    roofline,
)
from pagedjax.simulator.request_blocks import RequestBlockSizePolicy
from pagedjax.simulator.simulate import SimResult, make_trace, simulate
from pagedjax.workloads import Workload

SIM_LABEL = "simulated"
SYSTEMS = ("paged", "orca_max", "orca_pow2", "orca_oracle", "ft_static")
# Ablations the paper could not run (issue 34), built by build_system like the others:
# vattention_64k / vattention_2m: vAttention-style contiguous virtual memory (physical
# pages of 64 KiB / 2 MiB per layer's K or V mapped on demand, no block table, so the
# kernel reads contiguous KV: no per-block cost); paged_fp8: the paged system over an
# fp8 KV pool in the same memory (SYSTEM_SERVER: the caller's server takes
# kv_cache_dtype="fp8", so the pool holds 2x the tokens and a step reads half the bytes).
ABLATIONS = ("vattention_64k", "vattention_2m", "paged_fp8", "paged_block_per_request")
PAGE_BYTES = {"vattention_64k": 64 << 10, "vattention_2m": 2 << 20}
SYSTEM_SERVER: dict[str, dict[str, Any]] = {"paged_fp8": {"kv_cache_dtype": "fp8"}}
SYSTEM_LABELS = {
    "orca_max": "Orca (Max)",
    "orca_pow2": "Orca (Pow2)",
    "orca_oracle": "Orca (Oracle)",
    "paged": "paged (vLLM)",
    "ft_static": "FasterTransformer-like (static)",
    "vattention_64k": "vAttention-like, 64 KiB pages",
    "vattention_2m": "vAttention-like, 2 MiB pages",
    "paged_fp8": "paged, fp8 KV pool",
    "paged_block_per_request": "paged, block size per request",
}


@dataclass(frozen=True)
class VirtualContiguousPolicy(PagedPolicy):
    """vAttention-style memory: each request's KV is one contiguous virtual range per
    layer and K/V, backed by physical pages mapped on demand. Allocation is the paged
    pool's (a page of ``block_size`` tokens, granted as the sequence grows), but the
    kernel reads contiguous memory: no block table, no per-block cost
    (``contiguous_kernel``: the simulator skips ``block_time``)."""

    contiguous_kernel: bool = True


def page_tokens(page_bytes: int, model: str, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """Tokens one physical page holds for one layer's K (or V), rounded down to a power
    of two (the pool's block size must be one); at least 1."""
    g = model_geometry(model, tp, kv_cache_dtype)
    per_token = g.kv_bytes_per_token_per_gpu / (2 * g.num_layers)
    n = max(1, int(page_bytes // per_token))
    return 1 << (n.bit_length() - 1)


def build_system(
    system: str,
    *,
    kv_slots: int = 15728,
    block_size: int = 16,
    max_model_len: int = 2048,
    slots: int = 256,
    max_num_batched_tokens: int = 2560,
    max_num_seqs: int = 256,
    watermark: float = 0.01,
    swap_space_gib: float | None = None,
    model: str = "opt-13b",
    tp: int = 1,
    kv_cache_dtype: str = "auto",
    prompt_steps: str = "mixed",
) -> tuple[Any, SchedulerLimits]:
    """The (memory policy, SchedulerLimits) of a named system (``SYSTEMS``).

    kv_slots: KV-cache capacity in tokens. slots: scheduler rows (waiting + running);
    at most min(max_num_seqs, slots) run at once. block_size: the paged pool's (the
    others ignore it). swap_space_gib (paged only): preempt by swap into a host pool of
    that size (capped at every slot's whole block table; its bytes per block from
    ``model``, ``tp`` and ``kv_cache_dtype``) instead of by recompute. Raises ValueError
    for an unknown name. kv_slots is the capacity in the cache's own dtype: an 8-bit cache
    in the same memory holds more (``ModelGeometry.kv_capacity_ratio``). prompt_steps:
    the paper-mode systems' step composition (``SchedulerLimits.prompt_steps``); ft_static
    keeps its static batches.
    """
    bs, n, mlen, cap = block_size, slots, max_model_len, kv_slots
    cfg: dict[str, Any] = dict(
        max_seqs=n,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=min(max_num_seqs, n),
        max_model_len=mlen,
        mode="paper",
        prompt_steps=prompt_steps,
    )
    if swap_space_gib is not None and system != "paged":
        raise ValueError(f"swap preemption is simulated for the paged system, not {system!r}")
    if system == "paged" and swap_space_gib is not None:
        geom = model_geometry(model, tp, kv_cache_dtype)
        per_block = int(bs * geom.kv_bytes_per_token_per_gpu)  # one GPU's share
        host = min(int(swap_space_gib * (1 << 30)) // per_block, n * -(-mlen // bs))
        policy: Any = PagedPolicy(
            cap // bs + 1, bs, n, -(-mlen // bs), watermark, num_host_blocks=host
        )
        cfg.update(preemption_mode="swap")
    elif system in ("paged", "paged_fp8"):  # paged_fp8: the caller's kv_slots are fp8's
        policy = PagedPolicy(cap // bs + 1, bs, n, -(-mlen // bs), watermark)
    elif system == "paged_block_per_request":  # request_blocks.py: 8-256 tokens each
        policy = RequestBlockSizePolicy(n, cap, unit=8, max_block=256, watermark_frac=watermark)
    elif system in PAGE_BYTES:
        pt = page_tokens(PAGE_BYTES[system], model, tp, kv_cache_dtype)
        policy = VirtualContiguousPolicy(cap // pt + 1, pt, n, -(-mlen // pt), watermark)
    elif system in ("orca_max", "orca_pow2", "orca_oracle"):
        policy = ReservationPolicy(system.split("_")[1], n, cap, mlen, watermark)
    elif system == "ft_static":
        b = min(static_batch_size(cap, mlen), n)
        policy = ReservationPolicy("max", n, cap, mlen, watermark)
        # The budget must take B whole prompts: a static batch is prefilled at once.
        cfg.update(
            mode="static",
            static_batch_size=b,
            max_num_batched_tokens=b * mlen,
            prompt_steps="mixed",
        )
    else:
        raise ValueError(f"unknown system {system!r}; one of {SYSTEMS + ABLATIONS}")
    return policy, SchedulerLimits(**cfg)


# Block-granular access of the paged kernel (block_time), "kernel" setting: vLLM's
# paged kernel loads each KV block whole (its K/V loads run over the block's slots and
# mask the scores after), and its fixed cost per block is read off the paper's Fig. 18a:
# PagedAttention at block 16 is 20-26 % slower than FasterTransformer's contiguous
# kernel (section 7.1), i.e. ~0.23 x the HBM time of a 16-token block, 3.7 tokens' worth
# per block visit. Cross-check on this CPU: experiments/block_size.py times the native
# kernel at several block sizes and fits its own per-block cost (docs/experiments.md).
BLOCK_COSTS: dict[str, dict[str, float | bool]] = {
    "none": {},
    "kernel": {"block_overhead_tokens": KERNEL_BLOCK_OVERHEAD_TOKENS, "whole_block_reads": True},
}


def make_cost_model(
    gpu: str = "A100-40GB",
    model: str = "opt-13b",
    tp: int = 1,
    *,
    calibration: str = "roofline",
    step_overhead_s: float = 2e-3,
    kv_cache_dtype: str = "auto",
    block_cost: str = "none",
) -> Any:
    """The step-time model of a GPU (``cost_model.GPUS``) serving a model preset
    (``cost_model.MODEL_PRESETS``): the plain roofline plus ``step_overhead_s`` per step,
    or a named calibration (``cost_model.CALIBRATIONS``, e.g. "vllm2023", whose fitted
    overhead replaces step_overhead_s). ``kv_cache_dtype``: the KV cache's storage, which
    sets the KV bytes a step reads ("fp8": half of a 16-bit cache's). ``block_cost``: a
    paged kernel's block-granular access (BLOCK_COSTS: "none" or "kernel"). Hashable, so
    it is a static jit argument."""
    if block_cost not in BLOCK_COSTS:
        raise ValueError(f"block_cost must be one of {sorted(BLOCK_COSTS)}, got {block_cost!r}")
    geom = model_geometry(model, tp, kv_cache_dtype)
    if calibration != "roofline":
        return calibrated(calibration, gpu, geom, **BLOCK_COSTS[block_cost])
    return roofline(gpu, geom, step_overhead_s=step_overhead_s, **BLOCK_COSTS[block_cost])


@dataclass
class SystemRun:
    """One simulated run: the workload, its SimResult (numpy) and the system's name."""

    system: str
    workload: Workload
    result: SimResult

    def metrics(self) -> dict[str, float]:
        """Latency, throughput and completion (``latency_metrics``)."""
        return latency_metrics(self.workload, self.result)


def simulate_system(
    system: str | tuple[Any, SchedulerLimits],
    workload: Workload,
    *,
    cost_model: Any = None,
    horizon_s: float | None = None,
    window_start_s: float = 0.0,
    pad_to: int | None = None,
    **system_args: Any,
) -> SystemRun:
    """Simulate ``workload`` (arrival times, prompt and output lengths) under a system:
    a name (built by ``build_system(system, **system_args)``) or a (memory policy,
    SchedulerLimits) pair of one's own.

    cost_model: default ``make_cost_model()`` (roofline of OPT-13B on an A100-40GB).
    horizon_s: stop at this simulated time (default: unbounded, i.e. until every request
    finished). window_start_s: start of the steady window the usage shares average over
    (it ends at the last arrival). pad_to: trace length for jit (default: the next power
    of two >= 64; runs of the same padded length and system share one compilation).
    Requests longer than the system's max_model_len are rejected, and counted so.
    """
    if isinstance(system, str):
        name = system
        policy, config = build_system(system, **system_args)
    else:
        if system_args:
            raise ValueError("system_args only apply to a named system")
        name = type(system[0]).__name__
        policy, config = system
    cm = make_cost_model() if cost_model is None else cost_model
    n = len(workload)
    if pad_to is None:
        pad_to = max(64, 1 << max(n - 1, 0).bit_length())
    horizon = math.inf if horizon_s is None else horizon_s
    trace = make_trace(workload.arrival_time, workload.prompt_len, workload.output_len,
                       pad_to, horizon, window_start_s)  # fmt: skip
    result = SimResult(*(np.asarray(x) for x in simulate(policy, config, cm, trace)))
    return SystemRun(name, workload, result)


def latency_metrics(
    workload: Workload, result: SimResult, stop_latency: float = math.inf
) -> dict[str, float]:
    """Mean normalized latency (s/token), throughput and completion of one run.

    Unfinished requests at the horizon count with their latency so far, a lower bound;
    ``unfinished`` says how many, so an exploded point is recognisable. ``stop_latency``:
    the bound at which the simulation was allowed to stop early (``stopped_early``).
    """
    w, r = workload, result
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
        "stopped_early": bool(float(r.latency_bound) > stop_latency),
    }


def usage_pcts(result: SimResult, capacity: int) -> dict[str, float]:
    """Fig. 2 shares (% of the pool) over the steady window, and the token share of the
    allocated memory (pool minus external fragmentation and free).

    ``external_frag_pct`` is the paper's last category, "external fragmentation &
    others" (free memory included, as Orca (Max)'s 8.9 % is); ``free_pct`` is its free
    part (held by nothing) and ``external_only_pct`` the rest (buddy rounding slack)."""
    u = result.win_usage.astype(np.float64)
    pct = 100.0 * u / capacity
    alloc = u[0] + u[1] + u[2]
    free = 100.0 * float(result.win_free) / capacity
    return {
        "token_states_pct": float(pct[0]),
        "reserved_pct": float(pct[1]),
        "internal_frag_pct": float(pct[2]),
        "external_frag_pct": float(pct[3]),
        "free_pct": free,
        "external_only_pct": max(float(pct[3]) - free, 0.0),
        "token_of_allocated_pct": float(100.0 * u[0] / alloc) if alloc > 0 else math.nan,
        "window_s": float(result.win_time),
    }


__all__ = [
    "SIM_LABEL",
    "SYSTEMS",
    "SYSTEM_LABELS",
    "SystemRun",
    "build_system",
    "latency_metrics",
    "make_cost_model",
    "simulate_system",
    "usage_pcts",
]
