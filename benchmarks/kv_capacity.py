"""KV-cache capacity per KV dtype at equal memory: blocks in the pool and the largest batch.

    python benchmarks/kv_capacity.py [--model llama-2-7b] [--gpu A100-80GB] [--util 0.9]

Computed, not timed: the pool gets ``util`` x the GPU's memory minus the model's weights
(16-bit; no activation reserve, the same for every dtype, so the ratios hold whatever the
reserve), divided by the bytes of one block of 16 tokens in each KV dtype
(pagedjax.simulator.cost_model.ModelGeometry.kv_bytes_per_token, int8's per token-head
scales included). The largest batch is the number of sequences whose blocks all fit at
once, at the model's full context and at ShareGPT's mean request (161 + 338 tokens,
paper_notes.md). The last line is ``fp8_capacity_gain: X`` (fp8 blocks / auto blocks).
"""

from __future__ import annotations

import argparse

from pagedjax.simulator.cost_model import GPUS, model_geometry

DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head")
BLOCK = 16
SHAREGPT_MEAN_TOKENS = 161 + 338  # mean input + output (paper_notes.md)


def capacity(model: str, gpu: str, util: float, context: int) -> list[dict]:
    rows = []
    for name in DTYPES:
        geom = model_geometry(model, kv_cache_dtype=name)
        kv_bytes = util * GPUS[gpu].memory_bytes - geom.weight_bytes
        per_block = BLOCK * geom.kv_bytes_per_token
        blocks = int(kv_bytes // per_block)
        rows.append(
            dict(
                kv_cache_dtype=name,
                bytes_per_token=geom.kv_bytes_per_token,
                blocks=blocks,
                tokens=blocks * BLOCK,
                batch_full_context=blocks // -(-context // BLOCK),
                batch_sharegpt_mean=blocks // -(-SHAREGPT_MEAN_TOKENS // BLOCK),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--gpu", default="A100-80GB", choices=sorted(GPUS))
    ap.add_argument("--util", type=float, default=0.9, help="gpu_memory_utilization")
    ap.add_argument("--context", type=int, default=4096, help="the model's full context")
    a = ap.parse_args(argv)
    rows = capacity(a.model, a.gpu, a.util, a.context)
    geom = model_geometry(a.model)
    kv_gib = (a.util * GPUS[a.gpu].memory_bytes - geom.weight_bytes) / 2**30
    print(f"{a.model} on {a.gpu}: {a.util} x {GPUS[a.gpu].memory_bytes / 1e9:.0f} GB - "
          f"{geom.weight_bytes / 2**30:.1f} GiB weights = {kv_gib:.1f} GiB of KV; "
          f"blocks of {BLOCK} tokens (computed)")  # fmt: skip
    at_context = f"batch @{a.context}"
    print(f"{'kv_cache_dtype':>20} | {'B/token':>8} | {'blocks':>7} | {'tokens':>8} | "
          f"{'x auto':>6} | {at_context:>11} | {'batch @ShareGPT':>15}")  # fmt: skip
    base = rows[0]["blocks"]
    for r in rows:
        print(f"{r['kv_cache_dtype']:>20} | {r['bytes_per_token']:>8} | {r['blocks']:>7} | "
              f"{r['tokens']:>8} | {r['blocks'] / base:>6.2f} | {r['batch_full_context']:>11} | "
              f"{r['batch_sharegpt_mean']:>15}")  # fmt: skip
    gain = rows[1]["blocks"] / base
    print(f"fp8_capacity_gain: {gain:.3f}")
    return gain


if __name__ == "__main__":
    main()
