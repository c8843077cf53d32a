"""Host-side cost of the prefix cache's hint: hash dict vs radix tree (docs/kv_tiers.md).

The engine's pattern on a shared-prefix workload: each prompt (one of a few shared system
prompts + a random tail) is looked up (``propose``), then its remaining full blocks are
recorded in fresh block ids (``record``, ``--chunk`` blocks per call). Prints the mean
time per prompt of propose and record for each hint, the chained hashing the engine does
for every prompt either way (``extend_hashes``), the hint sizes, and the load average.
Pure Python, no JAX, seconds.

    python benchmarks/prefix_hint_cost.py [--prompts 500] [--block-size 16] [--chunk 1]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from pagedjax.engine.block_hashes import extend_hashes
from pagedjax.memory.prefix_cache import PrefixIndex
from pagedjax.memory.radix_hint import RadixHint


def workload(n: int, systems: int, sys_len: int, tail: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    heads = [rng.integers(3, 32000, sys_len).tolist() for _ in range(systems)]
    return [heads[int(rng.integers(systems))]
            + rng.integers(3, 32000, int(rng.integers(0, tail))).tolist()
            for _ in range(n)]  # fmt: skip


def run(hint, prompts: list[list[int]], hashes: list[list[int]], chunk: int) -> dict[str, float]:
    radix = isinstance(hint, RadixHint)
    t_prop = t_rec = 0.0
    fresh = 1
    for toks, hs in zip(prompts, hashes, strict=True):
        t0 = time.perf_counter()
        got = hint.propose(hs, tokens=toks) if radix else hint.propose(hs)
        t1 = time.perf_counter()
        lo = len(got)
        while lo < len(hs):  # ``chunk`` blocks per call, as the steps write them
            hi = min(len(hs), lo + chunk)
            blocks = list(range(fresh, fresh + hi - lo))
            fresh += len(blocks)
            if radix:
                hint.record(hs[lo:hi], blocks, tokens=toks, start=lo,
                            parent_hash=hs[lo - 1] if lo else None)  # as the engine
            else:
                hint.record(hs[lo:hi], blocks)
            lo = hi
        t_rec += time.perf_counter() - t1
        t_prop += t1 - t0
    n = len(prompts)
    return {"propose_ms": 1e3 * t_prop / n, "record_ms": 1e3 * t_rec / n, "hinted": len(hint)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=500)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=1,
                    help="blocks per record call (1: a block per step, as decoding)")
    a = ap.parse_args()
    b = a.block_size
    prompts = workload(a.prompts, a.systems, a.system_len, a.tail, a.seed)
    t0 = time.perf_counter()
    hashes = []
    for p in prompts:
        hs: list[int] = []
        extend_hashes(hs, p, b, len(p) // b)
        hashes.append(hs)
    hash_ms = 1e3 * (time.perf_counter() - t0) / len(prompts)
    print(f"load average {os.getloadavg()[0]:.2f}; {len(prompts)} prompts, block {b},"
          f" {a.systems} system prompts of {a.system_len} + 0-{a.tail - 1} tokens")  # fmt: skip
    print(f"chained hashing (extend_hashes, both hints): {hash_ms:.3f} ms/prompt")
    for name, hint in (("hash", PrefixIndex()), ("radix", RadixHint(b))):
        r = run(hint, prompts, hashes, a.chunk)
        print(f"{name:5s} propose {r['propose_ms']:.3f} ms/prompt, record {r['record_ms']:.3f}"
              f" ms/prompt, {r['hinted']} blocks hinted")  # fmt: skip


if __name__ == "__main__":
    main()
