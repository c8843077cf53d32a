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
  recompute-or-reload trade-off in its simplest form (no host tier exists yet).
"""

from __future__ import annotations

from collections.abc import Callable

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


POLICIES: dict[str, Policy] = {"lru": lru, "lfu": lfu, "cost": cost}


def get_policy(name: str) -> Policy:
    """The policy registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        ) from None
