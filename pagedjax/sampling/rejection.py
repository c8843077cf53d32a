"""Speculative rejection sampling: tokens from the target distribution, whatever the draft.

Leviathan et al. (2023) / Chen et al. (2023): draft tokens d_j ~ q_j are verified
against the target's distributions p_j (j = 0..k-1, plus p_k after the last draft).
Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection the emitted token is drawn from the normalised residual max(p_j - q_j, 0),
and when all k are accepted a bonus token is drawn from p_k. Every emitted token is
then distributed exactly as p at its position (the theorem; tests/test_rejection.py
checks it with a chi-square test), so speculation changes the speed, never the output
distribution.

Randomness: one key per (row, position) from (seed, sample index, output position)
only, as the plain sampler's ``row_keys``; the acceptance uniform and the residual /
bonus draw use two independent keys folded from it, so a seeded request's draws do not
depend on the batch, the slot or the step.

The engine's point-mass drafts (n-gram lookup; a greedy draft) use the special case
q = one-hot in ``engine/spec/verify.py`` (accept iff the target's own sample equals the
draft), which is this rule with the draws shared with the non-speculative sampler. This
general form is for drafts that sample: ``engine/spec/verify.py`` calls it for
``draft_sample_method="probabilistic"`` (engine/spec/draft_sampling.py).

Shapes: S rows, K draft positions (static), V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RejectionOutput(NamedTuple):
    """accepted int32[S]: drafts kept (leading); token_ids int32[S, K + 1]: the drafts
    with position ``accepted`` replaced by the residual / bonus token (positions past
    it are meaningless); the row emits token_ids[:, : accepted + 1]."""

    accepted: jax.Array
    token_ids: jax.Array


def position_keys(seed: jax.Array, sample_index: jax.Array, output_position: jax.Array,
                  num_positions: int) -> jax.Array:  # fmt: skip
    """key[S, num_positions]: fold_in(fold_in(key(seed), index), output_position + j),
    the plain sampler's key for each position (uint32 seed, int32 index / position)."""

    def one(s, i, p):
        base = jax.random.fold_in(jax.random.key(s), i)
        return jax.vmap(lambda j: jax.random.fold_in(base, p + j))(jnp.arange(num_positions))

    return jax.vmap(one)(seed.astype(jnp.uint32), sample_index, output_position)


def rejection_sample(
    target_probs: jax.Array,
    draft_probs: jax.Array,
    draft_ids: jax.Array,
    num_drafts: jax.Array,
    keys: jax.Array,
) -> RejectionOutput:
    """Verify drafts by rejection sampling (module docstring).

    target_probs: float32[S, K + 1, V], p at each draft position and after the last.
    draft_probs: float32[S, K, V], the q each draft was sampled from.
    draft_ids: int32[S, K]. num_drafts: int32[S] <= K (positions past it are ignored: a
    row with fewer drafts gets its bonus token from p at position num_drafts).
    keys: key[S, K + 1] (``position_keys``).
    """
    s, k = draft_ids.shape
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    p_d = jnp.take_along_axis(target_probs[:, :k], draft_ids[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, draft_ids[..., None], axis=-1)[..., 0]
    accept_keys = jax.vmap(jax.vmap(lambda key: jax.random.fold_in(key, 0)))(keys[:, :k])
    u = jax.vmap(jax.vmap(jax.random.uniform))(accept_keys)
    # u < p/q without dividing (q_d > 0 for a token the draft sampled).
    ok = (u * q_d < p_d) & (j < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)

    # The distribution the emitted token comes from: the residual at a rejection, p
    # itself after the last draft (q padded with zeros there, so the residual is p).
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(target_probs[:, :1])], axis=1)
    q_pad = jnp.where((jnp.arange(k + 1)[None, :] < num_drafts[:, None])[..., None], q_pad, 0.0)
    rows = jnp.arange(s)
    p_a, q_a = target_probs[rows, accepted], q_pad[rows, accepted]  # [S, V]
    residual = jnp.maximum(p_a - q_a, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # p == q exactly leaves no residual; then any token of p is right (never reached
    # with probability > 0, since such a draft is always accepted).
    residual = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-30), p_a)
    draw_key = jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys[rows, accepted])
    logits = jnp.where(residual > 0, jnp.log(jnp.maximum(residual, 1e-38)), -jnp.inf)
    nxt = jax.vmap(jax.random.categorical)(draw_key, logits).astype(jnp.int32)
    ids = jnp.concatenate([draft_ids, jnp.zeros((s, 1), jnp.int32)], axis=1)
    ids = ids.at[rows, accepted].set(nxt)
    return RejectionOutput(accepted, ids)


__all__ = ["RejectionOutput", "position_keys", "rejection_sample"]
