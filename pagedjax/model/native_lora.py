"""The LoRA delta of a mixed-adapter batch as a native CPU kernel (grouped by adapter).

Why: on the CPU neither XLA form of ``lora_delta`` is cheap at decode's 64 rows with 16
adapters. The dense form multiplies every row by all slots' A and B (17 x the useful
multiply-adds: ~83 M per SmolLM2 layer against the base layer's 226 M), the gathered form
copies each row's A and B (~20 MB per layer), and ``ragged_dot`` lowers to one masked
matmul per group. Under the layer loop every form also first copies the layer's slice of
the stacked [L, slots, in, r] tables. ``cpu_lora.cc`` sorts the rows by slot (a counting
sort), reads each adapter's A and B once per group of up to 8 rows where they lie in the
stacked table (as ``cpu_matmul.cc`` reads a stacked weight), and does only the useful
rows x (in + out) x r multiply-adds; base rows (slot 0) get exact zeros without work,
so the Linear needs no ``lax.cond`` around it (docs/lora.md has the measurements).

Contract: ``stacked_lora_delta(x [..., K], slot_ids int32 [...], a [L, S, K, R], b [L,
S, R, N], scale [S], layer int32 scalar)`` equals ``lora_delta(x, slot_ids, a[layer],
b[layer], scale)`` ([..., N], float32) within fp32 rounding; slot ids are clipped to
[0, S) as there. Used when ``uses_native_lora`` holds: the caller allows native kernels,
the backend is the CPU, x, A and B are float32, R <= 512 and the library built;
otherwise the caller runs ``lora_delta`` on the sliced tables (XLA, as before).

Refusals: a layer index outside [0, L) or mismatched shapes are errors from the kernel
(never a wild read). ``PAGEDJAX_NATIVE_CPU=0`` disables it with the other kernels,
``PAGEDJAX_NATIVE_LORA=0`` alone (an A/B switch back to the XLA forms).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from pagedjax.native_build import register_ffi_library

SOURCE = Path(__file__).with_name("cpu_lora.cc")
TARGET = "pagedjax_lora_delta"
SYMBOL = "PagedjaxLoraDelta"
MAX_RANK = 512  # cpu_lora.cc's per-unit buffer (kMaxRank)


@functools.cache
def _load() -> tuple[bool, str]:
    """Builds and registers the kernel once per process: (ok, reason)."""
    return register_ffi_library(
        SOURCE, {TARGET: SYMBOL}, ("PAGEDJAX_NATIVE_CPU", "PAGEDJAX_NATIVE_LORA"),
        "native CPU LoRA delta",
    )  # fmt: skip


def available() -> tuple[bool, str]:
    """(True, how) if the kernel is built and registered, else (False, why not)."""
    return _load()


def uses_native_lora(x: jax.Array, a: jax.Array, b: jax.Array, native: bool) -> bool:
    """Whether ``stacked_lora_delta`` runs the kernel for these (static) shapes and dtypes;
    a, b: the stacked [L, S, K, R] / [L, S, R, N] tables."""
    return (
        native
        and jax.default_backend() == "cpu"
        and x.dtype == jnp.float32
        and a.dtype == jnp.float32
        and b.dtype == jnp.float32
        and a.ndim == 4
        and b.ndim == 4
        and a.shape[3] <= MAX_RANK
        and available()[0]
    )


def stacked_lora_delta(
    x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array,
    layer: jax.Array | int,
) -> jax.Array:  # fmt: skip
    """x [..., K], slot_ids int32 [...] -> [..., N] float32: row i's
    ``x[i] @ a[layer, s] @ b[layer, s] * scale[s]``, s = slot_ids[i] (module docstring).
    Call only where ``uses_native_lora`` holds."""
    ok, why = available()  # registers the FFI target before a program can call it
    if not ok:
        raise RuntimeError(f"native LoRA kernel unavailable: {why}")
    lead, k, n = x.shape[:-1], a.shape[2], b.shape[3]
    if x.shape[-1] != k or slot_ids.shape != lead:
        raise ValueError(f"x {x.shape} and slot_ids {slot_ids.shape} do not match a {a.shape}")
    x2 = x.reshape(-1, k)
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32), vmap_method="sequential"
    )
    out = call(
        x2, slot_ids.reshape(-1).astype(jnp.int32), a, b, scale.astype(jnp.float32),
        jnp.asarray(layer, jnp.int32).reshape(()),
    )  # fmt: skip
    return out.reshape(*lead, n)


__all__ = ["MAX_RANK", "available", "stacked_lora_delta", "uses_native_lora"]
