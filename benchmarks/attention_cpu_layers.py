"""The native CPU attention kernel on the engine's batches of SmolLM2-135M, all 30 layers,
today's ``cpu_kernel.cc`` against the one at a git revision, in one process.

    python benchmarks/attention_cpu_layers.py --old-kernel 9a947e3 [--rounds 7]

Why a second attention benchmark: ``attention_cpu.py`` times one layer over a pool that
stays in the last-level cache between repeats, while the engine's decode step reads each
layer's pages once from a pool larger than the cache (64 rows x 160 tokens x 30 layers of
3 KV heads x 64 is ~470 MB of K and V per step). Here the pool is stacked over 30 layers
(9 query / 3 KV heads of 64, fp32, pages of 16, 1,024 pages per layer, each live table
entry a distinct page in random order),
and one call runs the kernel for every layer under ``fori_loop`` as the model does.
Batches: 64 decode rows at context 160 (the serving benchmark's decode steps) and a
2,048-token prefill of 16 x 128-token prompts (its prefill steps). The two kernels
alternate within each round; printed: the median ms per call of each, their ratio, and the
largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from attention_cpu import old_kernel  # noqa: E402

from pagedjax.attention import native_cpu  # noqa: E402
from pagedjax.machine import cpu_model  # noqa: E402

HQ, HKV, D, BS, NB, LAYERS, MAX_BLOCKS = 9, 3, 64, 16, 1024, 30, 64


def batch(rng, q_lens: list[int], kv_lens: list[int]) -> tuple:
    q = jnp.asarray(rng.standard_normal((sum(q_lens), HQ, D)), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    # Distinct pages for every live table entry (as the engine's allocator gives them).
    tables = np.zeros((len(q_lens), MAX_BLOCKS), np.int32)
    live = [-(-n // BS) for n in kv_lens]
    ids = iter(rng.permutation(np.arange(1, NB)))
    for s, n in enumerate(live):
        tables[s, :n] = [next(ids) for _ in range(n)]
    tables = jnp.asarray(tables)
    return q, tables, jnp.asarray(kv_lens, jnp.int32), cu


def all_layers(attend):
    """One call: the kernel for every layer of the stacked pool, outputs summed."""

    def run(q, k, v, tables, kv_lens, cu):
        def body(layer, acc):
            return acc + attend(q, k, v, tables, kv_lens, cu, layer)

        return jax.lax.fori_loop(0, LAYERS, body, jnp.zeros_like(q))

    return jax.jit(run)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-kernel", required=True, help="git revision of cpu_kernel.cc")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    ok, why = native_cpu.available()
    if not ok:
        sys.exit(f"the native kernel is not available: {why}")
    old = old_kernel(a.old_kernel)
    scale = D**-0.5
    new = all_layers(lambda q, k, v, t, kv, cu, layer: native_cpu.ragged_paged_attention(
        q, k, v, t, kv, cu, layer=layer, sm_scale=scale))  # fmt: skip
    before = all_layers(lambda q, k, v, t, kv, cu, layer: old(
        q, k, v, t, kv, cu, sm_scale=scale, layer=layer))  # fmt: skip
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((LAYERS, NB, HKV, BS, D)), jnp.float32)
            for _ in "kv")  # fmt: skip
    cases = {
        "decode 64 rows, context 160": batch(rng, [1] * 64, [160] * 64),
        "prefill 16 x 128 tokens": batch(rng, [128] * 16, [128] * 16),
    }
    print(f"jax {jax.__version__}, {cpu_model()}; {LAYERS} layers of {HQ} / {HKV} heads of {D},"
          f" fp32, pages of {BS}; old kernel: {a.old_kernel}")  # fmt: skip
    print(f"{'batch':>28} | {'old ms':>7} | {'new ms':>7} | {'old/new':>7} | max |diff|")
    for name, (q, tables, kv_lens, cu) in cases.items():
        args = (q, k, v, tables, kv_lens, cu)
        diff = float(jnp.max(jnp.abs(before(*args) - new(*args))))  # also compiles both
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(a.rounds):
            for label, fn in (("old", before), ("new", new)):
                t0 = time.perf_counter()
                fn(*args).block_until_ready()
                times[label].append((time.perf_counter() - t0) * 1e3)
        o, n = (float(np.median(times[x])) for x in ("old", "new"))
        print(f"{name:>28} | {o:>7.1f} | {n:>7.1f} | {o / n:>7.2f} | {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
