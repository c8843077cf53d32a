"""Batched sampling in one jitted function: penalties, temperature, filters, draw, logprobs.

Order as in vLLM: penalties -> temperature -> top-k / top-p / min-p -> sample. Greedy
rows take the argmax of the penalised logits. Every step is row-local and a row's PRNG
key is fold_in(fold_in(key(seed), sample_index), output_position), so a row's sample
does not depend on its slot, its neighbours, the padding, the engine step or preemption.

Reported logprobs are those of the raw model distribution, log_softmax(logits) before
penalties, temperature and filtering (vLLM's default, "raw_logprobs"): the sampled
token's logprob on every step; its rank and the top max_logprobs tokens sorted by
logprob on steps where a row asked for them (``SamplingTensors.reports_top``). A row whose
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
    (1 = most likely token); top_ids int32[S, K]; top_logprobs float32[S, K], descending.
    ranks, top_ids and top_logprobs are computed on steps where a row's
    ``SamplingTensors.reports_top`` is set, and are zeros on every row otherwise."""

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


def unpack_bitmask(mask: jax.Array, vocab_size: int) -> jax.Array:
    """bool[S, V]: bit t % 32 of word t // 32 of int32[S, W] ``mask`` for each token t.

    Each word is shifted by 0..31 and reshaped ([S, W, 32] -> [S, W * 32]), elementwise
    work XLA vectorizes; indexing the words by t // 32 is a gather (64 x 49,152: 1.2 ms
    against 0.4 ms on a 2-core CPU)."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (mask[:, :, None] >> shifts) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size] == 1


def apply_token_bitmask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """float32[S, V] logits with -inf where int32[S, W] packed ``mask``'s bit is clear
    (bit t % 32 of word t // 32 is token t). Skipped (one cond) when every word is -1."""

    def masked(x: jax.Array) -> jax.Array:
        return jnp.where(unpack_bitmask(mask, x.shape[-1]), x, -jnp.inf)

    return jax.lax.cond(jnp.all(mask == -1), lambda x: x, masked, logits)


def first_argmax(x: jax.Array) -> jax.Array:
    """int32[S]: the index of each row's largest value of float32[S, V], the first on ties
    (``jnp.argmax``'s answer; a row of -inf gives 0).

    Two plain reductions, the maximum and then the smallest index holding it, which
    XLA:CPU vectorizes; ``jnp.argmax`` lowers to one reduce over (value, index) pairs
    that it does not (64 x 49,152: 1.5 ms against 7.2 ms on a 2-core CPU). A row whose
    maximum is NaN matches no index and gives V - 1, a valid id, never V."""
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    idx = jnp.arange(v, dtype=jnp.int32)
    return jnp.minimum(jnp.min(jnp.where(x == top, idx, v), axis=-1), v - 1)


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


def fsm_walk(t: SamplingTensors, ids: jax.Array, parents: jax.Array | None = None) -> jax.Array:
    """int32[S, K]: each row's device FSM state after draft node k (ids int32[S, K]), from
    its state ``t.fsm_state``: with ``parents`` None the nodes are a chain (node k follows
    node k - 1); else a tree, ``parents`` int32[S, K] giving node k's parent (-1: the
    row's own state; otherwise an earlier node, spec/tree.py's layout), so column k is the
    state after the path from the root to node k. -1 from a refused token on, and for rows
    without a state. Speculative verification samples the position after node k under
    column k. Cost: K steps of one table gather (K is small and static)."""
    root = t.fsm_state
    states = jnp.full(ids.shape, -1, jnp.int32)
    for k in range(ids.shape[1]):
        if k == 0:
            prev = root
        elif parents is None:
            prev = states[:, k - 1]
        else:  # the parent's column (filled: parents come first), or the row's own state
            p = parents[:, k]
            up = jnp.take_along_axis(states, jnp.maximum(p, 0)[:, None], axis=1)[:, 0]
            prev = jnp.where(p < 0, root, up)
        states = states.at[:, k].set(fsm_next(t._replace(fsm_state=prev), ids[:, k]))
    return states


def apply_grammar(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """float32[S, V] logits with the structured-output constraint applied: the device
    FSM's and the host's grammar bitmask (both skipped statically when absent)."""
    logits = apply_fsm_mask(logits, t)
    if t.grammar_mask.shape[-1]:
        logits = apply_token_bitmask(logits, t.grammar_mask)
    return logits


def apply_request_controls(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """allowed_token_ids / bad_words / min_tokens (``token_mask``), then logit_bias, on
    float32[S, V] logits (after the grammar: vLLM's order). Zero-width fields are
    skipped (static)."""
    if t.token_mask.shape[-1]:
        logits = apply_token_bitmask(logits, t.token_mask)
    if t.bias_ids.shape[-1]:
        v = logits.shape[-1]
        ids = jnp.where(t.bias_ids < 0, v, t.bias_ids)  # padding: dropped
        rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)

        def biased(x: jax.Array) -> jax.Array:
            return x.at[rows, ids].add(t.bias_values, mode="drop")

        logits = jax.lax.cond(jnp.all(t.bias_ids < 0), lambda x: x, biased, logits)
    return logits


def apply_logit_controls(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM's order before the penalties: the grammar mask (the host's bitmask and the
    device FSM's), allowed_token_ids / bad_words / min_tokens (``token_mask``), then
    logit_bias. Zero-width fields are skipped (static)."""
    return apply_request_controls(apply_grammar(logits, t), t)


def _penalised(
    logits: jax.Array, t: SamplingTensors, history: TokenHistory | None
) -> jax.Array:
    """Penalties on float32[S, V] controlled logits, skipped (one cond) on steps where
    no row uses one; ``history`` None: nothing to act on."""
    if history is None:
        return logits
    active = jnp.any(
        (t.repetition_penalty != 1.0)
        | (t.frequency_penalty != 0.0)
        | (t.presence_penalty != 0.0)
    )
    return jax.lax.cond(active, apply_penalties, lambda x, *_: x, logits, t, history)


def _distribution(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """float32[S, V] penalised logits -> the logits sampled from: divided by temperature
    and filtered (excluded tokens -inf); a greedy row is 0 at its first argmax and -inf
    elsewhere."""
    v = logits.shape[-1]
    greedy_pick = first_argmax(logits)
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


def process_logits(
    logits: jax.Array, t: SamplingTensors, history: TokenHistory | None = None
) -> jax.Array:
    """float32[S, V] raw logits -> float32[S, V] logits of the distribution sampled from.

    Masked and biased (``apply_logit_controls``), penalised, divided by temperature, and
    filtered (excluded tokens are -inf). A greedy row becomes 0 at its argmax (first on
    ties) and -inf elsewhere.
    """
    logits = apply_logit_controls(logits.astype(jnp.float32), t)
    return _distribution(_penalised(logits, t, history), t)


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
    # The grammar is applied once: the sampler and the reported logprobs both read it.
    masked = apply_grammar(logits.astype(jnp.float32), t)
    penalised = _penalised(apply_request_controls(masked, t), t, history)
    # An all-greedy step takes the penalised logits' first argmax directly: the same id
    # as the draw from ``_distribution``'s one-hot rows, without its [S, V] passes.
    ids = jax.lax.cond(
        jnp.all(t.greedy),
        first_argmax,
        lambda x: jax.vmap(jax.random.categorical)(row_keys(t), _distribution(x, t)),
        penalised,
    ).astype(jnp.int32)
    return _output(masked, t, ids, max_logprobs)


def output_for(logits: jax.Array, t: SamplingTensors, ids: jax.Array, *,
               max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> SamplerOutput:  # fmt: skip
    """The SamplerOutput of tokens ids int32[S] chosen by another rule (``sample``'s, or
    speculative rejection sampling): their reported logprobs; their ranks and the top
    tokens on steps where a row asked (``SamplingTensors.reports_top``), else zeros."""
    return _output(apply_grammar(logits.astype(jnp.float32), t), t, ids, max_logprobs)


def _output(masked: jax.Array, t: SamplingTensors, ids: jax.Array,
            max_logprobs: int) -> SamplerOutput:  # fmt: skip
    # Raw logprobs (logprob_temperature 1.0), or temperature-scaled ones for beam search;
    # vLLM's raw_logprobs: after the grammar mask (applied to the logits the sampler gets),
    # before allowed_token_ids, bad_words, min_tokens, logit_bias and the penalties.
    # jax.nn.log_softmax's arithmetic, taken apart so that the sampled token's logprob
    # (every step reports it) needs no [S, V] result: the ranks and the top-k over the
    # whole row (10 ms of a 64-row step over 49k tokens on a 2-core CPU) run only on
    # steps where a row asked for logprobs, and read the same shifted values and sum.
    scaled = masked / t.logprob_temperature.astype(jnp.float32)[:, None]
    shifted = scaled - jnp.max(scaled, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    chosen = jnp.take_along_axis(shifted, ids[:, None], axis=-1)[:, 0] - lse[:, 0]
    k = min(max_logprobs, masked.shape[-1])
    s = masked.shape[0]

    def ranked(shifted: jax.Array, lse: jax.Array) -> tuple[jax.Array, ...]:
        # Its chosen logprob is shifted[id] - lse again: the same value as ``chosen``.
        return _logprob_summary(shifted - lse, ids, k)[1:]

    def unranked(shifted: jax.Array, lse: jax.Array) -> tuple[jax.Array, ...]:
        return (jnp.zeros(s, jnp.int32), jnp.zeros((s, k), jnp.int32),
                jnp.zeros((s, k), jnp.float32))  # fmt: skip

    top = jax.lax.cond(jnp.any(t.reports_top), ranked, unranked, shifted, lse)
    return SamplerOutput(ids, chosen, *top)


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
