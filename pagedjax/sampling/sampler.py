"""Batched sampling in one jitted function: penalties, temperature, filters, draw, logprobs.

Order as in vLLM: penalties -> temperature -> top-k / top-p / min-p -> sample. Greedy
rows take the argmax of the penalised logits. Every step is row-local and a row's PRNG
key is fold_in(fold_in(key(seed), sample_index), output_position), so a row's sample
does not depend on its slot, its neighbours, the padding, the engine step or preemption.

Reported logprobs are those of the raw model distribution, log_softmax(logits) before
penalties, temperature and filtering (vLLM's default, "raw_logprobs"): the sampled
token's logprob and rank, and the top max_logprobs tokens sorted by logprob. A row whose
``logprob_temperature`` is not 1 (beam search only) reports log_softmax(logits / it).

Shapes: S sampled rows (padded), V vocabulary, K = min(max_logprobs, V).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.sampling.tensors import SamplingTensors, TokenHistory

DEFAULT_MAX_LOGPROBS = 20  # vLLM's default max_logprobs


class SamplerOutput(NamedTuple):
    """token_ids int32[S]; logprobs float32[S] (raw distribution); ranks int32[S]
    (1 = most likely token); top_ids int32[S, K]; top_logprobs float32[S, K], descending."""

    token_ids: jax.Array
    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def token_counts(ids: jax.Array, vocab_size: int) -> jax.Array:
    """Occurrences of each token per row: int32[S, L] ids (negative = padding) -> int32[S, V]."""
    s = ids.shape[0]
    # Padding goes to index V and is dropped; a plain -1 would wrap to the last token.
    ids = jnp.where(ids < 0, vocab_size, ids)
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], ids.shape)
    return jnp.zeros((s, vocab_size), jnp.int32).at[rows, ids].add(1, mode="drop")


def apply_penalties(logits: jax.Array, t: SamplingTensors, history: TokenHistory) -> jax.Array:
    """vLLM's penalties on float32[S, V] logits.

    Repetition (tokens in prompt or output): positive logits / p, negative logits * p.
    Then logit -= frequency * output_count + presence * (output_count > 0).
    """
    v = logits.shape[-1]
    out_counts = token_counts(history.output_ids, v)
    seen = (token_counts(history.prompt_ids, v) > 0) | (out_counts > 0)
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * out_counts
    return logits - t.presence_penalty[:, None] * (out_counts > 0)


def _filter_threshold(scaled: jax.Array, t: SamplingTensors) -> jax.Array:
    """Smallest logit kept by top-k then top-p, per row: float32[S, V] -> float32[S].

    One descending sort serves both. Ties at a threshold are all kept.
    """
    v = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)
    k = jnp.where((t.top_k <= 0) | (t.top_k > v), v, t.top_k)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)[:, 0]
    # top-p over the top-k survivors: keep a sorted position while the mass strictly
    # before it is below top_p (vLLM's rule; the most likely token always stays).
    probs = jax.nn.softmax(jnp.where(ordered >= kth[:, None], ordered, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.sum(mass_before < t.top_p[:, None], axis=-1)
    pth = jnp.take_along_axis(ordered, (n_keep - 1)[:, None], axis=-1)[:, 0]
    # top_p == 1 is off; rounding in the cumsum must not drop tail tokens then.
    pth = jnp.where(t.top_p >= 1.0, -jnp.inf, pth)
    return jnp.maximum(kth, pth)


def apply_token_bitmask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """float32[S, V] logits with -inf where int32[S, W] packed ``mask``'s bit is clear
    (bit t % 32 of word t // 32 is token t). Skipped (one cond) when every word is -1."""
    v = logits.shape[-1]
    tok = jnp.arange(v, dtype=jnp.int32)

    def masked(x: jax.Array) -> jax.Array:
        bits = (mask[:, tok // 32] >> (tok % 32)[None, :]) & 1
        return jnp.where(bits == 1, x, -jnp.inf)

    return jax.lax.cond(jnp.all(mask == -1), lambda x: x, masked, logits)


def fsm_allowed(t: SamplingTensors) -> jax.Array:
    """bool[S, V]: the tokens each row's device FSM allows (every token on a row with
    fsm_state -1). Cost: one [S, C] row gather and one [S, V] gather by token class."""
    state = t.fsm_state
    rows = t.fsm_table[jnp.maximum(state, 0)]  # [S, C]
    return (rows[:, t.fsm_class] >= 0) | (state < 0)[:, None]


def apply_fsm_mask(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """float32[S, V] logits with -inf where the row's device FSM refuses the token;
    skipped (static) without a table, and (one cond) when no row has an FSM state."""
    if not t.fsm_table.shape[0]:
        return logits
    return jax.lax.cond(jnp.any(t.fsm_state >= 0),
                        lambda x: jnp.where(fsm_allowed(t), x, -jnp.inf), lambda x: x,
                        logits)  # fmt: skip


def fsm_next(t: SamplingTensors, ids: jax.Array) -> jax.Array:
    """int32[S]: each row's device FSM state after sampling ids int32[S] (-1 stays -1)."""
    if not t.fsm_table.shape[0]:
        return t.fsm_state
    nxt = t.fsm_table[jnp.maximum(t.fsm_state, 0), t.fsm_class[ids]]
    return jnp.where(t.fsm_state >= 0, nxt, -1)


def apply_logit_controls(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM's order before the penalties: the grammar mask (the host's bitmask and the
    device FSM's), allowed_token_ids / bad_words / min_tokens (``token_mask``), then
    logit_bias. Zero-width fields are skipped (static)."""
    logits = apply_fsm_mask(logits, t)
    if t.grammar_mask.shape[-1]:
        logits = apply_token_bitmask(logits, t.grammar_mask)
        logits = apply_token_bitmask(logits, t.token_mask)
    if t.bias_ids.shape[-1]:
        v = logits.shape[-1]
        ids = jnp.where(t.bias_ids < 0, v, t.bias_ids)  # padding: dropped
        rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)

        def biased(x: jax.Array) -> jax.Array:
            return x.at[rows, ids].add(t.bias_values, mode="drop")

        logits = jax.lax.cond(jnp.all(t.bias_ids < 0), lambda x: x, biased, logits)
    return logits


def process_logits(
    logits: jax.Array, t: SamplingTensors, history: TokenHistory | None = None
) -> jax.Array:
    """float32[S, V] raw logits -> float32[S, V] logits of the distribution sampled from.

    Masked and biased (``apply_logit_controls``), penalised, divided by temperature, and
    filtered (excluded tokens are -inf). A greedy row becomes 0 at its argmax (first on
    ties) and -inf elsewhere.
    """
    logits = apply_logit_controls(logits.astype(jnp.float32), t)
    if history is not None:
        active = jnp.any(
            (t.repetition_penalty != 1.0)
            | (t.frequency_penalty != 0.0)
            | (t.presence_penalty != 0.0)
        )
        # Skips the [S, V] scatters on steps where no row uses a penalty.
        logits = jax.lax.cond(active, apply_penalties, lambda x, *_: x, logits, t, history)
    v = logits.shape[-1]
    greedy_pick = jnp.argmax(logits, axis=-1)
    scaled = logits / t.temperature[:, None]
    needs_sort = jnp.any(((t.top_k > 0) & (t.top_k < v)) | (t.top_p < 1.0))
    thresh = jax.lax.cond(
        needs_sort,
        _filter_threshold,
        lambda x, _: jnp.full(x.shape[:1], -jnp.inf, x.dtype),
        scaled,
        t,
    )
    # min-p: p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p).
    top = jnp.max(scaled, axis=-1)
    safe_min_p = jnp.where(t.min_p > 0.0, t.min_p, 1.0)
    mth = jnp.where(t.min_p > 0.0, top + jnp.log(safe_min_p), -jnp.inf)
    thresh = jnp.maximum(thresh, mth)
    filtered = jnp.where(scaled >= thresh[:, None], scaled, -jnp.inf)
    one_hot = jnp.where(jnp.arange(v)[None, :] == greedy_pick[:, None], 0.0, -jnp.inf)
    return jnp.where(t.greedy[:, None], one_hot, filtered)


@jax.jit
def processed_probs(
    logits: jax.Array, t: SamplingTensors, history: TokenHistory | None = None
) -> jax.Array:
    """float32[S, V]: the renormalised distribution each row samples from."""
    return jax.nn.softmax(process_logits(logits, t, history), axis=-1)


def row_keys(t: SamplingTensors) -> jax.Array:
    """One PRNG key per row from (seed, sample_index, output_position) only: key[S]."""

    def key(seed: jax.Array, index: jax.Array, position: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index), position)

    return jax.vmap(key)(t.seed.astype(jnp.uint32), t.sample_index, t.output_position)


def _logprob_summary(
    logprobs: jax.Array, ids: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logprob and rank of ids int32[N] under float32[N, V] logprobs, plus the top k."""
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
    return chosen, ranks, top_ids.astype(jnp.int32), top_logprobs


@partial(jax.jit, static_argnames=("max_logprobs",))
def sample(
    logits: jax.Array,
    t: SamplingTensors,
    history: TokenHistory | None = None,
    *,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> SamplerOutput:
    """Sample one token per row.

    logits: float32[S, V] (other float dtypes are upcast). t: SamplingTensors of [S].
    history: TokenHistory, needed when any row uses a penalty; None means no history
    (penalties then have nothing to act on). Returns SamplerOutput with
    K = min(max_logprobs, V); the caller slices each request's own `logprobs` count.
    """
    if max_logprobs < 0:
        raise ValueError(f"max_logprobs must be non-negative, got {max_logprobs}")
    processed = process_logits(logits, t, history)
    ids = jax.lax.cond(
        jnp.all(t.greedy),  # all-greedy steps skip drawing [S, V] Gumbel noise
        lambda x: jnp.argmax(x, axis=-1),
        lambda x: jax.vmap(jax.random.categorical)(row_keys(t), x),
        processed,
    ).astype(jnp.int32)
    return output_for(logits, t, ids, max_logprobs=max_logprobs)


def output_for(logits: jax.Array, t: SamplingTensors, ids: jax.Array, *,
               max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> SamplerOutput:  # fmt: skip
    """The SamplerOutput of tokens ids int32[S] chosen by another rule (``sample``'s, or
    speculative rejection sampling): their reported logprobs and ranks, the top ones."""
    # Raw logprobs (logprob_temperature 1.0), or temperature-scaled ones for beam search;
    # vLLM's raw_logprobs: after the grammar mask (applied to the logits the sampler gets),
    # before allowed_token_ids, bad_words, min_tokens, logit_bias and the penalties.
    raw = apply_fsm_mask(logits.astype(jnp.float32), t)
    if t.grammar_mask.shape[-1]:
        raw = apply_token_bitmask(raw, t.grammar_mask)
    scale = t.logprob_temperature.astype(jnp.float32)[:, None]
    raw = jax.nn.log_softmax(raw / scale, axis=-1)
    k = min(max_logprobs, logits.shape[-1])
    return SamplerOutput(ids, *_logprob_summary(raw, ids, k))


class PromptLogprobs(NamedTuple):
    """logprobs float32[T], ranks int32[T] (0 and 0 where next id is padding);
    top_ids int32[T, k]; top_logprobs float32[T, k], descending."""

    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


@partial(jax.jit, static_argnames=("k",))
def prompt_logprobs(logits: jax.Array, next_ids: jax.Array, k: int) -> PromptLogprobs:
    """Raw logprobs of prompt tokens: position i's logits float32[T, V] score next_ids[i].

    next_ids int32[T]: the prompt token that follows position i; negative = padding
    (e.g. the last prompt position, whose next token is sampled, not given).
    k: number of top logprobs per position (static, <= V).
    """
    if not 0 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [0, V={logits.shape[-1]}], got {k}")
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    valid = next_ids >= 0
    chosen, ranks, top_ids, top_logprobs = _logprob_summary(raw, jnp.where(valid, next_ids, 0), k)
    return PromptLogprobs(
        jnp.where(valid, chosen, 0.0), jnp.where(valid, ranks, 0), top_ids, top_logprobs
    )
