"""Serve a workload with the real engine (pagedjax.LLM) on this machine, in wall time.

Requests are added when their arrival time has passed (a Poisson trace scaled to the
model's context), the engine steps until all finish, and every step's wall time is
recorded beside its batch composition (read from the scheduler's batch by wrapping the
engine's jitted ``_schedule``), so a cost profile can be fitted to it.

A catalog model (``engine.model: smollm2-135m-instruct``) runs its real weights on real
chat prompts (the eval questions, cycled), and its outputs stop on EOS on their own (the
workload's output length is only a cap); the workloads returned by ``real_runs`` then
carry the lengths that actually ran, so metrics and the simulator replay what was served.
Random-weight models keep random prompts and ``ignore_eos`` (fixed output lengths).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from experiments.config import EngineSettings
from pagedjax.engine.step_record import StepRecord
from pagedjax.workloads import Workload


def is_real_model(name: str) -> bool:
    """A catalog model with real weights (pagedjax/model/catalog.py), not a preset."""
    from pagedjax.model.catalog import CATALOG

    return name in CATALOG


def chat_prompts(llm: Any, n: int, max_model_len: int) -> list[list[int]]:
    """n chat prompts (the eval questions, cycled) rendered by the model's chat template."""
    from pagedjax.eval import QUESTIONS

    tok = llm.get_tokenizer()
    out = []
    for i in range(n):
        conv = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        ids = tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)
        out.append(ids[: max_model_len - 1])
    return out


def make_llm(s: EngineSettings) -> Any:
    from pagedjax import LLM

    return LLM(
        model=s.model,
        load_format="auto" if is_real_model(s.model) else "dummy",
        max_model_len=s.max_model_len,
        num_gpu_blocks_override=s.num_gpu_blocks,
        block_size=s.block_size,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens or max(512, s.max_model_len),
        seed=s.seed,
        enable_prefix_caching=False,  # the simulator it validates models no prefix cache
    )


def warm_up(llm: Any) -> dict[str, Any]:
    """Compile every (token, seq) bucket of the engine's model step and its state
    functions before timing: the engine's own ``warmup(mode="all")``, which runs each
    program on no-op inputs shaped exactly as the engine's steps pass them (so the timed
    runs meet only compiled programs). Returns what it did and how long it took."""
    eng = llm.llm_engine
    t0 = time.perf_counter()
    pairs = eng.warmup(mode="all")
    return {
        "buckets": len(pairs),
        "how": "LLMEngine.warmup(mode='all')",
        "seconds": round(time.perf_counter() - t0, 1),
    }


def serve(
    llm: Any,
    w: Workload,
    vocab: int = 256,
    seed: int = 0,
    prompts: list[list[int]] | None = None,
    stop_on_eos: bool = False,
) -> dict[str, Any]:
    """Returns per-request times (s from start) and per-step (features, seconds, woke).

    A step's seconds cover its whole serving-loop iteration (adding the requests that
    arrived, ``step()``, reading its outputs), not only ``step()``. ``steps`` is
    float64[N, 6]: prefill tokens, decode sequences, KV tokens read, prefill pairs,
    seconds, and 1.0 where the step was the first after the loop sat idle (nothing
    unfinished, waiting for the next arrival), else 0.0.

    prompts: the requests' token ids (len(w) lists, of w.prompt_len tokens each);
    default: random ids in [1, vocab) drawn with ``seed``. stop_on_eos: a request ends at
    EOS (a real model), w.output_len (capped to the context) being only its limit; else
    ignore_eos. Returns also output_len: the tokens each request generated.
    """
    from pagedjax import SamplingParams

    eng = llm.llm_engine
    steps: list[tuple[float, ...]] = []
    pending: list[tuple] = []

    def record(rec: StepRecord) -> None:  # the engine's step observer: the batch's work
        q, start = rec.q_lens, rec.start_pos
        dec = (q == 1) & (start > 0)
        pre = ~dec
        pending.append(
            (
                float(q[pre].sum()),
                float(dec.sum()),
                float((start[dec] + 1).sum() + start[pre].sum()),
                float((q[pre] * (q[pre] + 1) / 2 + q[pre] * start[pre]).sum()),
            )
        )

    eng.add_step_observer(record)
    rng = np.random.default_rng(seed)
    n = len(w)
    first = np.full(n, np.nan)
    done = np.full(n, np.nan)
    out_len = np.zeros(n, np.int32)
    nxt = 0
    idle = False  # the loop waited for an arrival since its last step
    kinds = ("num_preemptions_recompute", "num_preemptions_swap")
    pre0 = sum(getattr(eng, k) for k in kinds)
    t0 = time.perf_counter()
    try:
        while nxt < n or eng.has_unfinished_requests():
            ts = time.perf_counter()  # a step's time is its whole loop iteration (below)
            now = ts - t0
            while nxt < n and w.arrival_time[nxt] <= now:
                if prompts is None:
                    ids = rng.integers(1, vocab, int(w.prompt_len[nxt])).tolist()
                else:
                    ids = prompts[nxt]
                cap = min(int(w.output_len[nxt]), eng.max_model_len - len(ids))
                p = SamplingParams(max_tokens=cap, ignore_eos=not stop_on_eos, temperature=0)
                eng.add_request(str(nxt), ids, p)
                nxt += 1
            if not eng.has_unfinished_requests():
                time.sleep(max(0.0, min(0.05, w.arrival_time[nxt] - now)))
                idle = True
                continue
            pending.clear()
            outs = eng.step()
            te = time.perf_counter()
            for o in outs:
                i = int(o.request_id)
                if np.isnan(first[i]) and len(o.outputs[0].token_ids) > 0:
                    first[i] = te - t0
                if o.finished:
                    done[i] = te - t0
                    out_len[i] = len(o.outputs[0].token_ids)
            # The iteration from admitting arrivals to handling outputs: the host work a
            # serving loop does around each step is part of what the simulator must charge
            # (a K-step loop's iterations share it evenly).
            took = time.perf_counter() - ts
            steps.extend(
                (*feats, took / len(pending), float(idle and j == 0))
                for j, feats in enumerate(pending)
            )
            idle = False
    finally:
        eng.step_observers.remove(record)
    return {
        "first": first,
        "finish": done,
        "steps": np.array(steps, np.float64).reshape(-1, 6),
        "wall_s": time.perf_counter() - t0,
        "preemptions": sum(getattr(eng, k) for k in kinds) - pre0,
        "output_len": out_len,
    }


_REAL: dict[str, dict[str, Any]] = {}


def real_runs(s: EngineSettings, progress: Any = None) -> dict[str, Any]:
    """Serve the ``engine`` section's workloads once per process (shared by
    engine_throughput and simulator_validation): one LLM, every bucket compiled first, a
    short warm-up workload (compiles schedule/update), then one ShareGPT-like trace per
    rate, timed. Returns {"llm", "warmup", "loads", "reals"}; raises if the engine fails.
    """
    key = repr(s)  # EngineSettings holds a list (rates): not hashable itself
    if key in _REAL:
        return _REAL[key]
    from experiments.common import workload

    llm = make_llm(s)
    info = warm_up(llm)
    t0 = time.perf_counter()
    serve(llm, workload("sharegpt", 100.0, 1.0, s.seed + 99, 1.0, s.max_model_len).head(8))
    info["workload_seconds"] = round(time.perf_counter() - t0, 1)
    loads, reals = [], []
    rates = s.rates if progress is None else progress(s.rates, desc="real serving", leave=False)
    for rate in rates:
        w = workload("sharegpt", rate, 1e6, s.seed, 1.0, s.max_model_len).head(s.num_requests)
        if is_real_model(s.model):  # real prompts, outputs ending at EOS: record what ran
            prompts = chat_prompts(llm, len(w), s.max_model_len)
            r = serve(llm, w, prompts=prompts, stop_on_eos=True)
            w = Workload(w.arrival_time, np.array([len(p) for p in prompts]), r["output_len"])
        else:
            r = serve(llm, w)
        loads.append(w)
        reals.append(r)
    _REAL[key] = {"llm": llm, "warmup": info, "loads": loads, "reals": reals}
    return _REAL[key]


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
