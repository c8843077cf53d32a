"""Scatter of new keys/values into the paged KV pool by slot mapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Slot index of a token that must write nowhere (padding). Any slot >= num_blocks * block_size
# is dropped by the scatter; int32 max is out of range for every realistic pool.
PAD_SLOT: int = int(jnp.iinfo(jnp.int32).max)


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Writes one step's keys and values into their slots of the paged pool.

    Args:
      k_pages, v_pages: [num_blocks, num_kv_heads, block_size, head_dim].
      k, v: [T, num_kv_heads, head_dim] new keys/values (cast to the pool dtype).
      slot_mapping: int32[T], slot = block * block_size + offset. Slots >= num_blocks *
        block_size (use ``PAD_SLOT``) are dropped, so padding tokens write nowhere.
        Negative slots must never be used: -1 would wrap to the last slot of the last block
        like a plain Python index, silently overwriting live data.

    Returns:
      (k_pages, v_pages) updated; under jit with the pool donated this is in place.
    """
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must both be [num_blocks, num_kv_heads, block_size, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}"
        )
    num_blocks, num_kv_heads, block_size, head_dim = k_pages.shape
    if k.shape != v.shape or k.ndim != 3 or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k/v must be [T, {num_kv_heads}, {head_dim}], got {k.shape} and {v.shape}"
        )
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"slot_mapping must be int32[{k.shape[0]}], got {slot_mapping.shape}")
    slot_mapping = slot_mapping.astype(jnp.int32)
    # Out-of-range slots give block >= num_blocks, which mode="drop" discards.
    block = slot_mapping // block_size
    offset = slot_mapping % block_size
    # Advanced indices on dims 0 and 2 around a slice: the update is indexed [T, heads, dim].
    k_pages = k_pages.at[block, :, offset].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[block, :, offset].set(v.astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages
