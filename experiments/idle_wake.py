"""The real engine's wake cost after an idle gap, and what modelling it does to the
simulator's validation error (docs/experiments.md, "The wake cost").

    python experiments/idle_wake.py [--repeats 4] [--pauses 30]

1. The pause: one request (40 prompt tokens, 12 outputs) on llama7b.yaml's engine
   (tiny-llama, random weights), its prefill and two decode steps, then a pause (none,
   a 5 ms or 50 ms ``time.sleep``, or a 50 ms spin of the main thread), then its last
   steps, timed one by one. Printed: the median of the first three steps after the
   pause and of the rest, per kind of pause.
2. The fit: ``repeats`` sets of the validation's real runs (ShareGPT-like 4 / 8 / 32
   req/s, Alpaca-like and Azure 8 / 32, interleaved as in simulator_validation); each
   set's ShareGPT steps fitted twice, without and with the after-idle column
   (``FittedCostModel.wake_s``), and every run simulated under both fits. Printed: each
   run's error under both (sign: + the simulation slower), each fit's residual and
   wake_s, and per workload the worst error by repeat and its median.

Real timings on this machine, beside simulations of them; nothing here is a claim.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import workload  # noqa: E402
from experiments.config import ExperimentConfig  # noqa: E402
from experiments.real_serving import make_llm, serve, warm_up  # noqa: E402
from experiments.simulator_validation import (  # noqa: E402
    compare_run,
    interleaved_jobs,
    make_validation_workload,
)
from pagedjax import SamplingParams  # noqa: E402
from pagedjax.config import load_yaml  # noqa: E402
from pagedjax.simulator.cost_model import FittedCostModel  # noqa: E402


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def pause_costs(eng, pauses: int) -> None:
    kinds = [("none", None, 0.0), ("sleep 50 ms", time.sleep, 0.05),
             ("spin 50 ms", spin, 0.05), ("sleep 5 ms", time.sleep, 0.005)]  # fmt: skip
    out: dict[str, list[list[float]]] = {k[0]: [] for k in kinds}
    n = 0
    for _ in range(pauses):
        for name, wait, seconds in kinds:
            n += 1
            p = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
            eng.add_request(f"pause{n}", list(range(1, 41)), p)
            for _ in range(3):  # prefill and two decodes
                eng.step()
            if wait is not None:
                wait(seconds)
            ts = []
            while eng.has_unfinished_requests():
                t0 = time.perf_counter()
                eng.step()
                ts.append(time.perf_counter() - t0)
            out[name].append([*ts[:3], float(np.median(ts[3:]))])
    for name, rows in out.items():
        v = 1e3 * np.array(rows)
        first = " / ".join(f"{x:.3f}" for x in np.median(v[:, :3], axis=0))
        print(f"pause {name:12s}: first 3 steps after it {first} ms; later steps "
              f"{np.median(v[:, 3]):.3f} ms (medians of {len(rows)})")  # fmt: skip


def fits_with_and_without(llm, cfg: ExperimentConfig, repeats: int) -> None:
    s, v = cfg.engine, cfg.simulator_validation
    eng = llm.llm_engine
    names = [v.fit_workload, *v.held_out]
    rates = {n: list(v.held_out_rates or s.rates) for n in v.held_out}
    rates[v.fit_workload] = list(v.rates or s.rates)
    loads = {
        n: [make_validation_workload(n, r, s.num_requests, s.max_model_len, s.seed) for r in rs]
        for n, rs in rates.items()
    }
    worst: dict[str, dict[str, list[float]]] = {"without": {}, "with": {}}
    for k in range(repeats):
        reals = {}
        for _, n, i in interleaved_jobs(names, rates, 1):
            reals[n, i] = serve(llm, loads[n][i])
        fit_runs = range(len(rates[v.fit_workload]))
        st = np.concatenate([reals[v.fit_workload, i]["steps"] for i in fit_runs])
        args = (st[:, 0], st[:, 1], st[:, 2], st[:, 4], st[:, 3])
        fits = {
            "without": FittedCostModel.fit(*args, nonnegative=True),
            "with": FittedCostModel.fit(*args, nonnegative=True, after_idle=st[:, 5]),
        }
        woke = sum(int(r["steps"][:, 5].sum()) for r in reals.values())
        print(f"repeat {k}: {woke} steps after idle in {len(reals)} runs; wake_s "
              f"{1e3 * fits['with'].wake_s:.3f} ms")  # fmt: skip
        for label, fit in fits.items():
            parts = []
            for n in names:
                cs = [compare_run(loads[n][i], reals[n, i], eng.policy, eng.sched_limits, fit)
                      for i in range(len(rates[n]))]  # fmt: skip
                worst[label].setdefault(n, []).append(100 * max(c["error"] for c in cs))
                errs = "/".join(
                    f"{100 * c['error']:.1f}"
                    + ("+" if c["simulated_norm_latency"] > c["real_norm_latency"] else "-")
                    for c in cs
                )
                parts.append(f"{n} {errs}")
            print(f"  {label:7s} wake term: {' | '.join(parts)}; residual "
                  f"{1e3 * fit.rms_residual_s:.3f} ms")  # fmt: skip
    for label, by_n in worst.items():
        for n, errs in by_n.items():
            print(f"{label:7s} wake term, {n:10s}: worst error by repeat "
                  f"{[round(e, 1) for e in errs]} %, median {np.median(errs):.1f} %")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--pauses", type=int, default=30)
    a = ap.parse_args()
    if a.repeats < 1 or a.pauses < 1:
        ap.error(f"--repeats and --pauses must be >= 1, got {a.repeats} and {a.pauses}")
    root = Path(__file__).resolve().parents[1]
    cfg = load_yaml(ExperimentConfig, root / "configs" / "llama7b.yaml", [])
    s = cfg.engine
    llm = make_llm(s)
    warm_up(llm)
    serve(llm, workload("sharegpt", 100.0, 1.0, s.seed + 99, 1.0, s.max_model_len).head(8))
    pause_costs(llm.llm_engine, a.pauses)
    fits_with_and_without(llm, cfg, a.repeats)


if __name__ == "__main__":
    main()
