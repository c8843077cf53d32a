"""x @ w[layer] for a stacked weight, without copying the layer out (a native CPU kernel).

Why: the decoder layers run under one loop over weights stacked on a leading layer axis
(layers.py). Inside the loop, layer i's weight is a dynamic slice of the stacked array, and
XLA on the CPU materializes that slice into the dot's operand: every step copies each
layer's weights once before the matmul reads them. A decode step reads every weight once
anyway, so the copy doubles the bytes a small step moves (measured on the 8-layer 34M model,
16 tokens: 8 of 26 per-layer fusions were these copies, ~17 ms of a ~40 ms step).
``cpu_matmul.cc`` takes the whole stacked weight and the layer index as operands (as the
native attention kernel takes the stacked KV pool) and reads the layer where it lies.

Contract: ``stacked_matmul(x [..., K], w [L, K, N], layer int32 scalar, native=...)`` equals
``x @ w[layer]`` ([..., N], x's dtype) within fp32 rounding. The kernel runs when ``native``
is true, the backend is the CPU, x and w are fp32, the rows (x's leading dims) are at most
``MAX_ROWS``, N is a multiple of 16, and the library built; otherwise the XLA dot runs on
the sliced weight (today's program exactly). Why at most ``MAX_ROWS`` rows: the kernel is
a simple register-blocked loop; past ~96 rows a step is compute-bound and XLA's own dot
(XNNPACK) is as fast or faster even after paying for the copy (``benchmarks/native_matmul.py``,
idle box: native / XLA 0.21 at 1 row, 0.57 at 16, 0.97 at 64, 0.90 at 96, 1.02 at 128,
1.10 at 192). Why N % 16: the kernel's column tiles are 64 wide with a 16/32/48-wide last
tile (the 34M benchmark model's MLP is 1376 = 21 x 64 + 32 wide).

Refusals: a layer index outside [0, L) is an error from the kernel (never a wild read).
``PAGEDJAX_NATIVE_CPU=0`` disables it with the attention kernel, ``PAGEDJAX_NATIVE_MATMUL=0``
alone (an A/B switch: XLA's dot on the copied slice, the program before this kernel).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from pagedjax.native_build import register_ffi_library

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "pagedjax_stacked_matmul"
SYMBOL = "PagedjaxStackedMatmul"
MAX_ROWS = 96
COLUMN_MULTIPLE = 16  # one AVX-512 vector: cpu_matmul.cc's narrowest column tile


@functools.cache
def _load() -> tuple[bool, str]:
    """Builds and registers the kernel once per process: (ok, reason)."""
    return register_ffi_library(
        SOURCE, {TARGET: SYMBOL}, ("PAGEDJAX_NATIVE_CPU", "PAGEDJAX_NATIVE_MATMUL"),
        "native CPU matmul",
    )  # fmt: skip


def available() -> tuple[bool, str]:
    """(True, how) if the kernel is built and registered, else (False, why not)."""
    return _load()


def uses_native(x: jax.Array, w: jax.Array, native: bool) -> bool:
    """Whether ``stacked_matmul`` runs the kernel for these (static) shapes and dtypes."""
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return (
        native
        and jax.default_backend() == "cpu"
        and x.dtype == jnp.float32
        and w.dtype == jnp.float32
        and w.ndim == 3
        and 0 < rows <= MAX_ROWS
        and w.shape[2] % COLUMN_MULTIPLE == 0
        and available()[0]
    )


def stacked_matmul(x: jax.Array, w: jax.Array, layer: jax.Array, *, native: bool) -> jax.Array:
    """x [..., K] @ w[layer] with w [L, K, N] -> [..., N] (module docstring)."""
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match w {w.shape} ([L, K, N])")
    layer = jnp.asarray(layer, jnp.int32)
    dtype = jnp.result_type(x.dtype, w.dtype)  # nn.Dense's promotion
    x = x.astype(dtype)
    if not uses_native(x, w, native):
        kernel = jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False).astype(dtype)
        return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    lead, k, n = x.shape[:-1], w.shape[1], w.shape[2]
    x2 = x.reshape(-1, k)
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), x.dtype), vmap_method="sequential"
    )
    return call(x2, w, layer.reshape(())).reshape(*lead, n)


__all__ = ["MAX_ROWS", "available", "stacked_matmul", "uses_native"]
