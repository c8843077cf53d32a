"""The per-row LoRA delta: row i of x times its own adapter's A and B.

A batch mixes requests of different adapters (and none), so one linear's LoRA term is
``x[i] @ A[slot[i]] @ B[slot[i]] * scale[slot[i]]`` per row. Two ways to compute it over
the fixed-shape slot table (slots.py), both pure and jit-friendly (shapes never depend on
which adapters are loaded, so swapping adapters never recompiles):

* gathered (``lora_delta``): gather each row's A and B, then a batched matmul. Simple and
  shape-static; it reads rows * (in + out) * r weights, so it pays when many rows share
  an adapter (decode of a large batch re-reads the same A per row).
* grouped (``lora_delta_grouped``): sort rows by slot, one segment matmul per slot
  (``jax.lax.ragged_dot``), unsort. Each adapter's weights are read once per group, the
  layout the fused Punica/SGMV kernels use; the sort and scatter cost O(rows).

Slot 0 holds zeros (no adapter), so base rows come out with an exact 0 delta.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


@jax.jit
def lora_delta(
    x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array
) -> jax.Array:
    """x [rows, in], slot_ids int32 [rows], a [slots, in, r], b [slots, r, out],
    scale [slots] -> [rows, out] = (x[i] @ a[s] @ b[s]) * scale[s], s = slot_ids[i].

    Computed in x's dtype promoted with a's (fp32 adapters keep fp32 for bf16 x would
    be a choice for the caller: it casts the result). Out-of-range slot ids are clipped
    (jnp.take's "clip"), never an error: a traced program cannot raise."""
    xa = jnp.einsum("ri,rik->rk", x, jnp.take(a, slot_ids, axis=0, mode="clip"))
    xab = jnp.einsum("rk,rko->ro", xa, jnp.take(b, slot_ids, axis=0, mode="clip"))
    return xab * jnp.take(scale, slot_ids, mode="clip")[:, None].astype(xab.dtype)


@jax.jit
def lora_delta_grouped(
    x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array
) -> jax.Array:
    """``lora_delta``'s contract, computed as a grouped matmul: rows stably sorted by slot,
    ``ragged_dot`` against each slot's A then B over its contiguous group, the scale per
    row, then the rows put back in their order. Group sizes come from a bincount of the
    (clipped) slot ids, so the shapes are static whatever the mix."""
    num_slots = a.shape[0]
    s = jnp.clip(slot_ids, 0, num_slots - 1)
    order = jnp.argsort(s, stable=True)
    sizes = jnp.bincount(s, length=num_slots).astype(jnp.int32)
    xs = jnp.take(x, order, axis=0)
    xa = jax.lax.ragged_dot(xs, a, sizes)
    xab = jax.lax.ragged_dot(xa, b, sizes) * jnp.take(scale, s[order])[:, None].astype(xa.dtype)
    return jnp.zeros_like(xab).at[order].set(xab)


def benchmark_lora_delta(
    rows: int = 256, d_in: int = 512, d_out: int = 512, rank: int = 16, slots: int = 8,
    iters: int = 20, seed: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Times both variants on random inputs (rows spread over ``slots``), prints and
    returns the median milliseconds per call {"gathered": ms, "grouped": ms}. A quick
    comparison for a given backend, not a benchmark suite: compile is excluded."""
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (rows, d_in), jnp.float32)
    ids = jax.random.randint(ks[1], (rows,), 0, slots, jnp.int32)
    a = jax.random.normal(ks[2], (slots, d_in, rank), jnp.float32)
    b = jax.random.normal(ks[3], (slots, rank, d_out), jnp.float32)
    scale = jnp.ones((slots,), jnp.float32)
    out = {}
    for name, fn in (("gathered", lora_delta), ("grouped", lora_delta_grouped)):
        fn(x, ids, a, b, scale).block_until_ready()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(x, ids, a, b, scale).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[name] = sorted(times)[len(times) // 2] * 1e3
    print(f"lora_delta rows={rows} in={d_in} out={d_out} r={rank} slots={slots} "
          f"({jax.default_backend()}): gathered {out['gathered']:.3f} ms, "
          f"grouped {out['grouped']:.3f} ms")  # fmt: skip
    return out
