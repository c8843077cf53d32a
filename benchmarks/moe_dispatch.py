"""Times the two MoE dispatches (pagedjax/model/moe.py) on the CPU: one Mixtral-style layer
(8 experts, top-2, SwiGLU; hidden 512, intermediate 1792: Mixtral-8x7B's shape / 8, fp32)
for batches of T tokens. ``dense`` runs every expert on every token (E / k = 4x the FLOPs
of the chosen experts, plain batched matmuls); ``grouped`` sorts the T * k (token, expert)
pairs by expert and runs ``jax.lax.ragged_dot``. Prints ms per call (median of --reps) and
their largest difference.

    python benchmarks/moe_dispatch.py [--reps 20] [--tokens 1 8 32 128 512]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.moe import dense_dispatch, grouped_dispatch, route

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 512, 1792


def median_ms(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(0, 0.02, s), jnp.float32)
    w1, w3, w2 = w(EXPERTS, HIDDEN, INTER), w(EXPERTS, HIDDEN, INTER), w(EXPERTS, INTER, HIDDEN)
    router = w(HIDDEN, EXPERTS)
    # Weights are arguments, not closed-over constants (XLA would constant-fold them).
    fns = {
        name: jax.jit(
            lambda x, r, a, b, c, f=f: f(x, *route(x @ r, TOP_K), a, b, c, jax.nn.silu)
        )
        for name, f in (("dense", dense_dispatch), ("grouped", grouped_dispatch))
    }
    weights = (router, w1, w3, w2)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs, jax {jax.__version__}")
    print(f"{'tokens':>6} {'dense ms':>9} {'grouped ms':>10} {'max|diff|':>9}")
    for t in args.tokens:
        x = jnp.asarray(rng.normal(0, 1, (t, HIDDEN)), jnp.float32)
        ms = {name: median_ms(fn, (x, *weights), args.reps) for name, fn in fns.items()}
        diff = float(jnp.abs(fns["dense"](x, *weights) - fns["grouped"](x, *weights)).max())
        print(f"{t:6d} {ms['dense']:9.3f} {ms['grouped']:10.3f} {diff:9.2e}", flush=True)


if __name__ == "__main__":
    main()
