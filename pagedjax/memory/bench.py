"""Microbenchmark: allocate + free under jit with a donated pool, at growing pool sizes.

The cost should follow the blocks requested, not the pool size:
    python -m pagedjax.memory.bench            # 1k .. 1M blocks
    python -m pagedjax.memory.bench --sizes 1000 --iters 50   # quick
Prints one row per pool size and, last, the 1M-over-1k time ratio.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from pagedjax.memory import block_pool as bp


@functools.partial(jax.jit, static_argnames=("max_n",), donate_argnums=(0,))
def alloc_free(pool: bp.BlockPool, n: jax.Array, max_n: int) -> tuple[bp.BlockPool, jax.Array]:
    """Allocate n blocks and free them again: one round trip through the free list."""
    pool, blocks, ok = bp.allocate(pool, n, max_n)
    pool, ok2 = bp.free(pool, blocks)
    return pool, ok & ok2


def time_pool(num_blocks: int, n: int, iters: int) -> float:
    """Median seconds per allocate+free of ``n`` blocks in a pool of ``num_blocks``."""
    pool = bp.create_block_pool(num_blocks)
    nn = jnp.asarray(n, jnp.int32)
    for _ in range(3):  # compile and warm up
        pool, ok = alloc_free(pool, nn, n)
    assert bool(ok)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        pool, ok = alloc_free(pool, nn, n)
        ok.block_until_ready()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main(argv: list[str] | None = None) -> dict[int, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--blocks", type=int, default=16, help="blocks allocated and freed per call")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.blocks} blocks per call")
    print(f"{'pool blocks':>12} | {'us per allocate+free':>20}")
    results = {}
    for size in args.sizes:
        results[size] = time_pool(size, args.blocks, args.iters)
        print(f"{size:>12} | {results[size] * 1e6:>20.1f}", flush=True)
    lo, hi = min(results), max(results)
    print(f"ratio_{hi}_over_{lo}: {results[hi] / results[lo]:.2f}")
    return results


if __name__ == "__main__":
    main()
