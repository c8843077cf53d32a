"""Ragged paged attention as a native CPU kernel (an XLA FFI custom call), fp32 or 8-bit pages.

The XLA version (``reference.py``) has to gather each chunk of pages into a temporary and
then run many tiny batched dots on it; on a 2-core CPU that costs ~4x the time of reading
the KV once. ``cpu_kernel.cc`` reads every page straight from the pool, once per work unit
(sequence, KV head, tile of 16 queries), with an online softmax, on the calling thread plus
XLA's intra-op thread pool. Same signature and contract as ``reference.ragged_paged_attention``
(its oracle; tests/test_attention_native.py checks parity under Hypothesis).

The kernel is compiled on first use (``pagedjax/native_build.py``: the system C++ compiler,
a cache directory keyed by the source, flags, compiler and CPU). ``available()`` says
whether it built and why not; ``ragged_paged_attention`` falls back to the XLA version
when it did not or when the inputs are not fp32, so callers never depend on a compiler.

8-bit pools (``kv_quant.QuantizedPages``: int8 with per token-head scales, fp8 E4M3 / E5M2
with per layer-head scales) go to a second handler of the same source, which converts each
page it walks to fp32 in C++ (fp8 through a byte table) and then runs the fp32 loop.

Draft-tree masks (``tree_mask``, docs/attention.md "Tree masks") are one more operand of
both handlers: one uint32 word per query token, or an empty array for none.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.attention import reference
from pagedjax.attention.kv_quant import QuantizedPages
from pagedjax.native_build import build_library, compiler, register_ffi_library
from pallas_kernels.reference import stacked_pool

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
TARGET = "pagedjax_ragged_paged_attention"
SYMBOL = "PagedjaxRaggedPagedAttention"
TARGET8 = "pagedjax_ragged_paged_attention_8bit"
SYMBOL8 = "PagedjaxRaggedPagedAttention8"
# The 8-bit handler's `mode` attribute by format name (cpu_kernel.cc, PageMode).
MODES = {"int8_per_token_head": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}


@functools.cache
def _load() -> tuple[bool, str]:
    """Builds and registers the kernel once per process: (ok, reason)."""
    targets = {TARGET: SYMBOL, TARGET8: SYMBOL8}
    return register_ffi_library(SOURCE, targets, ("PAGEDJAX_NATIVE_CPU",), "native CPU attention")


def available() -> tuple[bool, str]:
    """(True, how) if the native kernel is built and registered, else (False, why not)."""
    return _load()


@functools.cache
def vector_path() -> bool:
    """Whether the built kernel runs its AVX-512 loop for head dims 64, 80, 96, 128 and 256
    (``cpu_kernel.cc``: compiled with ``-march=native`` on a CPU that has AVX-512); False
    where the kernel is not available."""
    if not available()[0]:
        return False
    path = build_library(SOURCE, jax.ffi.include_dir(), compiler())  # built: the cached file
    return bool(ctypes.cdll.LoadLibrary(str(path)).PagedjaxAttentionVectorPath())


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array | QuantizedPages,
    v_pages: jax.Array | QuantizedPages,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    tree_mask: jax.Array | None = None,
    chunk_keys: int | None = None,
    chunk_bytes: int | None = None,
) -> jax.Array:
    """``reference.ragged_paged_attention`` (same arguments, shapes and result) on the CPU.

    Runs the native kernel for fp32 q and pages when it is available, else the XLA version
    (``chunk_keys`` / ``chunk_bytes`` only tile the XLA version). Inputs are checked as
    the XLA version checks them; the kernel also reports, as an error, a sequence with
    q_len > kv_len or kv_len beyond its table, a page id outside the pool and a layer
    index outside it. The whole stacked pool [L, N, Hkv, B, D] and ``layer`` go to the
    kernel as operands (no per-layer slice is materialized); ``sliding_window`` may be a
    traced int32 scalar (<= 0: no window). An 8-bit pool (``QuantizedPages`` K and V,
    stacked, with a layer index) runs the 8-bit handler for fp32 q. ``tree_mask``
    uint32[T] (draft-tree rows, ``pallas_kernels.reference.tree_visible``) goes to either
    handler; None passes an empty operand and costs nothing.
    """
    quantized = isinstance(k_pages, QuantizedPages)
    use_native = (
        jax.default_backend() == "cpu"
        and q.dtype == jnp.float32
        and (quantized or (k_pages.dtype == jnp.float32 and v_pages.dtype == jnp.float32))
        and available()[0]
    )
    if not use_native:
        return reference.ragged_paged_attention(
            q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, layer=layer,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            tree_mask=tree_mask, chunk_keys=chunk_keys, chunk_bytes=chunk_bytes,
        )  # fmt: skip
    fmt = k_pages.fmt if quantized else None
    k_pages, v_pages, k_scale, v_scale, _ = reference.split_quantized(k_pages, v_pages, layer)
    reference.check_shapes(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, layer)
    reference.check_options(sliding_window, soft_cap)
    k_pages, v_pages, layer = stacked_pool(k_pages, v_pages, layer)
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    if tree_mask is not None and tree_mask.shape != (q.shape[0],):
        raise ValueError(f"tree_mask must be uint32[T={q.shape[0]}], got {tree_mask.shape}")
    # No mask: an empty operand, which the kernel reads as "causal" (no per-row work).
    tree = jnp.zeros((0,), jnp.uint32) if tree_mask is None else tree_mask.astype(jnp.uint32)
    if fmt is not None:
        call8 = jax.ffi.ffi_call(
            TARGET8, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential"
        )
        return call8(
            q, k_pages, v_pages, k_scale, v_scale,
            block_tables.astype(jnp.int32), kv_lens.astype(jnp.int32),
            cu_q_lens.astype(jnp.int32), layer, window, tree,
            sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
            mode=np.int32(MODES[fmt.name]),
        )  # fmt: skip
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential"
    )
    return call(
        q,
        k_pages,
        v_pages,
        block_tables.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        layer,
        window,
        tree,
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
    )
