"""Eviction policies: which cached, unreferenced blocks to drop first.

Each policy is a pure function over parallel arrays describing the candidates (usually
the prefix index's ``evictable()`` leaves that the block pool has free):

    policy(block_ids int[N], last_access int/float[N], hit_count int[N], depth int[N], k)
        -> int64[min(k, N)] victim block ids, first victim first

Arrays may be numpy or jax (they are read on the host with ``np.asarray``: eviction
decides over a few hundred leaves per step, not per token, so there is nothing to gain
on device). Ties are always broken by ``last_access`` then ``block_ids`` so every policy
is a total order and deterministic.

- ``lru``: least recently accessed first (today's behaviour: the pool's free list
  reuses the least recently freed block first).
- ``lfu``: fewest hits first.
- ``cost``: cheapest to recompute first, cost = (depth + 1) * (hit_count + 1). A block
  at depth d can only be rebuilt after its d ancestors, and its prefill attends to
  (d + 1) * block_size tokens, so deep blocks are dearer; a block that keeps being hit
  would be paid for again on every future hit, hence the weight. This is the
  recompute side only (a block kept on the host tier would be cheaper to reload; not
  modelled).

``victim_order`` is the same choice as one jittable sort over the whole device pool,
for the engine's allocator (``block_stats.pop_victims``): free uncached blocks first,
then free cached blocks in the policy's order, then held blocks. Its cached part equals
the host function's choice on the same arrays (tests/test_eviction_policy.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

Policy = Callable[[ArrayLike, ArrayLike, ArrayLike, ArrayLike, int], np.ndarray]


def _arrays(block_ids, last_access, hit_count, depth):
    ids, la, hits, d = (np.asarray(x) for x in (block_ids, last_access, hit_count, depth))
    if not (ids.ndim == 1 and ids.shape == la.shape == hits.shape == d.shape):
        raise ValueError(
            "block_ids, last_access, hit_count and depth must be 1-D of one length, got "
            f"{ids.shape}, {la.shape}, {hits.shape}, {d.shape}"
        )
    return ids.astype(np.int64), la, hits.astype(np.int64), d.astype(np.int64)


def _take(ids: np.ndarray, la: np.ndarray, primary: np.ndarray, k: int) -> np.ndarray:
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    order = np.lexsort((ids, la, primary))  # last key is the primary one
    return ids[order[:k]]


def lru(block_ids, last_access, hit_count, depth, k: int) -> np.ndarray:
    """The ``k`` least recently accessed blocks."""
    ids, la, _, _ = _arrays(block_ids, last_access, hit_count, depth)
    return _take(ids, la, la, k)


def lfu(block_ids, last_access, hit_count, depth, k: int) -> np.ndarray:
    """The ``k`` least frequently hit blocks (LRU among equals)."""
    ids, la, hits, _ = _arrays(block_ids, last_access, hit_count, depth)
    return _take(ids, la, hits, k)


def recompute_cost(hit_count: ArrayLike, depth: ArrayLike) -> np.ndarray:
    """Cost of losing a block: (depth + 1) * (hit_count + 1), int64."""
    return (np.asarray(depth, np.int64) + 1) * (np.asarray(hit_count, np.int64) + 1)


def cost(block_ids, last_access, hit_count, depth, k: int) -> np.ndarray:
    """The ``k`` blocks cheapest to recompute (``recompute_cost``; LRU among equals)."""
    ids, la, hits, d = _arrays(block_ids, last_access, hit_count, depth)
    return _take(ids, la, recompute_cost(hits, d), k)


def policy_key(name: str, last_access: jax.Array, hit_count: jax.Array,
               depth: jax.Array) -> jax.Array:  # fmt: skip
    """The primary sort key of policy ``name`` (smallest evicted first), as jnp int32
    arrays (ties: ``last_access`` then id, as the host functions). ``cost`` is computed in
    int32: exact while (depth + 1) * (hit_count + 1) < 2**31 (hit counts saturate at
    2**20, so depths up to 2047 blocks are exact)."""
    if name == "lru":
        return last_access
    hits = jnp.minimum(hit_count, 1 << 20)
    if name == "lfu":
        return hits
    if name == "cost":
        return (depth + 1) * (hits + 1)
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}")


def victim_order(name: str, free: jax.Array, cached: jax.Array, last_access: jax.Array,
                 hit_count: jax.Array, depth: jax.Array) -> jax.Array:  # fmt: skip
    """Every block id (int32[N]) in eviction order: free uncached blocks first (by last
    access, then id: taking them loses nothing), then free cached blocks in policy
    ``name``'s order, then the blocks that are not free (never to be taken: the caller
    takes at most the number of free blocks). All inputs [N] (bool, bool, int32 x 3).
    Jittable; one lexsort over N, O(N log N)."""
    ids = jnp.arange(free.shape[0], dtype=jnp.int32)
    cls = jnp.where(free, jnp.where(cached, 1, 0), 2)
    primary = jnp.where(cls == 1, policy_key(name, last_access, hit_count, depth), 0)
    return jnp.lexsort((ids, last_access, primary, cls)).astype(jnp.int32)


POLICIES: dict[str, Policy] = {"lru": lru, "lfu": lfu, "cost": cost}


def get_policy(name: str) -> Policy:
    """The policy registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        ) from None
