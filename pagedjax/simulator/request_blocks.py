"""Paged memory with a block size chosen per request (an ablation the paper could not run).

vLLM's pool has one block size for every request: small blocks cost the kernel a fixed
price per block visited, large ones waste memory in each request's last block (the
paper's Fig. 18 trade-off). Here each request gets its own block size when it is
admitted, from what it declares: its length cap (prompt + max_tokens).

Contract (the ``MemoryPolicy`` protocol, like ``CountingPolicy``):
- Memory is counted in base units of ``unit`` tokens (the smallest block). A request
  with block size B and length L holds ceil(L / B) blocks, i.e. ceil(L / B) * B / unit
  units; blocks are granted as the request grows, each grant all or nothing.
- The block size is fixed at the first grant (``held == 0``: a new request, or one
  preempted by recompute, which starts over) and forgotten at release.
- ``row_block_sizes`` gives each batch row's block size, so the simulator charges the
  kernel's block-granular access (``simulate.block_work``) per row.
- No swap pool (preemption by recompute only).

The choice: a decode step of a sequence with context C in blocks of B costs the kernel
about ``overhead_tokens`` tokens' worth of reads per block visited (C / B blocks) plus,
with whole-block reads, half a block of padding on average: h C / B + B / 2, least at
B = sqrt(2 h C). C is taken as the declared cap, rounded to the nearest power of two in
log space and clamped to [unit, max_block]. h defaults to the "kernel" block cost of
``systems.BLOCK_COSTS`` (3.7 tokens: the paper's Fig. 18a), so the rule is derived from
the same kernel model the step time charges, not tuned to a result.

What it idealises: a B-token block is B / unit base units that the kernel reads as one
block, so they must be contiguous; the model assumes the allocator always finds such a
run (no external fragmentation between block sizes, as a buddy allocator with
compaction or a virtual-memory mapping would give). The measured rows are therefore an
upper bound on what per-request block sizes can gain.

Cost: O(B) per grow (a scan over the batch for all-or-nothing grants), O(max_seqs) per
usage; pure functions of int32 arrays, jit- and vmap-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.memory.policy import MemoryUsage
from pagedjax.scheduler.counting_policy import grant_in_order, usage_of_held
from pagedjax.simulator.cost_model import KERNEL_BLOCK_OVERHEAD_TOKENS


class RequestBlockState(NamedTuple):
    """held: int32[max_seqs] base units per slot. free: int32[] free units.
    block: int32[max_seqs] the slot's block size in tokens (0: nothing granted yet)."""

    held: jax.Array
    free: jax.Array
    block: jax.Array


@dataclass(frozen=True)
class RequestBlockSizePolicy:
    """A pool of ``capacity_tokens // unit`` base units; each request's blocks are
    ``choose_block(its cap)`` tokens. Admissions must leave int(watermark_frac * units)
    free, as the paged pool's watermark."""

    max_seqs: int
    capacity_tokens: int
    unit: int = 8
    max_block: int = 256
    overhead_tokens: float = KERNEL_BLOCK_OVERHEAD_TOKENS
    watermark_frac: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_seqs", "capacity_tokens", "unit", "max_block"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("unit", "max_block"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.max_block < self.unit:
            raise ValueError(f"max_block ({self.max_block}) must be >= unit ({self.unit})")
        if not self.overhead_tokens >= 0.0:
            raise ValueError(f"overhead_tokens must be >= 0, got {self.overhead_tokens}")
        if not 0.0 <= self.watermark_frac < 1.0:
            raise ValueError(f"watermark_frac must be in [0, 1), got {self.watermark_frac}")

    can_swap = False

    @property
    def num_units(self) -> int:
        return self.capacity_tokens // self.unit

    @property
    def watermark_units(self) -> int:
        return int(self.watermark_frac * self.num_units)

    def choose_block(self, declared_len: jax.Array) -> jax.Array:
        """int32 block size (tokens) for requests of ``declared_len`` tokens (any shape):
        sqrt(2 h C) rounded to a power of two in log space, within [unit, max_block]."""
        c = jnp.maximum(jnp.asarray(declared_len, jnp.float32), 1.0)
        best = jnp.sqrt(2.0 * self.overhead_tokens * c)
        lo, hi = math.log2(self.unit), math.log2(self.max_block)
        e = jnp.clip(jnp.round(jnp.log2(jnp.maximum(best, 1e-6))), lo, hi)
        return jnp.exp2(e).astype(jnp.int32)

    def init_state(self) -> RequestBlockState:
        z = jnp.zeros((self.max_seqs,), jnp.int32)
        return RequestBlockState(z, jnp.int32(self.num_units), z)

    def grow(self, state, seq_ids, new_lens, final_lens, max_lens, mask, use_watermark):
        del final_lens  # the block size uses only what the request declares
        mask = jnp.asarray(mask, bool)
        ids = jnp.clip(jnp.asarray(seq_ids, jnp.int32), 0, self.max_seqs - 1)
        held = state.held[ids]
        bs = jnp.where(held == 0, self.choose_block(max_lens), state.block[ids])
        want = (jnp.asarray(new_lens, jnp.int32) + bs - 1) // bs * (bs // self.unit)
        need = jnp.maximum(want - held, 0)
        reserve = jnp.where(use_watermark, self.watermark_units, 0)
        free, ok = grant_in_order(state.free, need, reserve, mask)
        granted = mask & ok
        drop = jnp.where(granted, ids, self.max_seqs)  # padding rows touch no slot
        return (
            RequestBlockState(
                state.held.at[drop].add(need, mode="drop"),
                free,
                state.block.at[drop].set(bs, mode="drop"),
            ),
            ok,
        )

    def release(self, state, seq_ids, mask):
        ids = jnp.where(mask, jnp.asarray(seq_ids, jnp.int32), self.max_seqs)
        safe = jnp.clip(ids, 0, self.max_seqs - 1)
        back = jnp.sum(jnp.where(mask, state.held[safe], 0))
        return RequestBlockState(
            state.held.at[ids].set(0, mode="drop"),
            state.free + back,
            state.block.at[ids].set(0, mode="drop"),
        )

    def row_block_sizes(self, state, seq_ids) -> jax.Array:
        """int32[B] each batch row's block size (1 for padding rows, seq_ids < 0)."""
        ids = jnp.asarray(seq_ids, jnp.int32)
        bs = state.block[jnp.clip(ids, 0, self.max_seqs - 1)]
        return jnp.where((ids >= 0) & (bs > 0), bs, 1)

    def usage(self, state, lens, final_lens, live) -> MemoryUsage:
        return usage_of_held(state.held * self.unit, lens, final_lens, live, self.capacity_tokens)
