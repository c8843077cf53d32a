"""schedule + update time per step for 16, 64, 256 and 1024 running sequences (CPU).

    python benchmarks/scheduler_overhead.py [--seqs 16 64 256 1024] [--steps 50]

Paged memory policy (block size 16, 1% watermark), default mode, every sequence in
decode. Two columns, measured in one run: one jitted call per step (as the engine
dispatches it, including the host dispatch cost), and per step inside a K-step
``lax.fori_loop`` (as the simulator and the multi-step decode loop run it). The last
line is the headline: the in-loop time at 256 sequences, in microseconds, since the
engine's decode steps run inside its K-step loop (``num_scheduler_steps``); the line
before it gives the per-dispatch time, what a one-step-per-dispatch engine pays.
"""

from __future__ import annotations

import argparse

import jax

from pagedjax.machine import cpu_model
from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.scheduler import SchedulerLimits
from pagedjax.scheduler.bench import bench


def main(argv: list[str] | None = None) -> dict[int, tuple[float, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    bs = 16
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {cpu_model()}")
    print(f"{'running seqs':>12} | {'us/step (dispatch)':>18} | {'us/step (in loop)':>17}")
    out = {}
    for n in args.seqs:
        policy = PagedPolicy(n * 24 + 1, bs, n, 128, 0.01)
        cfg = SchedulerLimits(
            n, max_num_batched_tokens=max(2560, n * 100), max_num_seqs=n, max_model_len=128 * bs
        )
        per_dispatch, per_loop, _ = bench(policy, cfg, n, args.steps)
        out[n] = (per_dispatch, per_loop)
        print(f"{n:>12} | {per_dispatch * 1e6:>18.0f} | {per_loop * 1e6:>17.0f}", flush=True)
    if 256 in out:
        print(f"us_per_step_at_256_dispatched: {out[256][0] * 1e6:.0f}")
        print(f"us_per_step_at_256: {out[256][1] * 1e6:.0f}")
    return out


if __name__ == "__main__":
    main()
