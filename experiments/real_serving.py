"""Serve a workload with the real engine (pagedjax.LLM) on this machine, in wall time.

Requests are added when their arrival time has passed (a Poisson trace scaled to the
model's context), the engine steps until all finish, and every step's wall time is
recorded beside its batch composition (read from the scheduler's batch by wrapping the
engine's jitted ``_schedule``), so a cost profile can be fitted to it.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from experiments.config import EngineSettings
from pagedjax.workloads import Workload


def make_llm(s: EngineSettings) -> Any:
    from pagedjax import LLM

    return LLM(
        model=s.model,
        load_format="dummy",
        max_model_len=s.max_model_len,
        num_gpu_blocks_override=s.num_gpu_blocks,
        block_size=s.block_size,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=max(512, s.max_model_len),
        seed=s.seed,
    )


def serve(llm: Any, w: Workload, vocab: int = 256, seed: int = 0) -> dict[str, Any]:
    """Returns per-request times (s from start) and per-step (features, seconds)."""
    from pagedjax import SamplingParams

    eng = llm.llm_engine
    steps: list[tuple[float, float, float, float]] = []
    orig = eng._schedule

    def recording(state):  # wrap: record the batch's work, keep the engine unchanged
        st, b = orig(state)
        q, start, ids = jax.device_get((b.q_lens, b.start_pos, b.seq_ids))
        row = ids >= 0
        dec = row & (q == 1) & (start > 0)
        pre = row & ~dec
        pending.append(
            (
                float(q[pre].sum()),
                float(dec.sum()),
                float((start[dec] + 1).sum() + start[pre].sum()),
                float((q[pre] * (q[pre] + 1) / 2 + q[pre] * start[pre]).sum()),
            )
        )
        return st, b

    pending: list[tuple] = []
    eng._schedule = recording
    rng = np.random.default_rng(seed)
    n = len(w)
    first = np.full(n, np.nan)
    done = np.full(n, np.nan)
    nxt = 0
    t0 = time.perf_counter()
    try:
        while nxt < n or eng.has_unfinished_requests():
            now = time.perf_counter() - t0
            while nxt < n and w.arrival_time[nxt] <= now:
                ids = rng.integers(1, vocab, int(w.prompt_len[nxt])).tolist()
                p = SamplingParams(
                    max_tokens=int(w.output_len[nxt]), ignore_eos=True, temperature=0
                )
                eng.add_request(str(nxt), ids, p)
                nxt += 1
            if not eng.has_unfinished_requests():
                time.sleep(max(0.0, min(0.05, w.arrival_time[nxt] - now)))
                continue
            pending.clear()
            ts = time.perf_counter()
            outs = eng.step()
            te = time.perf_counter()
            if pending:
                steps.append((*pending[-1], te - ts))
            for o in outs:
                i = int(o.request_id)
                if np.isnan(first[i]) and len(o.outputs[0].token_ids) > 0:
                    first[i] = te - t0
                if o.finished:
                    done[i] = te - t0
    finally:
        eng._schedule = orig
    return {
        "first": first,
        "finish": done,
        "steps": np.array(steps, np.float64),
        "wall_s": time.perf_counter() - t0,
    }


def metrics(w: Workload, r: dict[str, Any]) -> dict[str, float]:
    lat = r["finish"] - w.arrival_time
    ttft = r["first"] - w.arrival_time
    tpot = (r["finish"] - r["first"]) / np.maximum(w.output_len - 1, 1)
    end = np.nanmax(r["finish"])
    return {
        "norm_latency_s_per_token": float(np.nanmean(lat / w.output_len)),
        "throughput_req_s": float(np.sum(np.isfinite(r["finish"])) / end),
        "throughput_tok_s": float(w.output_len[np.isfinite(r["finish"])].sum() / end),
        "ttft_p50_s": float(np.nanpercentile(ttft, 50)),
        "ttft_p90_s": float(np.nanpercentile(ttft, 90)),
        "ttft_p99_s": float(np.nanpercentile(ttft, 99)),
        "tpot_p50_s": float(np.nanpercentile(tpot, 50)),
        "tpot_p90_s": float(np.nanpercentile(tpot, 90)),
        "tpot_p99_s": float(np.nanpercentile(tpot, 99)),
        "steps": int(len(r["steps"])),
    }
