"""A jittable binary buddy allocator over a pool of KV slots (Orca's chunk placement).

Layout. The pool has ``capacity`` slots, split into ``U = capacity // min_block`` units
(a trailing partial unit is never handed out). The units sit in a power-of-two arena of
``L = next_pow2(U)`` units whose tail ``[U, L)`` is permanently allocated at init. Since
the tail never frees, its buddies never merge across it, so the usable space behaves
exactly as a forest of maximal power-of-two top-level blocks: the binary decomposition
of ``U`` laid out in descending size from offset 0 (15,728 = 8192 + 4096 + 2048 + 1024 +
256 + 64 + 32 + 16, which fits exactly seven 2048-slot chunks). One array tree serves
both views, with no special case for the forest.

State. A complete binary tree in heap order (root 1, children ``2n`` and ``2n + 1``;
index 0 unused). ``avail[n]`` is an int32 bitmask: bit ``o`` is set iff node ``n``'s
subtree holds a free block (an entry of a buddy free list) of order ``o``, where order
``o`` means ``2**o`` units. A node is a whole free block iff ``avail[n] == 1 << order(n)``
and wholly allocated or out of reach iff 0. Entries under a whole block (free or
allocated) are stale and never read: they are rewritten when the block is split.

Placement is the classic buddy rule: take a free block of the smallest order that fits,
the lowest-addressed one among those, and split it, keeping the left half each time.
Every operation is O(log L) scalar work in ``fori_loop``s of static trip count
``log2 L`` (<= 30): it jits once per arena size (loops compile far faster than the unrolled
form) and vmaps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MAX_ARENA_ORDER = 30  # the int32 bitmask holds orders 0..30


@dataclasses.dataclass(frozen=True)
class BuddyState:
    """Buddy allocator state (a pytree).

    avail: int32[2 * L] per-node bitmask of free-block orders in the subtree (see module
        docstring); L = 2**arena_order units.
    free_slots: int32[] slots in free blocks (excludes the unusable tail).
    min_block: static, slots per unit (the smallest chunk).
    capacity: static, slots managed (the usable part is (capacity // min_block) units).
    """

    avail: jax.Array
    free_slots: jax.Array
    min_block: int = dataclasses.field(metadata=dict(static=True), default=1)
    capacity: int = dataclasses.field(metadata=dict(static=True), default=1)

    @property
    def arena_order(self) -> int:
        """log2 of the arena size in units (static)."""
        return int(self.avail.shape[0] // 2).bit_length() - 1


jax.tree_util.register_dataclass(
    BuddyState, data_fields=["avail", "free_slots"], meta_fields=["min_block", "capacity"]
)


def _ceil_log2(n: int) -> int:
    return max(int(n) - 1, 0).bit_length()


def buddy_init(capacity: int, min_block: int = 1) -> BuddyState:
    """A fresh allocator with every usable unit free.

    Args:
      capacity: slots in the pool (>= min_block).
      min_block: smallest chunk in slots (a power of two); every request is rounded up to
        a power-of-two multiple of it.
    """
    if not isinstance(min_block, int) or min_block < 1 or min_block & (min_block - 1):
        raise ValueError(f"min_block must be a positive power of two, got {min_block!r}")
    if not isinstance(capacity, int) or capacity < min_block:
        raise ValueError(f"capacity must be an int >= min_block={min_block}, got {capacity!r}")
    units = capacity // min_block
    k = _ceil_log2(units)
    if k > MAX_ARENA_ORDER:
        raise ValueError(f"capacity={capacity} needs 2**{k} units; at most 2**30 supported")
    avail = np.zeros(2 << k, np.int32)

    def build(node: int, lo: int, order: int) -> int:
        size = 1 << order
        if lo + size <= units:  # wholly usable: one free block
            avail[node] = 1 << order
        elif lo < units:  # straddles the tail: split
            avail[node] = build(2 * node, lo, order - 1) | build(
                2 * node + 1, lo + size // 2, order - 1
            )
        return int(avail[node])

    build(1, 0, k)
    return BuddyState(
        avail=jnp.asarray(avail),
        free_slots=jnp.asarray(units * min_block, jnp.int32),
        min_block=min_block,
        capacity=capacity,
    )


def _order_of(size: jax.Array, min_block: int) -> jax.Array:
    """int32 order of the smallest power-of-two block (in units) holding ``size`` slots."""
    units = jnp.maximum((size + (min_block - 1)) // min_block, 1).astype(jnp.int32)
    return (32 - jax.lax.clz(units - 1)).astype(jnp.int32)


def buddy_block_size(state: BuddyState, size: jax.Array | int) -> jax.Array:
    """int32 slots actually taken by a request of ``size`` slots (power-of-two rounding)."""
    return jnp.int32(state.min_block) << _order_of(jnp.asarray(size, jnp.int32), state.min_block)


def _guarded_set(avail: jax.Array, idx: jax.Array, val: jax.Array, pred: jax.Array) -> jax.Array:
    return avail.at[idx].set(jnp.where(pred, val, avail[idx]))


# Loop bodies live at module level and take everything through the carry: fori_loop's
# tracing cache is keyed on the function object, so eager calls reuse one compiled loop.


def _descend(t, carry):
    """One step from the root toward the lowest-addressed free block of order o."""
    node, avail, o, steps = carry
    left = jnp.minimum(2 * node, avail.shape[0] - 2)  # clamp: leaf children are unused
    child = jnp.where((avail[left] >> o) & 1 == 1, left, left + 1)
    return jnp.where(t < steps, child, node), avail, o, steps


def _split(t, carry):
    """Halve the block at ``node``: its right half becomes a free block, keep the left."""
    node, avail, o, steps = carry
    active = t < steps
    avail = _guarded_set(avail, 2 * node + 1, jnp.int32(1) << (o - t - 1), active)
    return jnp.where(active, 2 * node, node), avail, o, steps


def _up_or(t, carry):
    """Recompute an ancestor as the OR of its children (allocation never merges)."""
    node, avail, pred = carry
    parent = node >> 1
    val = avail[2 * parent] | avail[2 * parent + 1]
    return parent, _guarded_set(avail, parent, val, pred & (parent >= 1)), pred


def _up_merge(t, carry):
    """Recompute an ancestor, merging it into one free block while both halves are free."""
    node, avail, order, merging, pred = carry
    parent = node >> 1
    merge = merging & (avail[node ^ 1] == (jnp.int32(1) << order))
    val = jnp.where(merge, jnp.int32(1) << (order + 1), avail[node] | avail[node ^ 1])
    avail = _guarded_set(avail, parent, val, pred & (parent >= 1))
    return parent, avail, order + 1, merge, pred


def buddy_alloc(
    state: BuddyState, size: jax.Array | int
) -> tuple[BuddyState, jax.Array, jax.Array]:
    """Allocate a contiguous, aligned chunk of at least ``size`` slots.

    The chunk is ``min_block * 2**j`` slots for the smallest such j that holds ``size``;
    its offset is a multiple of its size.

    Args:
      state: allocator state.
      size: int32[] slots wanted; ``size < 1`` is refused (ok=False).

    Returns:
      (state', offset int32[] in slots, ok bool[]). When not ok the state is unchanged and
      offset is -1.
    """
    if isinstance(size, int) and size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    k = state.arena_order
    avail = state.avail
    size = jnp.asarray(size, jnp.int32)
    j = _order_of(size, state.min_block)
    fits = avail[1] & ~((jnp.int32(1) << jnp.minimum(j, 31)) - 1)  # free orders >= j
    ok = (size >= 1) & (j <= k) & (fits != 0)
    o = jax.lax.population_count((fits & -fits) - 1)  # smallest free order >= j
    o = jnp.where(ok, o, j).astype(jnp.int32)
    node, *_ = jax.lax.fori_loop(0, k, _descend, (jnp.int32(1), avail, o, k - o))
    steps = jnp.where(ok, o - j, 0)
    node, avail, *_ = jax.lax.fori_loop(0, k, _split, (node, avail, o, steps))
    avail = _guarded_set(avail, node, jnp.int32(0), ok)
    offset_units = (node - (jnp.int32(1) << jnp.clip(k - j, 0, k))) << jnp.minimum(j, k)
    _, avail, _ = jax.lax.fori_loop(0, k, _up_or, (node, avail, ok))
    new_state = dataclasses.replace(
        state,
        avail=avail,
        free_slots=state.free_slots - jnp.where(ok, state.min_block << j, 0),
    )
    offset = jnp.where(ok, offset_units * state.min_block, -1).astype(jnp.int32)
    return new_state, offset, ok


def buddy_free(state: BuddyState, offset: jax.Array | int, size: jax.Array | int) -> BuddyState:
    """Free the chunk at ``offset`` that ``buddy_alloc(state, size)`` returned.

    Merges the freed block with its buddy while the buddy is free too, up to the top-level
    block (the unusable tail never frees, so nothing merges into it).

    Args:
      state: allocator state.
      offset: int32[] slot offset of a live chunk; ``offset < 0`` is a no-op (so a failed
        allocation's -1 can be passed back).
      size: int32[] the size passed to ``buddy_alloc`` (any size rounding to the same block).

    Freeing a chunk that is not live is undefined (not checked, as under jit it cannot be).
    """
    k = state.arena_order
    offset = jnp.asarray(offset, jnp.int32)
    j = _order_of(jnp.asarray(size, jnp.int32), state.min_block)
    valid = (offset >= 0) & (j <= k)
    jc = jnp.minimum(j, k)
    node = (jnp.int32(1) << (k - jc)) + ((jnp.maximum(offset, 0) // state.min_block) >> jc)
    avail = _guarded_set(state.avail, node, jnp.int32(1) << jc, valid)
    carry = (node, avail, jc, jnp.bool_(True), valid)
    _, avail, *_ = jax.lax.fori_loop(0, k, _up_merge, carry)
    return dataclasses.replace(
        state,
        avail=avail,
        free_slots=state.free_slots + jnp.where(valid, state.min_block << jc, 0),
    )


def buddy_free_blocks(state: BuddyState) -> list[tuple[int, int]]:
    """Host-side: the free blocks as sorted (offset, size) pairs in slots (for tests, plots)."""
    avail = np.asarray(state.avail)
    k = state.arena_order
    out: list[tuple[int, int]] = []

    def walk(node: int, lo: int, order: int) -> None:
        a = int(avail[node])
        if a == 0:
            return
        if a == 1 << order:
            out.append((lo * state.min_block, (1 << order) * state.min_block))
            return
        walk(2 * node, lo, order - 1)
        walk(2 * node + 1, lo + (1 << (order - 1)), order - 1)

    walk(1, 0, k)
    return out


def buddy_top_blocks(capacity: int, min_block: int = 1) -> list[tuple[int, int]]:
    """The maximal power-of-two blocks of a fresh pool as (offset, size) pairs in slots."""
    units = capacity // min_block
    out, lo = [], 0
    for order in range(units.bit_length() - 1, -1, -1):
        if units >> order & 1:
            out.append((lo * min_block, (1 << order) * min_block))
            lo += 1 << order
    return out
