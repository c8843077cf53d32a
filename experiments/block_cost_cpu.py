"""Cross-check of the simulator's per-block cost (Fig. 18b): the native CPU paged-attention
kernel timed on one decode batch at several block sizes.

The batch: ``seqs`` sequences of ``context`` tokens each (a multiple of every block size,
so every size reads the same bytes), 8 KV heads of 64, fp32, block tables a random
permutation of the pool. Only the number of block visits changes with the block size,
so t(b) = a + c x visits(b) with visits = seqs x heads x context / b; ``c`` is the
kernel's fixed cost per block visit. It is reported as tokens' worth of the same kernel's
per-token time (at least: the largest block's whole time per token-head), beside the simulator's GPU
setting (systems.BLOCK_COSTS["kernel"]: 3.7 tokens, from the paper's Fig. 18a). A CPU is
not a GPU: this checks the order of magnitude and the sign, not the value. Real (measured).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

HEADS, HEAD_DIM = 8, 64


def measure(block_sizes: list[int], seqs: int = 16, context: int = 512, reps: int = 5) -> dict:
    """Median kernel time per block size and the fitted per-visit cost (see module doc)."""
    import jax
    import jax.numpy as jnp

    from pagedjax.attention import native_cpu

    ok, why = native_cpu.available()
    if not ok:
        return {"status": f"not available: {why}"}
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((seqs, HEADS, HEAD_DIM)), jnp.float32)
    cu = jnp.arange(seqs + 1, dtype=jnp.int32)
    kv = jnp.full((seqs,), context, jnp.int32)
    times: dict[int, float] = {}
    for b in block_sizes:
        per_seq = context // b
        nb = 1 + seqs * per_seq
        shape = (nb, HEADS, b, HEAD_DIM)
        k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        bt = jnp.asarray((1 + rng.permutation(nb - 1)).reshape(seqs, per_seq), jnp.int32)
        f = jax.jit(lambda *a: native_cpu.ragged_paged_attention(*a, sm_scale=HEAD_DIM**-0.5))
        f(q, k, v, bt, kv, cu).block_until_ready()  # compile
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f(q, k, v, bt, kv, cu).block_until_ready()
            ts.append(time.perf_counter() - t0)
        times[b] = float(np.median(ts))
    visits = np.array([seqs * HEADS * context / b for b in block_sizes])
    t = np.array([times[b] for b in block_sizes])
    c, _ = np.polyfit(visits, t, 1)
    # The largest block's whole time per token-head: an upper bound of the per-token cost
    # (it still holds a few visits), so per_visit_tokens is a lower bound.
    per_token = times[max(block_sizes)] / (seqs * HEADS * context)
    return {
        "executor": "real (native CPU kernel)",
        "seqs": seqs,
        "context": context,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "ms_by_block_size": {str(b): round(1e3 * x, 3) for b, x in times.items()},
        "per_visit_us": round(1e6 * c, 4),
        "per_visit_tokens": round(float(c / per_token), 2) if per_token > 0 else None,
    }


def describe(m: dict[str, Any]) -> str:
    if "status" in m:
        return m["status"]
    return (
        f"{m['per_visit_us']} us per block visit = at least {m['per_visit_tokens']} tokens'"
        " worth"
        f" (ms by block size {m['ms_by_block_size']})"
    )
