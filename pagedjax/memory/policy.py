"""The memory-policy interface shared by the paged pool and the reservation baselines.

The scheduler is generic over a memory policy, so an experiment changes one thing at a
time: the paged block pool (vLLM) and the contiguous reservations (Orca Max / Pow2 /
Oracle, static batching) run under the same scheduling rules.

A policy is a static (hashable) Python object holding configuration; its state is a
pytree of arrays. Every method is pure and usable under ``jax.jit``. Sequences are
identified by a slot id in ``[0, max_seqs)``.

Units: all lengths are in tokens (KV slots). A policy converts to its own units (blocks
for the paged pool, slots for the buddy allocator).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax


class MemoryUsage(NamedTuple):
    """KV memory split into the paper's Fig. 2 categories, in KV slots (float32 scalars).

    token_slots: slots holding a written token.
    reserved_slots: slots that will hold a token of a live sequence later
        (between its current length and its final length) and are already held.
    internal_frag_slots: slots held by a sequence that it will never use
        (for the paged pool: the unused tail of a sequence's last block beyond its final
        length; for Orca: reserved output past the true output length).
    external_free_slots: everything else (free memory, and the buddy allocator's rounding
        slack pow2(R) - R).
    total_slots: the pool's capacity; the four categories sum to it.
    """

    token_slots: jax.Array
    reserved_slots: jax.Array
    internal_frag_slots: jax.Array
    external_free_slots: jax.Array
    total_slots: jax.Array


class MemoryPolicy(Protocol):
    """What the scheduler needs from a memory manager.

    Attributes:
      max_seqs: number of sequence slots.
      capacity_tokens: total KV slots managed (excluding the null block).
    """

    max_seqs: int
    capacity_tokens: int

    def init_state(self) -> Any:
        """A fresh state: nothing allocated."""
        ...

    def grow(
        self,
        state: Any,
        seq_ids: jax.Array,
        new_lens: jax.Array,
        final_lens: jax.Array,
        max_lens: jax.Array,
        mask: jax.Array,
        use_watermark: jax.Array,
    ) -> tuple[Any, jax.Array]:
        """Make room so each masked sequence can hold ``new_lens`` tokens in total.

        Args (all ``[B]``, B static):
          seq_ids: int32 slot ids.
          new_lens: int32 total tokens the sequence must be able to hold after this call.
          final_lens: int32 prompt + true output length (the Oracle policy reserves it;
            the accounting uses it for reserved vs internal fragmentation).
          max_lens: int32 the request's cap (prompt + max_tokens, at most max_model_len);
            Orca (Max) reserves max_model_len, Orca (Pow2) rounds the output up.
          mask: bool, which entries are real.
          use_watermark: bool, entries that must leave the policy's free watermark intact
            (new admissions, per the paper's block manager).

        Requests are served in array order (the scheduler's priority order), each all or
        nothing; one that cannot be served gets ok=False and changes nothing, and later
        entries may still succeed.

        Returns: (state', ok bool[B]); ok is True for unmasked entries.
        """
        ...

    def release(self, state: Any, seq_ids: jax.Array, mask: jax.Array) -> Any:
        """Free everything held by the masked sequences (int32[B] ids, bool[B] mask)."""
        ...

    def usage(
        self, state: Any, lens: jax.Array, final_lens: jax.Array, live: jax.Array
    ) -> MemoryUsage:
        """Fig. 2 accounting given per-slot current lengths, final lengths and liveness
        (each ``[max_seqs]``)."""
        ...
