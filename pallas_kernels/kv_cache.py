"""KV writes by slot mapping and block copies (copy-on-write, swap), as XLA scatters.

No Pallas kernel here, on purpose: a write is one scatter of T x Hkv x D elements and a
block copy one gather + scatter of whole pages. XLA emits these as single fused
memory-bound loops, and with the pool donated they update in place. A kernel only pays off
if fused into the attention kernel (not done); whether a standalone one beats XLA is a GPU
measurement still to make (see docs/kernels.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes token t's K/V at slot slot_mapping[t] = block * block_size + offset.

    Shapes: k_pages, v_pages [L, N, Hkv, B, D] with a scalar ``layer`` (the stacked pool),
    or [N, Hkv, B, D] with layer=None; k_new, v_new [T, Hkv, D]; slot_mapping int32[T].
    Slots outside [0, N * B) (padding tokens) write nowhere; negative slots are dropped
    too, not wrapped. Donate the pool to the caller's jit for an in-place update.
    """
    if k_pages.ndim not in (4, 5) or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"pages must be [L, N, Hkv, B, D] or [N, Hkv, B, D], got {k_pages.shape}, "
            f"{v_pages.shape}"
        )
    if (k_pages.ndim == 5) != (layer is not None):
        raise ValueError("a 5-D pool needs a layer index; 4-D pages need layer=None")
    n, h, b, d = k_pages.shape[-4:]
    if k_new.shape != v_new.shape or k_new.ndim != 3 or k_new.shape[1:] != (h, d):
        raise ValueError(f"k_new/v_new must be [T, {h}, {d}], got {k_new.shape}, {v_new.shape}")
    if slot_mapping.shape != k_new.shape[:1] or slot_mapping.dtype != jnp.int32:
        raise ValueError(
            f"slot_mapping must be int32[{k_new.shape[0]}], got {slot_mapping.dtype}"
            f"{slot_mapping.shape}"
        )
    # Negative indices would wrap in a plain scatter: move them out of range instead.
    slots = jnp.where(slot_mapping < 0, n * b, slot_mapping)
    # Page layout [N, H, B, D]: index (block, :, offset) directly; no transpose of the pool.
    blk, off = slots // b, slots % b
    blk = jnp.where(slots >= n * b, n, blk)
    if layer is None:
        k = k_pages.at[blk, :, off].set(k_new.astype(k_pages.dtype), mode="drop")
        v = v_pages.at[blk, :, off].set(v_new.astype(v_pages.dtype), mode="drop")
        return k, v
    lyr = jnp.full(blk.shape, layer, jnp.int32)
    k = k_pages.at[lyr, blk, :, off].set(k_new.astype(k_pages.dtype), mode="drop")
    v = v_pages.at[lyr, blk, :, off].set(v_new.astype(v_pages.dtype), mode="drop")
    return k, v


def copy_blocks(
    src_pages: jax.Array, dst_pages: jax.Array, src: jax.Array, dst: jax.Array
) -> jax.Array:
    """dst_pages[dst[i]] = src_pages[src[i]] for every pair; returns the new dst_pages.

    Copy-on-write is copy_blocks(pages, pages, src, dst); swap out/in copies between the
    device pool and a host-side pool of the same page shape. Shapes: pages [N, Hkv, B, D],
    or the stacked pool [L, N, Hkv, B, D], where each pair copies the block in every layer
    (N may differ between the pools); src, dst int32[P]. Pairs with dst out of range
    (padding) copy nothing; dst entries must be distinct (a scatter with duplicates picks
    an arbitrary winner). Sources are read before any write, so chains such as
    (a -> b, b -> c) copy the old b.
    """
    if src_pages.ndim == 5 and dst_pages.ndim == 5:
        if src_pages.shape[0] != dst_pages.shape[0] or src_pages.shape[2:] != dst_pages.shape[2:]:
            raise ValueError(f"page shapes differ: {src_pages.shape} vs {dst_pages.shape}")
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError(f"src and dst must be int32[P], got {src.shape}, {dst.shape}")
        n_dst = dst_pages.shape[1]
        dst = jnp.where((dst < 0) | (dst >= n_dst), n_dst, dst)
        blocks = src_pages[:, jnp.clip(src, 0, src_pages.shape[1] - 1)]
        return dst_pages.at[:, dst].set(blocks.astype(dst_pages.dtype), mode="drop")
    if src_pages.shape[1:] != dst_pages.shape[1:] or src_pages.ndim != 4:
        raise ValueError(f"page shapes differ: {src_pages.shape} vs {dst_pages.shape}")
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src and dst must be int32[P], got {src.shape}, {dst.shape}")
    if src.dtype != jnp.int32 or dst.dtype != jnp.int32:
        raise ValueError(f"src and dst must be int32, got {src.dtype}, {dst.dtype}")
    n_dst = dst_pages.shape[0]
    dst = jnp.where((dst < 0) | (dst >= n_dst), n_dst, dst)
    blocks = src_pages[jnp.clip(src, 0, src_pages.shape[0] - 1)]
    return dst_pages.at[dst].set(blocks.astype(dst_pages.dtype), mode="drop")


__all__ = ["copy_blocks", "write_kv"]
