"""Orca-style contiguous reservations (Max / Pow2 / Oracle) behind the MemoryPolicy interface.

On a sequence's first ``grow`` the policy reserves R slots for its whole life, as one
contiguous chunk of ``pow2(R)`` slots placed by the buddy allocator (paper_notes 2.4):

- ``max``:    R = max_model_len (Orca (Max); also FasterTransformer's static batching).
- ``pow2``:   R = min(prompt + next_pow2(true output), max_model_len) (Orca (Pow2)).
- ``oracle``: R = prompt + true output = final_lens (Orca (Oracle)).

The interface has no prompt length, so the prompt is taken as the first grow's
``new_lens`` and the true output as ``final_lens - prompt``. With chunked prefill the first
grow covers only the first chunk, so Pow2 then rounds up (rest of prompt + output); after a
recompute preemption the re-admission sees prompt + generated tokens as its "prompt" and
rounds up the remaining output. Later grows succeed iff ``new_lens <= R``; a sequence never
gets a second chunk (a contiguous reservation cannot grow in place).

Accounting (Fig. 2), per live sequence holding a chunk with current length ``len`` and
final length ``final``: tokens ``min(len, R)``, reserved ``[len, min(final, R))``, internal
fragmentation ``[max(final, len), R)``; these sum to R. External fragmentation and free is
the rest of the pool: ``capacity - sum(R)``, which includes the buddy slack pow2(R) - R,
the unallocated blocks and the pool's unusable tail.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.memory.buddy import (
    BuddyState,
    buddy_alloc,
    buddy_block_size,
    buddy_free,
    buddy_init,
)
from pagedjax.memory.policy import MemoryUsage

KINDS = ("max", "pow2", "oracle")


class ReservationState(NamedTuple):
    """Reservation policy state (a pytree).

    buddy: the allocator over the pool's slots.
    held: bool[max_seqs] the sequence holds a chunk.
    offset: int32[max_seqs] chunk offset in slots (-1 when not held).
    reserved_len: int32[max_seqs] R, the slots the sequence may use (0 when not held).
    """

    buddy: BuddyState
    held: jax.Array
    offset: jax.Array
    reserved_len: jax.Array


def next_pow2(x: jax.Array) -> jax.Array:
    """int32 smallest power of two >= x (1 for x <= 1), elementwise."""
    x = jnp.asarray(x, jnp.int32)
    return jnp.int32(1) << (32 - jax.lax.clz(jnp.maximum(x, 1) - 1))


@dataclasses.dataclass(frozen=True)
class ReservationPolicy:
    """Contiguous per-sequence reservations placed by a buddy allocator.

    Attributes:
      kind: "max" | "pow2" | "oracle" (see module docstring).
      max_seqs: number of sequence slots.
      capacity_tokens: KV slots in the pool.
      max_model_len: the model's context limit; caps every reservation.
      watermark_frac: admissions with use_watermark must leave at least
        ``int(watermark_frac * capacity_tokens)`` slots free in the buddy pool afterwards.
      min_block: the buddy allocator's smallest chunk in slots (a power of two).
    """

    kind: Literal["max", "pow2", "oracle"]
    max_seqs: int
    capacity_tokens: int
    max_model_len: int
    watermark_frac: float = 0.0
    min_block: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("max_seqs", "capacity_tokens", "max_model_len", "min_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0.0 <= self.watermark_frac < 1.0:
            raise ValueError(f"watermark_frac must be in [0, 1), got {self.watermark_frac!r}")
        if self.capacity_tokens < self.min_block:
            raise ValueError(
                f"capacity_tokens={self.capacity_tokens} must be >= min_block={self.min_block}"
            )

    @property
    def watermark_slots(self) -> int:
        return int(self.watermark_frac * self.capacity_tokens)

    def init_state(self) -> ReservationState:
        """A fresh state: nothing reserved."""
        n = self.max_seqs
        return ReservationState(
            buddy=buddy_init(self.capacity_tokens, self.min_block),
            held=jnp.zeros(n, bool),
            offset=jnp.full(n, -1, jnp.int32),
            reserved_len=jnp.zeros(n, jnp.int32),
        )

    def reservation(self, new_lens: jax.Array, final_lens: jax.Array) -> jax.Array:
        """int32 R for first grows to ``new_lens`` (the prompt) with true final length
        ``final_lens``; any shape."""
        new_lens = jnp.asarray(new_lens, jnp.int32)
        final_lens = jnp.asarray(final_lens, jnp.int32)
        if self.kind == "max":
            return jnp.full_like(new_lens, self.max_model_len)
        if self.kind == "oracle":
            return final_lens
        output = jnp.maximum(final_lens - new_lens, 0)
        return jnp.minimum(new_lens + next_pow2(output), self.max_model_len)

    def grow(
        self,
        state: ReservationState,
        seq_ids: jax.Array,
        new_lens: jax.Array,
        final_lens: jax.Array,
        max_lens: jax.Array,
        mask: jax.Array,
        use_watermark: jax.Array,
    ) -> tuple[ReservationState, jax.Array]:
        """Reserve chunks on first grows; later grows only check ``new_lens <= R``.

        Args (all ``[B]``): see ``MemoryPolicy.grow``. ``max_lens`` is unused: Orca (Max)
        reserves ``max_model_len`` per the paper, whatever the request's own cap.

        Returns: (state', ok bool[B]), entries served in array order, all or nothing.
        """
        del max_lens
        seq_ids = jnp.asarray(seq_ids, jnp.int32)
        new_lens = jnp.asarray(new_lens, jnp.int32)
        want_r = self.reservation(new_lens, final_lens)
        watermark = jnp.where(jnp.asarray(use_watermark, bool), self.watermark_slots, 0)
        mask = jnp.asarray(mask, bool)

        def one(i, carry):
            state, oks = carry
            sid = seq_ids[i]
            wid = jnp.where(mask[i], sid, self.max_seqs)  # unmasked entries write nowhere
            held = state.held[sid]
            r = jnp.where(held, state.reserved_len[sid], want_r[i])
            fits_r = (new_lens[i] <= r) & (r >= 1)
            # The watermark counts the chunk's true cost pow2(R), checked before placing it.
            room = state.buddy.free_slots - buddy_block_size(state.buddy, r) >= watermark[i]
            need_chunk = mask[i] & ~held & fits_r & room
            buddy, offset, got = buddy_alloc(state.buddy, jnp.where(need_chunk, r, 0))
            state = ReservationState(
                buddy=buddy,
                held=state.held.at[wid].set(held | got, mode="drop"),
                offset=state.offset.at[wid].set(
                    jnp.where(got, offset, state.offset[sid]), mode="drop"
                ),
                reserved_len=state.reserved_len.at[wid].set(
                    jnp.where(got, r, state.reserved_len[sid]), mode="drop"
                ),
            )
            ok = ~mask[i] | (fits_r & (held | got))
            return state, oks.at[i].set(ok)

        oks = jnp.ones(seq_ids.shape, bool)
        return jax.lax.fori_loop(0, seq_ids.shape[0], one, (state, oks))

    def release(
        self, state: ReservationState, seq_ids: jax.Array, mask: jax.Array
    ) -> ReservationState:
        """Free the chunks of the masked sequences (int32[B] ids, bool[B] mask); sequences
        holding nothing are skipped."""
        seq_ids = jnp.asarray(seq_ids, jnp.int32)
        mask = jnp.asarray(mask, bool)

        def one(i, state):
            sid = seq_ids[i]
            drop = mask[i] & state.held[sid]
            wid = jnp.where(drop, sid, self.max_seqs)  # others write nowhere
            offset = jnp.where(drop, state.offset[sid], -1)  # -1: buddy_free is a no-op
            return ReservationState(
                buddy=buddy_free(state.buddy, offset, jnp.maximum(state.reserved_len[sid], 1)),
                held=state.held.at[wid].set(False, mode="drop"),
                offset=state.offset.at[wid].set(-1, mode="drop"),
                reserved_len=state.reserved_len.at[wid].set(0, mode="drop"),
            )

        return jax.lax.fori_loop(0, seq_ids.shape[0], one, state)

    def free_slots(self, state: ReservationState) -> jax.Array:
        """float32[]: slots in free buddy blocks (held by no chunk). The rest of Fig. 2's
        last category is external fragmentation: each chunk's pow2 rounding slack."""
        return state.buddy.free_slots.astype(jnp.float32)

    def usage(
        self, state: ReservationState, lens: jax.Array, final_lens: jax.Array, live: jax.Array
    ) -> MemoryUsage:
        """Fig. 2 accounting over the live sequences holding a chunk (each arg ``[max_seqs]``).

        Returns float32 slot counts; the four categories sum to ``capacity_tokens``.
        """
        counted = jnp.asarray(live, bool) & state.held
        r = jnp.where(counted, state.reserved_len, 0)
        lens = jnp.asarray(lens, jnp.int32)
        final_lens = jnp.asarray(final_lens, jnp.int32)
        token = jnp.minimum(lens, r)
        reserved = jnp.maximum(jnp.minimum(final_lens, r) - token, 0)
        internal = r - token - reserved
        f32 = lambda x: jnp.sum(x).astype(jnp.float32)
        return MemoryUsage(
            token_slots=f32(token),
            reserved_slots=f32(reserved),
            internal_frag_slots=f32(internal),
            external_free_slots=jnp.float32(self.capacity_tokens) - f32(r),
            total_slots=jnp.float32(self.capacity_tokens),
        )
