"""Simulator validation: a profile-fitted simulator against real runs of a small model.

1. Serve ShareGPT-like traces (scaled to the model's context) at the ``engine`` rates
   with the real engine, recording each step's wall time and batch composition. Every
   padding bucket of the model step is compiled first (``real_serving.warm_up``), so the
   timed steps are warm (``steps_over_1s`` in the summary checks it).
2. Fit ``FittedCostModel`` (t = a + b prefill + c decode + d kv + e pairs) to all steps.
3. Simulate the same traces with the engine's own policy and scheduler config, step time from
   the fitted profile, and compare mean normalized latency and throughput per rate.
The error is |sim - real| / real. Real and simulated numbers are labelled as such.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from experiments.common import Run, latency_metrics, write_csv
from experiments.config import ExperimentConfig
from experiments.real_serving import metrics, real_runs
from pagedjax.simulator.cost_model import FittedCostModel
from pagedjax.simulator.simulate import SimResult, make_trace, simulate


def run(cfg: ExperimentConfig, out: Path, progress: Any) -> dict[str, Any]:
    s = cfg.engine
    try:
        real = real_runs(s, progress)
    except Exception as e:  # noqa: BLE001 - report, do not fake numbers
        return {"status": f"not available: {type(e).__name__}: {e}"}
    eng = real["llm"].llm_engine
    loads, reals = real["loads"], real["reals"]
    steps = np.concatenate([r["steps"] for r in reals])
    fit = FittedCostModel.fit(steps[:, 0], steps[:, 1], steps[:, 2], steps[:, 4], steps[:, 3])
    # The engine's own memory policy and scheduler config: the simulator then makes the
    # same decisions; only the step time comes from the fitted profile.
    policy, scfg = eng.policy, eng.sched_config
    slow = int(np.sum(steps[:, 4] > 1.0))  # compile stalls would show as >1 s steps
    rows = []
    summary: dict[str, Any] = {
        "executor": "real + simulated",
        "model": s.model,
        "warmup": real["warmup"],
        "steps_fitted": int(len(steps)),
        "steps_over_1s": slow,
        "fit_coef": list(fit.coef),
        "fit_rms_s": fit.rms_residual_s,
        "rates": {},
    }
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
                real_steps=rm["steps"],
                simulated_steps=sim["steps"],
                real_step_seconds=float(real["steps"][:, 4].sum()),
                simulated_busy_seconds=float(res.busy_time),
                real_preemptions=int(real["preemptions"]),
                simulated_preemptions=sim["preemptions"],
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
