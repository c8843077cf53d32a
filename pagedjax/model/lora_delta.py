"""The per-row LoRA delta: row i of x times its own adapter's A and B.

A batch mixes requests of different adapters (and none), so one linear's LoRA term is
``x[i] @ A[slot[i]] @ B[slot[i]] * scale[slot[i]]`` per row. Two ways to compute it over
the fixed-shape slot table (slots.py), both pure and jit-friendly (shapes never depend on
which adapters are loaded, so swapping adapters never recompiles):

* gathered (``lora_delta_gathered``): gather each row's A and B, then a batched matmul.
  Simple and shape-static; it copies rows * (in + out) * r weights, so it pays when many
  rows share an adapter (a prefill chunk copies the same A per token).
* dense (``lora_delta_dense``): x times every slot's A at once ([rows, in] @ [in, slots *
  r], one plain matmul), each row's other slots masked to exact zeros (times its scale),
  then times every slot's B. No copies; slots x the gathered form's FLOPs.
* grouped (``lora_delta_grouped``): sort rows by slot, one segment matmul per slot
  (``jax.lax.ragged_dot``), unsort. Each adapter's weights are read once per group, the
  layout the fused Punica/SGMV kernels use; the sort and scatter cost O(rows).

Slot 0 holds zeros (no adapter), so base rows come out with an exact 0 delta.

On the CPU at fp32 the model's linears run ``native_lora.py``'s kernel instead (rows
grouped by adapter, the tables read in place: cheaper than all three here, docs/lora.md);
these forms serve every other case (bf16, GPUs, tensor parallelism, the switch off).

``lora_delta`` (what the model's linears call there) picks one of them per call from its static
shapes (``lora_delta_form``), so the choice costs nothing at run time and each step
bucket gets its own: measured on the 2-core CPU (docs/lora.md, "Gathered vs grouped
matmul"), the gathered form is the fastest while its copies stay in cache (decode
buckets: 64 rows x 576 x rank 8 = 0.29 ms vs dense 0.51, grouped 6.6) and falls off a
cliff past it (1,024 rows, rank 8: 92 ms vs dense 6.5 ms; rank 64: 1,185 vs 217), where
the dense form wins while its extra FLOPs (x slots) stay small. ``ragged_dot`` (grouped)
never won on this CPU (XLA lowers it to one masked matmul per group); it is kept for
backends with a native segment matmul. The forms agree to float rounding (the sums run
in different orders), not bit for bit.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

# When ``lora_delta`` takes the dense form (measured on the 2-core CPU, docs/lora.md,
# "Gathered vs grouped matmul"). Isolated calls: the gathered form's copies (rows x
# (in + out) x r elements) ran at the dense form's speed up to ~19 MB and 5-15x slower at
# 38 MB (1,024 rows x 1,152 x rank 8: 92 vs 6.5 ms; 128 x 1,152 x 64: 99 vs 18 ms). Inside
# a 30-layer loop of SmolLM2's seven linears (slots 17, rank 8), the per-layer slices made
# the gather costlier still: gathered / dense 68 / 182 ms at 16 rows, 146 / 127 at 32,
# 823 / 434 at 64, 1,535 / 740 at 256; at rank 64 (1,088 dense columns) gathered won at
# 64 rows (2,411 / 2,792). So: dense past the copy limit, or from 32 rows while the dense
# matmul is narrow (slots x rank <= 160); never past 33 slots (its FLOPs grow x slots).
GATHER_COPY_BYTES = 24 << 20
DENSE_MIN_ROWS = 32
DENSE_NARROW_COLUMNS = 160
DENSE_MAX_SLOTS = 33


def lora_delta_form(rows: int, d_in: int, d_out: int, rank: int, slots: int,
                    itemsize: int = 4) -> str:  # fmt: skip
    """"gathered" or "dense": the form ``lora_delta`` uses for these static shapes."""
    if slots > DENSE_MAX_SLOTS:
        return "gathered"
    copies = rows * (d_in + d_out) * rank * itemsize
    narrow = rows >= DENSE_MIN_ROWS and slots * rank <= DENSE_NARROW_COLUMNS
    return "dense" if copies > GATHER_COPY_BYTES or narrow else "gathered"


@jax.jit
def lora_delta(
    x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array
) -> jax.Array:
    """x [rows, in], slot_ids int32 [rows], a [slots, in, r], b [slots, r, out],
    scale [slots] -> [rows, out] = (x[i] @ a[s] @ b[s]) * scale[s], s = slot_ids[i].

    The gathered or the dense form, chosen by ``lora_delta_form`` from the shapes (static
    under jit: one program per shape, as before). Computed in x's dtype promoted with a's
    (the caller casts the result). Out-of-range slot ids are clipped, never an error: a
    traced program cannot raise."""
    form = lora_delta_form(x.shape[0], a.shape[1], b.shape[2], a.shape[2], a.shape[0],
                           jnp.result_type(x, a).itemsize)  # fmt: skip
    fn = _dense if form == "dense" else _gathered
    return fn(x, slot_ids, a, b, scale)


def _gathered(x, slot_ids, a, b, scale):
    xa = jnp.einsum("ri,rik->rk", x, jnp.take(a, slot_ids, axis=0, mode="clip"))
    xab = jnp.einsum("rk,rko->ro", xa, jnp.take(b, slot_ids, axis=0, mode="clip"))
    return xab * jnp.take(scale, slot_ids, mode="clip")[:, None].astype(xab.dtype)


def _dense(x, slot_ids, a, b, scale):
    num_slots = a.shape[0]
    s = jnp.clip(slot_ids, 0, num_slots - 1)
    xa = jnp.einsum("ri,sik->rsk", x, a)  # every slot's A: one [rows, in] @ [in, slots*r]
    own = (s[:, None] == jnp.arange(num_slots)[None, :]).astype(xa.dtype)
    w = own * scale[None, :].astype(xa.dtype)  # [rows, slots]: the row's scale, else 0
    return jnp.einsum("rsk,sko->ro", xa * w[:, :, None], b)


@jax.jit
def lora_delta_gathered(
    x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array
) -> jax.Array:
    """``lora_delta``'s contract, always the gathered form (A[slot], B[slot] per row)."""
    return _gathered(x, slot_ids, a, b, scale)


@jax.jit
def lora_delta_dense(
    x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array
) -> jax.Array:
    """``lora_delta``'s contract, always the dense form (every slot's A and B, the other
    slots masked to exact zeros; a base row (slot 0, all-zero A and B) gets exact 0)."""
    return _dense(x, slot_ids, a, b, scale)


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
    """Times the variants on random inputs (rows spread over ``slots``), prints and
    returns the median milliseconds per call {"gathered": ms, "dense": ms, "grouped": ms}
    and the form ``lora_delta`` picks ("chosen"). A quick comparison for a given backend,
    not a benchmark suite: compile is excluded."""
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (rows, d_in), jnp.float32)
    ids = jax.random.randint(ks[1], (rows,), 0, slots, jnp.int32)
    a = jax.random.normal(ks[2], (slots, d_in, rank), jnp.float32)
    b = jax.random.normal(ks[3], (slots, rank, d_out), jnp.float32)
    scale = jnp.ones((slots,), jnp.float32)
    out: dict[str, Any] = {}
    forms = (("gathered", lora_delta_gathered), ("dense", lora_delta_dense),
             ("grouped", lora_delta_grouped))  # fmt: skip
    for name, fn in forms:
        fn(x, ids, a, b, scale).block_until_ready()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(x, ids, a, b, scale).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[name] = sorted(times)[len(times) // 2] * 1e3
    print(f"lora_delta rows={rows} in={d_in} out={d_out} r={rank} slots={slots} "
          f"({jax.default_backend()}): gathered {out['gathered']:.3f} ms, dense"
          f" {out['dense']:.3f} ms, grouped {out['grouped']:.3f} ms")  # fmt: skip
    out["chosen"] = lora_delta_form(rows, d_in, d_out, rank, slots)
    return out
