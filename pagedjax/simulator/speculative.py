"""The simulator's speculative mode: decode rows verify k drafts and keep a random run.

A ``SpecModel`` turns a simulated decode row into a speculating one: the step's cost
counts its k extra query tokens (as prefill-like tokens: the verification is a q_len =
k + 1 row attending over its context, with k more rows of logits), and after the step
the row keeps ``a`` extra tokens, a drawn from ``accepted_pmf`` (P(a = 0..k), an input:
measure it on the real engine, ``stats()``'s acceptance counts, or sweep it), capped so
the output never passes its target. Everything else is the real scheduler and memory
policy, as in the plain simulation (simulate.py), so Fig. 12-style curves can be drawn
with and without speculation (experiments/speculative_curves.py).

The draft's cost (``draft_cost_fraction`` f): each speculating step adds k draft steps,
each costing f times the target's decode-only step over the same speculating rows
(``cost_model(0, rows, their context, 0, 0)``, its fixed per-step overhead included).
f = 0 (the default) counts no draft cost: right for n-gram lookup (a host-side search),
an underestimate for a draft model or an EAGLE head, whose f a caller must give (e.g.
the draft's weight bytes over the target's).

Approximations (say so beside any simulated number): the draft's cost is the fraction
above (0 unless given), its prefill of the prompt is not counted; the k verification
tokens add cost but do not take the scheduler's token budget (``max_num_batched_tokens``),
so a step that also admits prompts can exceed it by k x its decode rows (a real
scheduler would admit those prompts a step later); the transient blocks the drafts hold
during the verification are not allocated (a real engine speculates only into free blocks and
returns them at once, so they never force preemption); the accepted length is drawn
independently per row and step.

Compilation: ``SpecModel.params()`` gives the model as traced arrays (``SpecParams``; k
too, the pmf padded to a static width), so every SpecModel of one width shares one
compiled simulation loop, k = 0 (no drafts, identical to the plain loop) included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.scheduler import ScheduledBatch, output_target

# The pmf's padded length - 1 for every k up to it: one compiled loop for all of them.
MIN_PMF_WIDTH = 8


class SpecParams(NamedTuple):
    """A SpecModel as arrays (a pytree the simulation loop traces).

    k: int32[] drafts per decode row and step (0: none; a tree's depth). log_pmf:
    float32[W + 1] log P(a) for a = 0..W (-inf past k). seed: int32[].
    draft_cost_fraction: float32[]. nodes: int32[] draft tokens verified per decode row
    (k for a chain). draft_width: float32[] rows each draft step runs per decode row (1
    for a chain, a tree's branches).
    """

    k: jax.Array
    log_pmf: jax.Array
    seed: jax.Array
    draft_cost_fraction: jax.Array
    nodes: jax.Array
    draft_width: jax.Array


@dataclass(frozen=True)
class SpecModel:
    """k: drafts verified per decode row and step (0: no speculation, the plain step);
    with a tree, its depth (the most a row can keep). accepted_pmf: k + 1 probabilities
    of keeping 0..k drafts (they must sum to 1). seed: the draws' PRNG seed.
    draft_cost_fraction: the draft's step cost as a fraction of the target's decode step
    (module docstring; 0: not counted). nodes: draft tokens verified per decode row (None:
    k, a chain; a tree's node count, >= k). draft_width: rows each of the k draft steps
    runs per decode row (1: a chain; an EAGLE tree's branches)."""

    k: int
    accepted_pmf: tuple[float, ...]
    seed: int = 0
    draft_cost_fraction: float = 0.0
    nodes: int | None = None
    draft_width: int = 1

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")
        if len(self.accepted_pmf) != self.k + 1:
            raise ValueError(f"accepted_pmf needs k + 1 = {self.k + 1} entries")
        if min(self.accepted_pmf) < 0 or abs(sum(self.accepted_pmf) - 1.0) > 1e-6:
            raise ValueError(f"accepted_pmf must be a distribution, got {self.accepted_pmf}")
        if not self.draft_cost_fraction >= 0:
            raise ValueError(f"draft_cost_fraction must be >= 0, got {self.draft_cost_fraction}")
        if self.nodes is not None and not self.k <= self.nodes:
            raise ValueError(f"a tree's nodes must be >= its depth k = {self.k}, got {self.nodes}")
        if self.draft_width < 1:
            raise ValueError(f"draft_width must be >= 1, got {self.draft_width}")

    @property
    def verified_nodes(self) -> int:
        """Draft tokens verified per decode row and step: nodes, or k for a chain."""
        return self.k if self.nodes is None else self.nodes

    @classmethod
    def none(cls) -> SpecModel:
        """No drafts: the plain step (through the speculative loop; same results)."""
        return cls(0, (1.0,))

    @classmethod
    def from_acceptance_rate(
        cls, k: int, rate: float, seed: int = 0, draft_cost_fraction: float = 0.0
    ) -> SpecModel:
        """Drafts accepted independently with probability ``rate`` each, until the first
        rejection: P(a) = rate^a (1 - rate) for a < k, P(k) = rate^k.

        Note: its mean accepted drafts, rate + ... + rate^k, is below k * rate, so the
        engine's ``spec_acceptance_rate`` (accepted / proposed) is *not* this rate; to
        reproduce a measured mean use ``from_mean_accepted``."""
        if not 0 <= rate <= 1:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        pmf = [rate**a * (1 - rate) for a in range(k)] + [rate**k]
        return cls(k, tuple(pmf), seed, draft_cost_fraction)

    @classmethod
    def from_mean_accepted(
        cls, k: int, mean_drafts: float, seed: int = 0, draft_cost_fraction: float = 0.0,
        nodes: int | None = None, draft_width: int = 1,
    ) -> SpecModel:
        """The first-rejection model of ``from_acceptance_rate`` with its per-draft rate
        chosen so that the mean accepted drafts per step equals ``mean_drafts`` (in
        [0, k]): the engine's ``spec_mean_accepted_length`` - 1, or its
        ``spec_acceptance_rate`` x k. The rate is found by bisection (the mean rises
        with it); the pmf's shape is the model's assumption, its mean is the input. A
        tree (nodes, draft_width): k is its depth and the mean its measured accepted
        length - 1; the pmf is over depths, as the engine's per-level acceptance."""
        if not 0 <= mean_drafts <= k:
            raise ValueError(f"mean_drafts must be in [0, k = {k}], got {mean_drafts}")
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if sum(mid**a for a in range(1, k + 1)) < mean_drafts:
                lo = mid
            else:
                hi = mid
        chain = cls.from_acceptance_rate(k, (lo + hi) / 2, seed, draft_cost_fraction)
        return cls(k, chain.accepted_pmf, seed, draft_cost_fraction, nodes, draft_width)

    @property
    def mean_accepted(self) -> float:
        return sum(a * p for a, p in enumerate(self.accepted_pmf))

    @property
    def pmf_width(self) -> int:
        """The padded pmf's width W (a static shape): max(MIN_PMF_WIDTH, k)."""
        return max(MIN_PMF_WIDTH, self.k)

    def params(self) -> SpecParams:
        """This model as traced arrays (the pmf padded with zeros to ``pmf_width`` + 1)."""
        pmf = list(self.accepted_pmf) + [0.0] * (self.pmf_width - self.k)
        return SpecParams(
            jnp.int32(self.k),
            jnp.log(jnp.asarray(pmf, jnp.float32)),
            jnp.int32(self.seed),
            jnp.float32(self.draft_cost_fraction),
            jnp.int32(self.verified_nodes),
            jnp.float32(self.draft_width),
        )


def decode_rows(batch: ScheduledBatch) -> jax.Array:
    """bool[rows]: the batch's decode rows (as ``batch_work`` defines them)."""
    return (batch.seq_ids >= 0) & (batch.q_lens == 1) & (batch.start_pos > 0)


def verify_work(spec: SpecParams, batch: ScheduledBatch, work: tuple) -> tuple:
    """The cost-model inputs with each decode row's n draft tokens (n = nodes: k for a
    chain) added as prefill-like tokens (attention pairs: each reads its context and its
    ancestors, d of them at depth d; one logits row each, counted through
    ``prefill_seqs``). A chain's ancestors sum to k (k + 1) / 2 exactly; a tree's are
    taken as n (k + 1) / 2, exact for equal-width levels (the EAGLE trees) and an
    approximation for an n-gram trie's uneven ones (tree attention is masked, so its
    cost is the kernel's over the visible pairs)."""
    prefill_tokens, decode_seqs, kv, pairs, prefill_seqs = work
    dec = decode_rows(batch)
    n_dec = jnp.sum(dec).astype(jnp.float32)
    k = spec.k.astype(jnp.float32)
    n = jnp.where(spec.k > 0, spec.nodes, 0).astype(jnp.float32)
    ctx = jnp.sum(jnp.where(dec, batch.start_pos + 1, 0)).astype(jnp.float32)
    extra_pairs = n * ctx + n_dec * n * (k + 1) / 2
    return (
        prefill_tokens + n * n_dec,
        decode_seqs,
        kv,
        pairs + extra_pairs,
        prefill_seqs + n * n_dec,
    )


def draft_time(spec: SpecParams, batch: ScheduledBatch, cost_model: Any) -> jax.Array:
    """float32[] seconds of the step's k draft steps: k x draft_cost_fraction x the
    target's decode-only step over draft_width x the decode rows (a tree's branches each
    take a row; 0 without decode rows)."""
    dec = decode_rows(batch)
    w = spec.draft_width
    n_dec = jnp.sum(dec).astype(jnp.float32)
    ctx = jnp.sum(jnp.where(dec, batch.start_pos + 1, 0)).astype(jnp.float32)
    z = jnp.float32(0.0)
    step = cost_model(z, w * n_dec, w * ctx, z, z)
    t = spec.k.astype(jnp.float32) * spec.draft_cost_fraction * step
    return jnp.where(n_dec > 0, t, 0.0).astype(jnp.float32)


def accept(
    spec: SpecParams, state: Any, batch: ScheduledBatch, step: jax.Array, max_model_len: int
) -> Any:
    """state with each decode row's kept drafts added to output_len and num_computed
    (``update`` then adds the step's own token and finishes by length as usual)."""
    n = state.num_computed.shape[0]
    key = jax.random.fold_in(jax.random.key(spec.seed), step)
    a = jax.random.categorical(key, spec.log_pmf, shape=batch.seq_ids.shape).astype(jnp.int32)
    safe = jnp.maximum(batch.seq_ids, 0)
    room = output_target(state, max_model_len)[safe] - state.output_len[safe] - 1
    a = jnp.where(decode_rows(batch) & batch.emits, jnp.clip(a, 0, room), 0)
    ids = jnp.where(a > 0, safe, n)
    return state._replace(
        output_len=state.output_len.at[ids].add(a, mode="drop"),
        num_computed=state.num_computed.at[ids].add(a, mode="drop"),
    )


__all__ = ["MIN_PMF_WIDTH", "SpecModel", "SpecParams", "accept", "draft_time", "verify_work"]
