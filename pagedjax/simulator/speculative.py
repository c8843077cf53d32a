"""The simulator's speculative mode: decode rows verify k drafts and keep a random run.

A ``SpecModel`` turns a simulated decode row into a speculating one: the step's cost
counts its k extra query tokens (as prefill-like tokens: the verification is a q_len =
k + 1 row attending over its context), and after the step the row keeps ``a`` extra
tokens, a drawn from ``accepted_pmf`` (P(a = 0..k), an input: measure it on the real
engine, ``stats()``'s acceptance counts, or sweep it), capped so the output never
passes its target. Everything else is the real scheduler and memory policy, as in the
plain simulation (simulate.py), so Fig. 12-style curves can be drawn with and without
speculation.

Approximations (say so beside any simulated number): the draft's own cost (n-gram: ~0;
a draft model: add it to the cost model) is not counted; the transient blocks the
drafts hold during the verification are not allocated (a real engine speculates only
into free blocks and returns them at once, so they never force preemption); the
accepted length is drawn independently per row and step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.scheduler import ScheduledBatch, output_target


@dataclass(frozen=True)
class SpecModel:
    """k: drafts verified per decode row and step. accepted_pmf: k + 1 probabilities of
    keeping 0..k drafts (they must sum to 1). seed: the draws' PRNG seed."""

    k: int
    accepted_pmf: tuple[float, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if len(self.accepted_pmf) != self.k + 1:
            raise ValueError(f"accepted_pmf needs k + 1 = {self.k + 1} entries")
        if min(self.accepted_pmf) < 0 or abs(sum(self.accepted_pmf) - 1.0) > 1e-6:
            raise ValueError(f"accepted_pmf must be a distribution, got {self.accepted_pmf}")

    @classmethod
    def from_acceptance_rate(cls, k: int, rate: float, seed: int = 0) -> SpecModel:
        """Drafts accepted independently with probability ``rate`` each, until the first
        rejection: P(a) = rate^a (1 - rate) for a < k, P(k) = rate^k."""
        pmf = [rate**a * (1 - rate) for a in range(k)] + [rate**k]
        return cls(k, tuple(pmf), seed)

    @property
    def mean_accepted(self) -> float:
        return sum(a * p for a, p in enumerate(self.accepted_pmf))

    def decode_rows(self, batch: ScheduledBatch) -> jax.Array:
        """bool[rows]: the batch's decode rows (as ``batch_work`` defines them)."""
        return (batch.seq_ids >= 0) & (batch.q_lens == 1) & (batch.start_pos > 0)

    def verify_work(self, batch: ScheduledBatch, work: tuple) -> tuple:
        """The cost-model inputs with each decode row's k draft tokens added as
        prefill-like tokens (attention pairs: each reads its context)."""
        prefill_tokens, decode_seqs, kv, pairs, prefill_seqs = work
        dec = self.decode_rows(batch)
        extra = self.k * jnp.sum(dec).astype(jnp.float32)
        ctx = jnp.sum(jnp.where(dec, batch.start_pos + 1, 0)).astype(jnp.float32)
        k = float(self.k)
        extra_pairs = k * ctx + jnp.sum(dec).astype(jnp.float32) * k * (k + 1) / 2
        return prefill_tokens + extra, decode_seqs, kv, pairs + extra_pairs, prefill_seqs

    def accept(self, state: Any, batch: ScheduledBatch, step: jax.Array,
               max_model_len: int) -> Any:  # fmt: skip
        """state with each decode row's kept drafts added to output_len and num_computed
        (``update`` then adds the step's own token and finishes by length as usual)."""
        n = state.num_computed.shape[0]
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        logits = jnp.log(jnp.asarray(self.accepted_pmf, jnp.float32))
        a = jax.random.categorical(key, logits, shape=batch.seq_ids.shape).astype(jnp.int32)
        safe = jnp.maximum(batch.seq_ids, 0)
        room = output_target(state, max_model_len)[safe] - state.output_len[safe] - 1
        a = jnp.where(self.decode_rows(batch) & batch.emits, jnp.clip(a, 0, room), 0)
        ids = jnp.where(a > 0, safe, n)
        return state._replace(
            output_len=state.output_len.at[ids].add(a, mode="drop"),
            num_computed=state.num_computed.at[ids].add(a, mode="drop"),
        )


__all__ = ["SpecModel"]
