"""A minimal MemoryPolicy: a pool of fungible units of ``unit`` tokens, counted only.

A sequence of length L holds ceil(L / unit) units, as the paged pool holds blocks, but
without block tables. It lets the scheduler be tested and benchmarked apart from any
real memory manager, and its cost is a floor for what the scheduler itself takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pagedjax.memory.policy import MemoryUsage


class CountingState(NamedTuple):
    """held: int32[max_seqs] units per slot. free: int32[] free units. host_held,
    host_free: the same for the host (swap) pool; host_held[s] > 0 only while swapped."""

    held: jax.Array
    free: jax.Array
    host_held: jax.Array
    host_free: jax.Array


@dataclass(frozen=True)
class CountingPolicy:
    """capacity_tokens // unit units; admissions must leave int(watermark_frac * units).

    host_units: units of the host swap pool (0: no swapping). Units are not shared, so
    a swap moves exactly the units the rows hold.
    """

    max_seqs: int
    capacity_tokens: int
    unit: int = 16
    watermark_frac: float = 0.0
    host_units: int = 0

    def __post_init__(self) -> None:
        for name in ("max_seqs", "capacity_tokens", "unit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not 0.0 <= self.watermark_frac < 1.0:
            raise ValueError(f"watermark_frac must be in [0, 1), got {self.watermark_frac}")
        if self.host_units < 0:
            raise ValueError(f"host_units must be >= 0, got {self.host_units}")

    @property
    def can_swap(self) -> bool:
        return self.host_units > 0

    @property
    def num_units(self) -> int:
        return self.capacity_tokens // self.unit

    @property
    def watermark_units(self) -> int:
        return int(self.watermark_frac * self.num_units)

    def units_for(self, length: jax.Array) -> jax.Array:
        return (jnp.asarray(length, jnp.int32) + self.unit - 1) // self.unit

    def init_state(self) -> CountingState:
        z = jnp.zeros((self.max_seqs,), jnp.int32)
        return CountingState(z, jnp.int32(self.num_units), z, jnp.int32(self.host_units))

    def grow(self, state, seq_ids, new_lens, final_lens, max_lens, mask, use_watermark):
        del final_lens, max_lens
        ids = jnp.clip(jnp.asarray(seq_ids, jnp.int32), 0, self.max_seqs - 1)
        need = jnp.maximum(self.units_for(new_lens) - state.held[ids], 0)
        reserve = jnp.where(use_watermark, self.watermark_units, 0)
        free, ok = grant_in_order(state.free, need, reserve, mask)
        take = jnp.where(mask & ok, need, 0)
        held = state.held.at[ids].add(take)
        return state._replace(held=held, free=free), ok

    def release(self, state, seq_ids, mask):
        ids = jnp.where(mask, jnp.asarray(seq_ids, jnp.int32), self.max_seqs)
        safe = jnp.clip(ids, 0, self.max_seqs - 1)
        back = jnp.sum(jnp.where(mask, state.held[safe], 0))
        host_back = jnp.sum(jnp.where(mask, state.host_held[safe], 0))
        return CountingState(
            state.held.at[ids].set(0, mode="drop"),
            state.free + back,
            state.host_held.at[ids].set(0, mode="drop"),
            state.host_free + host_back,
        )

    def swap_out(self, state, mask):
        """Move the masked slots' units (bool[max_seqs]) to the host pool, all or nothing."""
        need = jnp.sum(jnp.where(mask, state.held, 0))
        ok = state.host_free >= need
        move = mask & ok
        return CountingState(
            jnp.where(move, 0, state.held),
            state.free + jnp.where(ok, need, 0),
            jnp.where(move, state.held, state.host_held),
            state.host_free - jnp.where(ok, need, 0),
        ), ok

    def swap_in(self, state, mask, num_seqs, reserve):
        """Back to device, all or nothing; with ``reserve``, leaving watermark + num_seqs
        units free."""
        need = jnp.sum(jnp.where(mask, state.host_held, 0))
        ok = state.free - need >= jnp.where(reserve, self.watermark_units + num_seqs, 0)
        move = mask & ok
        return CountingState(
            jnp.where(move, state.host_held, state.held),
            state.free - jnp.where(ok, need, 0),
            jnp.where(move, 0, state.host_held),
            state.host_free + jnp.where(ok, need, 0),
        ), ok

    def usage(self, state, lens, final_lens, live) -> MemoryUsage:
        return usage_of_held(state.held * self.unit, lens, final_lens, live, self.capacity_tokens)


def grant_in_order(
    free: jax.Array, need: jax.Array, reserve: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Grant ``need`` units (int32[B]) in array order, each all or nothing, an entry
    leaving at least its ``reserve`` units free (the MemoryPolicy contract). Returns
    (free units after, ok bool[B]); unmasked entries are ok and take nothing."""

    def step(left, x):
        nd, rs, m = x
        ok = ~m | (left - nd >= rs)
        return left - jnp.where(m & ok, nd, 0), ok

    return lax.scan(step, free, (need, reserve, jnp.asarray(mask, bool)))


def usage_of_held(
    held_tokens: jax.Array, lens: jax.Array, final_lens: jax.Array, live: jax.Array, capacity: int
) -> MemoryUsage:
    """Fig. 2 accounting of slots holding ``held_tokens`` (int32[max_seqs]) of a pool of
    ``capacity`` tokens: tokens up to each length, reserved up to the final length,
    internal fragmentation beyond it, the rest external / free."""
    held = jnp.asarray(held_tokens, jnp.float32)
    lens = jnp.asarray(lens, jnp.float32)
    final = jnp.maximum(jnp.asarray(final_lens, jnp.float32), lens)
    f = jnp.asarray(live, jnp.float32)
    tokens = jnp.sum(f * jnp.minimum(lens, held))
    reserved = jnp.sum(f * jnp.clip(jnp.minimum(final, held) - lens, 0))
    internal = jnp.sum(f * jnp.clip(held - final, 0))
    cap = jnp.float32(capacity)
    return MemoryUsage(tokens, reserved, internal, cap - tokens - reserved - internal, cap)
