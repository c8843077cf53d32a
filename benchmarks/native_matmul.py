"""The stacked-weight matmul: XLA's dot on the sliced layer vs the native CPU kernel.

    python benchmarks/native_matmul.py [--rows 1 4 16 32 64 128 256] [--reps 20]

A layer loop of the 8-layer 34M Llama's dense shapes (hidden 512, MLP 1376: q/k/v/o,
gate/up, down), weights stacked on a leading layer axis as the model holds them, run for
each row count T with ``stacked_matmul(native=False)`` (today's XLA path: each layer's
weights are copied out of the stack, then multiplied) and ``native=True`` (the kernel reads
them in place; past ``MAX_ROWS`` rows it falls back, so both columns then time XLA).
Prints the median ms per loop, side by side, and their ratio; model/native_matmul.py's
``MAX_ROWS`` is where the kernel stops paying.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model import native_matmul as nm

HIDDEN, MLP, LAYERS = 512, 1376, 8
SHAPES = ((HIDDEN, HIDDEN),) * 4 + ((HIDDEN, MLP),) * 2 + ((MLP, HIDDEN),)


def _layers(ws: list[jax.Array], x: jax.Array, native: bool) -> jax.Array:
    """LAYERS rounds of the dense layers' matmuls (no attention: only the matmuls differ)."""
    mm = functools.partial(nm.stacked_matmul, native=native)
    wq, wk, wv, wo, wg, wu, wd = ws

    def body(i: jax.Array, h: jax.Array) -> jax.Array:
        h = h + mm(mm(h, wq, i) + mm(h, wk, i) + mm(h, wv, i), wo, i)
        return h + mm(jax.nn.silu(mm(h, wg, i)) * mm(h, wu, i), wd, i)

    return jax.lax.fori_loop(0, LAYERS, body, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    ok, why = nm.available()
    print(f"native kernel: {ok} ({why}); load average {os.getloadavg()}")
    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    ws = [
        jax.random.normal(k, (LAYERS, *s), jnp.float32) * 0.02
        for k, s in zip(keys, SHAPES, strict=True)
    ]
    print(f"{'T':>5} {'XLA (ms)':>10} {'native (ms)':>12} {'ratio':>6}")
    for t in args.rows:
        x = jax.random.normal(jax.random.key(t), (t, HIDDEN), jnp.float32)
        res = {}
        for native in (False, True):
            fn = jax.jit(functools.partial(_layers, native=native))
            fn(ws, x).block_until_ready()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn(ws, x).block_until_ready()
                times.append(time.perf_counter() - t0)
            res[native] = 1000 * float(np.median(times))
        print(f"{t:5d} {res[False]:10.2f} {res[True]:12.2f} {res[True] / res[False]:6.2f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
