"""Allocation of the paged KV cache: one K and one V array stacked over layers."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.attention.kv_quant import (
    QuantizedPages,
    allocate_quantized_pages,
    kv_bytes_per_token,
    plain_dtype,
    resolve_kv_format,
)
from pagedjax.model.config import ModelArch

# (k, v), each [num_layers, num_blocks, num_kv_heads, block_size, head_dim]: plain arrays,
# or QuantizedPages (8-bit values of that shape plus their scales) for an 8-bit cache.
KVCache = tuple[jax.Array | QuantizedPages, jax.Array | QuantizedPages]


def kv_cache_shape(arch: ModelArch, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[num_layers, num_blocks, num_kv_heads, block_size, head_dim]: the shape of K and of V."""
    return (arch.num_layers, num_blocks, arch.num_kv_heads, block_size, arch.head_dim)


def allocate_kv_cache(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: Any = jnp.bfloat16,
    fill_value: float = 0.0,
    *,
    kv_cache_dtype: str = "auto",
    layer_scale: tuple[tuple[float, ...], ...] | None = None,
) -> KVCache:
    """(k, v), each [num_layers, num_blocks, num_kv_heads, block_size, head_dim] of dtype.

    Stacked over layers because the model runs its layers under one ``fori_loop`` that
    carries the pool: one buffer per K and V, updated in place under a donated jit, and
    the step compiles one layer body whatever the depth. A page of one head stays one
    contiguous [block_size, head_dim] tile. Block b of every layer belongs to the same
    sequence (one block table for all layers). Block 0 is the null block that padding
    table entries point at. ``fill_value=nan`` is for tests: anything read from an
    unowned slot then shows up.

    kv_cache_dtype: "auto" (``dtype``), "float32" / "bfloat16" / "float16", or an 8-bit
    format ("fp8" = "fp8_e4m3", "fp8_e5m2", "int8_per_token_head"): then K and V are
    ``QuantizedPages`` of the same shape (``pagedjax.attention.kv_quant``); ``layer_scale``
    gives fp8's per-(layer, KV head) scales (default 1.0).
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shape = kv_cache_shape(arch, num_blocks, block_size)
    fmt = resolve_kv_format(kv_cache_dtype)
    if fmt is not None:
        return tuple(  # type: ignore[return-value]
            allocate_quantized_pages(shape, fmt, layer_scale=layer_scale, fill_value=fill_value)
            for _ in range(2)
        )
    dtype = plain_dtype(kv_cache_dtype, dtype)
    return _filled_pair(tuple(shape), fill_value, dtype)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _filled_pair(shape: tuple[int, ...], fill_value: float, dtype: Any) -> tuple[Any, Any]:
    """(K, V) filled on device in one program: the two eager ``jnp.full`` calls this
    replaces compiled two op-by-op programs (a ``stage`` of the fill value and a
    ``broadcast_in_dim``) per pool shape; a pool is too large to build on the host."""
    return jnp.full(shape, fill_value, dtype), jnp.full(shape, fill_value, dtype)


def cache_bytes_per_token(arch: ModelArch, kv_cache_dtype: str, model_dtype: Any) -> int:
    """Bytes of K and V (with their scales) per token across all layers."""
    return kv_bytes_per_token(
        arch.num_layers, arch.num_kv_heads, arch.head_dim, kv_cache_dtype, model_dtype
    )
