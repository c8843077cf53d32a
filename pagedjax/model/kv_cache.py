"""Allocation of the paged KV cache: one (k, v) pair of pages per layer."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.model.config import ModelArch

KVCache = tuple[tuple[jax.Array, jax.Array], ...]


def allocate_kv_cache(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: Any = jnp.bfloat16,
    fill_value: float = 0.0,
) -> KVCache:
    """Per layer (k, v), each [num_blocks, num_kv_heads, block_size, head_dim] of dtype.

    A tuple of per-layer arrays rather than one stacked array, so a layer's update under a
    donated jit is in place. Block 0 is the null block that padding table entries point at.
    ``fill_value=nan`` is for tests: anything read from an unowned slot then shows up.
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shape = (num_blocks, arch.num_kv_heads, block_size, arch.head_dim)
    return tuple(
        (jnp.full(shape, fill_value, dtype), jnp.full(shape, fill_value, dtype))
        for _ in range(arch.num_layers)
    )
