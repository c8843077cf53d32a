"""Is a system keeping up at a rate, or queueing? One simulated run per rate, with what
tells the two apart (docs/kv_quantization.md: why the fp8 paged batch barely grows between
the 16-bit and the fp8 knee).

    python experiments/saturation.py --config llama7b.yaml --set kv_cache_dtype=fp8 \\
        --set server.slots=128 --rates 9.721979,18.2 [--system paged]

Prints one JSON line per rate: the steady-window batch and pool use (Fig. 2 / 13's
numbers), the tokens each batched request holds, finished / unfinished requests at the
horizon, the completed-request throughput, the wait for the first token, mean step time and
preemptions. A run keeping up finishes (nearly) everything with short waits; a saturated
one leaves requests unfinished and its throughput is its capacity. Simulated; not one of
``run.py``'s experiments (no figure, no CSV).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from experiments.common import latency_metrics, run_sim  # noqa: E402
from experiments.config import ExperimentConfig  # noqa: E402
from experiments.run import resolve_config  # noqa: E402
from pagedjax.config import load_yaml  # noqa: E402


def probe(cfg: ExperimentConfig, system: str, rate: float, duration_s: float) -> dict:
    """One ShareGPT run of ``system`` at ``rate`` (the batched_requests seed and spread 1)."""
    import numpy as np

    spec = ("sharegpt", rate, duration_s, cfg.batched_requests.seed, 1.0)
    (run,) = run_sim(system, cfg.server, [spec])
    r, w = run.result, run.workload
    n = len(w)
    cap = float(np.sum(r.win_usage))
    first = r.first_token_time[:n]
    wait = (first - w.arrival_time)[np.isfinite(first)]
    lm = latency_metrics(run)
    return dict(
        system=system, kv_cache_dtype=cfg.server.kv_cache_dtype, rate=rate,
        batched=round(float(r.win_batched), 2),
        pool_tokens_pct=round(100 * float(r.win_usage[0]) / cap, 1),
        tokens_per_batched_request=round(float(r.win_usage[0]) / float(r.win_batched), 1),
        requests=lm["requests"], finished=lm["finished"], unfinished=lm["unfinished"],
        throughput_req_s=round(lm["throughput_req_s"], 3),
        norm_latency_s_per_token=round(lm["norm_latency_s_per_token"], 3),
        mean_latency_s=round(lm["mean_latency_s"], 2),
        median_first_token_wait_s=round(float(np.median(wait)), 2),
        p90_first_token_wait_s=round(float(np.percentile(wait, 90)), 2),
        mean_step_ms=round(1000 * float(r.busy_time) / int(r.steps), 2),
        preemptions=int(r.num_preemptions[:n].sum()), simulated_s=round(float(r.clock), 1),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rates", required=True, help="comma-separated req/s")
    ap.add_argument("--system", default="paged")
    ap.add_argument("--duration", type=float, default=200.0, help="trace seconds")
    a = ap.parse_args(argv)
    sets = [f"server.{o}" if o.startswith("kv_cache_dtype=") else o for o in a.set]
    cfg = load_yaml(ExperimentConfig, resolve_config(a.config), sets)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(ROOT / "results" / ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    for rate in (float(x) for x in a.rates.split(",")):
        print(json.dumps(probe(cfg, a.system, rate, a.duration)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
