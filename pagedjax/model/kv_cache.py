"""Allocation of the paged KV cache: one K and one V array stacked over layers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.model.config import ModelArch

# (k, v), each [num_layers, num_blocks, num_kv_heads, block_size, head_dim].
KVCache = tuple[jax.Array, jax.Array]


def kv_cache_shape(arch: ModelArch, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[num_layers, num_blocks, num_kv_heads, block_size, head_dim]: the shape of K and of V."""
    return (arch.num_layers, num_blocks, arch.num_kv_heads, block_size, arch.head_dim)


def allocate_kv_cache(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: Any = jnp.bfloat16,
    fill_value: float = 0.0,
) -> KVCache:
    """(k, v), each [num_layers, num_blocks, num_kv_heads, block_size, head_dim] of dtype.

    Stacked over layers because the model runs its layers under one ``lax.scan`` that
    carries the pool: one buffer per K and V, updated in place under a donated jit, and
    the step compiles one layer body whatever the depth. A page of one head stays one
    contiguous [block_size, head_dim] tile. Block b of every layer belongs to the same
    sequence (one block table for all layers). Block 0 is the null block that padding
    table entries point at. ``fill_value=nan`` is for tests: anything read from an
    unowned slot then shows up.
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shape = kv_cache_shape(arch, num_blocks, block_size)
    return jnp.full(shape, fill_value, dtype), jnp.full(shape, fill_value, dtype)
