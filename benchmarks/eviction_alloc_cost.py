"""The allocator's cost per call: the free list's pop (eviction_policy "lru") vs the
policy sort (``block_stats.pop_victims``, "lfu"), on the default device.

    PYTHONPATH=. python benchmarks/eviction_alloc_cost.py

A jitted call allocates 4 blocks and frees them again; best of 5 rounds of 50 calls, for
pools of 56, 1,024 and 8,192 blocks (half of them cached). docs/kv_tiers.md.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.memory import block_pool as bp
from pagedjax.memory import block_stats as bst


def per_call_us(f, pool) -> float:
    p = jax.block_until_ready(f(pool))  # compiles
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(50):
            p = f(p)
        jax.block_until_ready(p)
        best = min(best, (time.perf_counter() - t) / 50)
    return best * 1e6


def main() -> None:
    for n in (56, 1024, 8192):
        pool = bp.create_block_pool(n)
        stats = bst.create_block_stats(n, "lfu")
        cached = jnp.asarray(np.random.default_rng(0).random(n) < 0.5)

        def free_list(p):
            p, blocks = bp.pop_blocks(p, 4, 4)
            return bp.drop_refs(p, blocks, 4)

        def policy(p, cached=cached, stats=stats):
            p, blocks = bst.pop_victims(p, cached, stats, 4, 4)
            return bp.drop_refs(p, blocks, 4)

        a, b = per_call_us(jax.jit(free_list), pool), per_call_us(jax.jit(policy), pool)
        print(f"N={n}: allocate 4 + free 4: free list {a:.1f} us, lfu sort {b:.1f} us;"
              f" load {os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
