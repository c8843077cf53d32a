"""Sampled drafts (``draft_sample_method="probabilistic"``): draw each draft from q, keep q.

A drafting model (layer-skip, a separate checkpoint, the EAGLE head) normally drafts the
argmax of its logits, a point mass, verified by sample-and-compare (``verify.py``). With
probabilistic drafts it samples draft i of a row from q = softmax(draft logits / T) at
the request's temperature T and keeps q (float32[S, K, V], batch-row order) for the
verification, which then applies the rejection rule (``sampling/rejection.py``): accept
with min(1, p/q), resample a rejection from norm(max(0, p - q)). The emitted tokens
follow the target's distribution p whatever q is, so q need not match p's filters
(top-k / top-p / min-p / penalties are the target's; q is temperature only, as vLLM's).
A draft q puts mass where p has none only costs acceptance.

Greedy requests (temperature 0) draft the argmax (q one-hot) and keep sample-and-compare,
so their outputs equal the plain run's, as with greedy drafts.

Keys: draft i of a row is drawn with fold_in(k, 2), k = the plain sampler's key for the
position the draft is verified at (seed, sample index, output position output_len + i;
``rejection.position_keys``). The rejection's uniform uses fold_in(k, 0) and its
residual draw fold_in(k, 1): three independent streams, all functions of (seed, sample,
position) only, so a seeded request is reproducible whatever its batch.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pagedjax.sampling import SamplingTensors
from pagedjax.sampling.rejection import position_keys

DRAFT_STREAM = 2  # fold_in of the position key for the draft's own draw (0, 1: rejection's)


def draft_drawer(slot_sampling: SamplingTensors, output_len: jax.Array, seq_ids: jax.Array,
                 vocab_size: int) -> Callable[..., tuple[jax.Array, jax.Array]]:  # fmt: skip
    """draw(i, logits, vocab=None) -> (ids int32[S], q float32[S, V]) for the batch rows
    seq_ids int32[S] (slots; -1 padding) at draft index i (traced): logits float32[S, N]
    over the target's vocabulary, or over a draft vocabulary whose ids are vocab
    int32[N] (EAGLE's truncated one; q is scattered back to the V ids)."""
    safe = jnp.maximum(seq_ids, 0)
    temp = slot_sampling.temperature[safe].astype(jnp.float32)
    greedy = slot_sampling.greedy[safe]
    seed, index = slot_sampling.seed[safe], slot_sampling.sample_index[safe]
    base = output_len[safe]

    def draw(i: jax.Array, logits: jax.Array,
             vocab: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        keys = position_keys(seed, index, base + i, 1)[:, 0]
        keys = jax.vmap(lambda k: jax.random.fold_in(k, DRAFT_STREAM))(keys)
        scaled = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, temp)[:, None]
        top = jnp.argmax(scaled, axis=-1)
        choice = jnp.where(greedy, top, jax.vmap(jax.random.categorical)(keys, scaled))
        n = scaled.shape[-1]
        one_hot = (jnp.arange(n)[None, :] == top[:, None]).astype(jnp.float32)
        q = jnp.where(greedy[:, None], one_hot, jax.nn.softmax(scaled, axis=-1))
        if vocab is None:
            return choice.astype(jnp.int32), q
        full = jnp.zeros((q.shape[0], vocab_size), jnp.float32).at[:, vocab].set(q)
        return vocab[choice].astype(jnp.int32), full

    return draw


def store(q: jax.Array, i: jax.Array, probs: jax.Array, keep: jax.Array) -> jax.Array:
    """q float32[S, K, V] with probs float32[S, V] at draft i where keep bool[S] (others
    0 there: a position past a row's drafts is never read); i == K is dropped."""
    return q.at[:, i].set(jnp.where(keep[:, None], probs, 0.0), mode="drop")


__all__ = ["DRAFT_STREAM", "draft_drawer", "store"]
