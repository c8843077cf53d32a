"""Simulator validation: a profile-fitted simulator against real runs of a small model.

1. Serve ShareGPT-like traces (scaled to the model's context) at the ``engine`` rates
   with the real engine, recording each step's wall time and batch composition.
2. Fit ``FittedCostModel`` (t = a + b prefill + c decode + d kv + e pairs) to all steps.
3. Simulate the same traces with the same scheduler settings and pool, step time from
   the fitted profile, and compare mean normalized latency and throughput per rate.
The error is |sim - real| / real. Real and simulated numbers are labelled as such.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from experiments.common import Run, latency_metrics, workload, write_csv
from experiments.config import ExperimentConfig
from experiments.real_serving import make_llm, metrics, serve
from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.scheduler import SchedulerConfig
from pagedjax.simulator.cost_model import FittedCostModel
from pagedjax.simulator.simulate import SimResult, make_trace, simulate


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.engine
    try:
        llm = make_llm(s)
    except Exception as e:  # noqa: BLE001 - report, do not fake numbers
        return {"status": f"not available: {type(e).__name__}: {e}"}
    eng = llm.llm_engine
    serve(llm, workload("sharegpt", 100.0, 1.0, s.seed + 99, 1.0, s.max_model_len).head(8))
    loads, reals = [], []
    for rate in progress(s.rates, desc="simulator_validation (real)", leave=False):
        w = workload("sharegpt", rate, 1e6, s.seed, 1.0, s.max_model_len).head(s.num_requests)
        loads.append(w)
        reals.append(serve(llm, w))
    steps = np.concatenate([r["steps"] for r in reals])
    fit = FittedCostModel.fit(steps[:, 0], steps[:, 1], steps[:, 2], steps[:, 4], steps[:, 3])
    sc = eng.scheduler_config if hasattr(eng, "scheduler_config") else None
    n = int(eng.max_seqs)
    policy = PagedPolicy(
        s.num_gpu_blocks, s.block_size, n, -(-s.max_model_len // s.block_size), 0.01
    )
    scfg = SchedulerConfig(
        max_seqs=n,
        max_num_batched_tokens=max(512, s.max_model_len),
        max_num_seqs=min(s.max_num_seqs, n),
        max_model_len=s.max_model_len,
        mode="default",
    )
    del sc
    rows, summary = [], {"fit_coef": list(fit.coef), "fit_rms_s": fit.rms_residual_s, "rates": {}}
    errs = []
    for rate, w, real in zip(s.rates, loads, reals, strict=True):
        tr = make_trace(w.arrival_time, w.prompt_len, w.output_len, 1 << (len(w) - 1).bit_length())
        res = SimResult(*(np.asarray(x) for x in simulate(policy, scfg, fit, tr)))
        sim = latency_metrics(Run(w, res, float(w.arrival_time[-1])))
        rm = metrics(w, real)
        e_nl = (
            abs(sim["norm_latency_s_per_token"] - rm["norm_latency_s_per_token"])
            / rm["norm_latency_s_per_token"]
        )
        e_tp = abs(sim["throughput_tok_s"] - rm["throughput_tok_s"]) / rm["throughput_tok_s"]
        errs += [e_nl, e_tp]
        rows.append(
            dict(
                rate=rate,
                real_norm_latency=rm["norm_latency_s_per_token"],
                simulated_norm_latency=sim["norm_latency_s_per_token"],
                real_tok_s=rm["throughput_tok_s"],
                simulated_tok_s=sim["throughput_tok_s"],
                err_norm_latency=e_nl,
                err_throughput=e_tp,
            )
        )
        summary["rates"][str(rate)] = {k: round(v, 4) for k, v in rows[-1].items()}
    summary["max_error_pct"] = round(100 * max(errs), 1)
    write_csv(out / "simulator_validation.csv", rows)
    return summary


def table(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    if "status" in summary:
        return [("simulator validation", summary["status"][:40], "")]
    return [("sim vs real max error %", f"{summary['max_error_pct']}", "<= 20")]
