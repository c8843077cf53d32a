"""A draft's own KV pool under the target's block ids: its host swap pool and swap copies.

A separate draft checkpoint (``spec_draft_model.py``) and an EAGLE head (``spec_eagle.py``)
each keep a paged pool whose block b belongs to whoever owns the target's block b, so the
target's block tables, allocator and scheduler serve both pools. When the target's
schedule swaps a group out or in (``swap_copies.apply_swap_copies``), the same block copies must
happen on the draft's pool, else a swapped-in sequence's draft reads the rows of whatever
last held its new blocks: the outputs stay right (verification sees to that), but the
drafts, and so the acceptance, silently degrade.

Contract: ``host_pool(kv, n)`` -> numpy arrays ``[layers, n + 1, ...]`` (row 0 the null
block, as the target's host pool); ``mirror_swaps(kv, host_kv, plan, host)`` copies
device -> host the blocks of groups swapped out, then host -> device those swapped in,
with the target's plan and host block ids, and returns the new device pool (``host_kv``
is written in place). Call it after the schedule and before the step writes the pool: a
block freed by a swap-out still holds the group's rows then. Cost: one gather and one
device -> host transfer of the swapped blocks, one scatter back; nothing in steps
without swaps.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pagedjax.engine.device_state import padding_bucket
from pagedjax.engine.model_runner import gather_blocks, scatter_blocks


def host_pool(kv: Any, num_host_blocks: int) -> Any:
    """Zeroed numpy host blocks shaped like ``kv``'s (leaves [L, B, ...] -> [L, H + 1, ...])."""
    return jax.tree.map(
        lambda p: np.zeros((p.shape[0], num_host_blocks + 1, *p.shape[2:]), p.dtype), kv
    )


def mirror_swaps(kv: Any, host_kv: Any, plan: Any, host: dict) -> Any:
    """The step's swap copies (plan: the scheduled batch's ``swap``; host: its
    ``num_out`` / ``num_in`` counts) on this pool; returns the device pool after them."""
    n_out, n_in = int(host["num_out"]), int(host["num_in"])
    if n_out:
        bucket = padding_bucket(n_out, plan.out_src.shape[0])
        pages, dst = jax.device_get((gather_blocks(kv, plan.out_src, k=bucket), plan.out_dst))
        for h, g in zip(jax.tree.leaves(host_kv), jax.tree.leaves(pages), strict=True):
            h[:, dst[:n_out]] = g[:, :n_out]
    if n_in:
        src = np.zeros(padding_bucket(n_in, plan.in_src.shape[0]), np.int32)
        src[:n_in] = jax.device_get(plan.in_src)[:n_in]
        pages = jax.tree.map(lambda h: h[:, src], host_kv)
        kv = scatter_blocks(kv, plan.in_dst, plan.num_in, jax.device_put(pages))
    return kv


__all__ = ["host_pool", "mirror_swaps"]
