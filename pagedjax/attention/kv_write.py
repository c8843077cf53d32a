"""Scatter of new keys/values into the paged KV pool by slot mapping.

The pool is stacked over layers (``[num_layers, num_blocks, num_kv_heads, block_size,
head_dim]`` per K and V) and the layer loop carries it: each layer writes its rows with a
dynamic ``layer`` index into the carried arrays, which XLA updates in place (no per-layer
slice, no copy). A 4-D pool (one layer) is still accepted with ``layer=None``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.attention.kv_quant import QuantizedPages, quantize

# Slot index of a token that must write nowhere (padding). Any slot >= num_blocks * block_size
# is dropped by the scatter; int32 max is out of range for every realistic pool.
PAD_SLOT: int = int(jnp.iinfo(jnp.int32).max)


def write_kv(
    k_pool: jax.Array | QuantizedPages,
    v_pool: jax.Array | QuantizedPages,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array | QuantizedPages, jax.Array | QuantizedPages]:
    """Writes one step's keys and values of one layer into their slots of the paged pool.

    Args:
      k_pool, v_pool: [num_layers, num_blocks, num_kv_heads, block_size, head_dim] with
        ``layer`` an int32 scalar (traced or not) in [0, num_layers); or one layer's
        [num_blocks, num_kv_heads, block_size, head_dim] with ``layer=None``.
        Either may be ``QuantizedPages`` (an 8-bit pool, ``kv_quant``): the new rows are
        quantized (saturating) and their int8 scales written to the same slots.
      k, v: [T, num_kv_heads, head_dim] new keys/values (cast to the pool dtype).
      slot_mapping: int32[T], slot = block * block_size + offset. Slots >= num_blocks *
        block_size (use ``PAD_SLOT``) are dropped, so padding tokens write nowhere.
        Negative slots must never be used: -1 would wrap to the last slot of the last block
        like a plain Python index, silently overwriting live data.

    Returns:
      (k_pool, v_pool) updated; under jit with the pool donated (or carried through a
      loop) this is in place.
    """
    if k_pool.shape != v_pool.shape or k_pool.ndim not in (4, 5):
        raise ValueError(
            "k_pool/v_pool must both be [num_layers, num_blocks, num_kv_heads, block_size, "
            f"head_dim] (or one layer's 4-D pages), got {k_pool.shape} and {v_pool.shape}"
        )
    if (k_pool.ndim == 5) != (layer is not None):
        raise ValueError(
            f"a {k_pool.ndim}-D pool needs layer={'an index' if k_pool.ndim == 5 else 'None'}"
        )
    num_blocks, num_kv_heads, block_size, head_dim = k_pool.shape[-4:]
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
    if layer is None and isinstance(k_pool, QuantizedPages):
        raise ValueError("a quantized pool is written with its layer index (stacked 5-D form)")
    if layer is None:
        # Advanced indices on dims 0 and 2 around a slice: the update is [T, heads, dim].
        k_pool = k_pool.at[block, :, offset].set(k.astype(k_pool.dtype), mode="drop")
        v_pool = v_pool.at[block, :, offset].set(v.astype(v_pool.dtype), mode="drop")
        return k_pool, v_pool
    lyr = jnp.full(block.shape, layer, jnp.int32)
    if isinstance(k_pool, QuantizedPages):
        return (
            _write_quantized(k_pool, k, block, offset, layer),
            _write_quantized(v_pool, v, block, offset, layer),
        )
    k_pool = k_pool.at[lyr, block, :, offset].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[lyr, block, :, offset].set(v.astype(v_pool.dtype), mode="drop")
    return k_pool, v_pool


def _write_quantized(
    pool: QuantizedPages, x: jax.Array, block: jax.Array, offset: jax.Array, layer: jax.Array | int
) -> QuantizedPages:
    """Quantize x [T, Hkv, D] and scatter values (and int8 scales) at [layer, block, :, offset]."""
    if not isinstance(pool, QuantizedPages):
        raise ValueError("k_pool and v_pool must both be quantized or both plain")
    layer_scale = None
    if pool.token_scale is None:  # fp8: this layer's per-head scales, [Hkv, 1]
        layer_scale = jnp.asarray(pool.layer_scale, jnp.float32)[layer][:, None]
    values, scale = quantize(x, pool.fmt, layer_scale)
    lyr = jnp.full(block.shape, layer, jnp.int32)
    new_values = pool.values.at[lyr, block, :, offset].set(values, mode="drop")
    new_scale = pool.token_scale
    if scale is not None:
        new_scale = pool.token_scale.at[lyr, block, :, offset].set(scale, mode="drop")
    return QuantizedPages(new_values, new_scale, pool.fmt, pool.layer_scale)
