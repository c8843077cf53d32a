"""Host-built per-row arrays that carry SamplingParams (and token history) into jit.

S below is the padded number of sampled rows (one row per sequence being sampled this
step); padding rows are greedy with every option off, and their outputs are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from pagedjax.sampling.params import SamplingParams

# Entries of one request's logit_bias the sampler carries per row (a fixed shape keeps one
# compiled program per bucket); a request with more is refused at add_request.
MAX_LOGIT_BIAS_ENTRIES = 300


def mask_words(vocab_size: int) -> int:
    """Int32 words of a packed token bitmask over ``vocab_size`` tokens: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def pack_token_ids(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """int32[ceil(V / 32)] bitmask with bit t % 32 of word t // 32 set for each id in ids
    (xgrammar's and llguidance's layout)."""
    bits = np.zeros(mask_words(vocab_size) * 32, np.bool_)
    bits[np.asarray(ids, np.int64)] = True
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


class SamplingTensors(NamedTuple):
    """Per-row sampling options, a pytree of arrays of shape [S].

    temperature: float32, 1.0 on greedy rows (so nothing divides by zero).
    greedy: bool, argmax of the penalised logits.
    top_k: int32, 0 = off. top_p: float32, 1.0 = off. min_p: float32, 0.0 = off.
    presence_penalty, frequency_penalty: float32, 0.0 = off.
    repetition_penalty: float32, 1.0 = off.
    seed: uint32. sample_index: int32, which of the request's n samples this row is.
    output_position: int32, index of the token being sampled within that sample's
        output (0 for the first generated token). The row's PRNG key depends on
        (seed, sample_index, output_position) only.
    logprob_temperature: float32, the reported logprobs are log_softmax(logits / it):
        1.0 = the raw distribution (vLLM's default, every request); beam search sets
        its temperature here so it ranks beams by temperature-scaled log-probs.
    reports_top: bool, the row's request asked for logprobs (``SamplingParams.logprobs``
        not None; beam search asks): the sampler ranks the sampled token and finds the
        top tokens on steps where any row does, and skips both otherwise.

    Logit controls, [S, W] and [S, B] (W = ceil(V / 32), B = MAX_LOGIT_BIAS_ENTRIES; both
    0 when built without a vocabulary: the sampler then skips them, a static choice):
    grammar_mask: int32[S, W] packed bitmask (bit t % 32 of word t // 32: token t may be
        sampled), the structured-output constraint; -1 words = no constraint. Applied
        before the reported logprobs, as vLLM applies its grammar bitmask to the logits
        it hands the sampler.
    token_mask: int32[S, W], allowed_token_ids, bad_words and min_tokens' masked stop ids
        (the engine rewrites the dynamic parts each step); applied after the reported
        logprobs (vLLM's raw_logprobs are taken before its logits processors).
    bias_ids: int32[S, B], -1 padded; bias_values: float32[S, B]: logit_bias, added
        after token_mask and before the penalties and temperature (vLLM's order).

    Device FSM (structured/token_fsm.py; ``StructuredOutputsConfig.device_fsm``):
    fsm_state: int32[S], the row's state as a row of ``fsm_table``; -1 = no device FSM.
    fsm_table: int32[R, C], NOT per row: every constrained row's token DFA in one table
        (next row of (row, token class), -1 = token not allowed); [0, 0] when no row
        uses one (the sampler then skips it, a static choice).
    fsm_class: int32[V] (or [0]), NOT per row: each token's class (column of the table).
    A row with fsm_state >= 0 may sample only tokens t with
    ``fsm_table[fsm_state, fsm_class[t]] >= 0`` (applied where grammar_mask is), and its
    next state is that entry (``fsm_next``). Gather rows with ``take_rows``, which keeps
    the two shared fields whole.
    """

    temperature: jax.Array
    greedy: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    seed: jax.Array
    sample_index: jax.Array
    output_position: jax.Array
    logprob_temperature: jax.Array
    reports_top: jax.Array
    grammar_mask: jax.Array
    token_mask: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    fsm_state: jax.Array
    fsm_table: jax.Array
    fsm_class: jax.Array

    @classmethod
    def from_params(
        cls,
        rows: Sequence[tuple[SamplingParams, int, int]],
        pad_to: int,
        vocab_size: int = 0,
    ) -> SamplingTensors:
        """Build the arrays from (params, sample_index, output_position) per row.

        Rows beyond len(rows) up to pad_to are neutral greedy padding. A sampled
        (non-greedy) row must have a seed: the engine assigns one at add_request.
        vocab_size: V for the logit controls (0: none, and a request using
        allowed_token_ids or logit_bias is refused). The static controls
        (allowed_token_ids, logit_bias) are set here; the engine writes the dynamic ones
        (bad_words, min_tokens, the grammar) into the masks each step.
        Returns numpy arrays (jit transfers them; no device placement here).
        """
        if pad_to < len(rows):
            raise ValueError(f"pad_to ({pad_to}) must be at least the number of rows ({len(rows)})")
        t = _neutral(pad_to, vocab_size)
        for r, row in enumerate(rows):
            if len(row) != 3 or not isinstance(row[0], SamplingParams):
                raise ValueError(
                    f"rows[{r}] must be (SamplingParams, sample_index, output_position), "
                    f"got {row!r}"
                )
            p, sample_index, output_position = row
            if not 0 <= sample_index < p.n:
                raise ValueError(f"rows[{r}]: sample_index {sample_index} not in [0, n={p.n})")
            if output_position < 0:
                raise ValueError(f"rows[{r}]: output_position must be >= 0, got {output_position}")
            if p.seed is None and not p.greedy:
                raise ValueError(
                    f"rows[{r}]: seed is None; the engine must assign a seed at add_request"
                )
            t["greedy"][r] = p.greedy
            if not p.greedy:  # vLLM ignores temperature and filters for greedy requests
                t["temperature"][r] = p.temperature
                t["top_k"][r] = p.top_k
                t["top_p"][r] = p.top_p
                t["min_p"][r] = p.min_p
            t["presence_penalty"][r] = p.presence_penalty
            t["frequency_penalty"][r] = p.frequency_penalty
            t["repetition_penalty"][r] = p.repetition_penalty
            t["seed"][r] = 0 if p.seed is None else p.seed
            t["sample_index"][r] = sample_index
            t["output_position"][r] = output_position
            t["reports_top"][r] = p.logprobs is not None
            _static_controls(t, r, p, vocab_size)
        return cls(**t)


def static_token_mask(p: SamplingParams, vocab_size: int) -> np.ndarray:
    """int32[W]: the tokens p.allowed_token_ids lets through (all when None)."""
    if p.allowed_token_ids is None:
        return np.full(mask_words(vocab_size), -1, np.int32)
    return pack_token_ids(p.allowed_token_ids, vocab_size)


def _static_controls(t: dict, r: int, p: SamplingParams, vocab_size: int) -> None:
    uses = p.allowed_token_ids is not None or bool(p.logit_bias)
    if not uses:
        return
    if vocab_size == 0:
        raise ValueError("allowed_token_ids / logit_bias need the tensors built with vocab_size")
    ids = [*(p.allowed_token_ids or ()), *(p.logit_bias or {})]
    if max(ids) >= vocab_size:
        raise ValueError(f"token id {max(ids)} outside the vocabulary [0, {vocab_size})")
    t["token_mask"][r] = static_token_mask(p, vocab_size)
    bias = p.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS_ENTRIES}"
        )
    t["bias_ids"][r, : len(bias)] = list(bias)
    t["bias_values"][r, : len(bias)] = list(bias.values())


def _neutral(s: int, vocab_size: int = 0) -> dict[str, np.ndarray]:
    f32, i32 = np.float32, np.int32
    w = mask_words(vocab_size)
    b = MAX_LOGIT_BIAS_ENTRIES if vocab_size else 0
    return dict(
        temperature=np.ones(s, f32),
        greedy=np.ones(s, np.bool_),
        top_k=np.zeros(s, i32),
        top_p=np.ones(s, f32),
        min_p=np.zeros(s, f32),
        presence_penalty=np.zeros(s, f32),
        frequency_penalty=np.zeros(s, f32),
        repetition_penalty=np.ones(s, f32),
        seed=np.zeros(s, np.uint32),
        sample_index=np.zeros(s, i32),
        output_position=np.zeros(s, i32),
        logprob_temperature=np.ones(s, f32),
        reports_top=np.zeros(s, np.bool_),
        grammar_mask=np.full((s, w), -1, i32),
        token_mask=np.full((s, w), -1, i32),
        bias_ids=np.full((s, b), -1, i32),
        bias_values=np.zeros((s, b), f32),
        fsm_state=np.full(s, -1, i32),
        fsm_table=np.zeros((0, 0), i32),
        fsm_class=np.zeros(0, i32),
    )


# SamplingTensors fields shared by every row (not indexed by row or slot).
SHARED_FIELDS = ("fsm_table", "fsm_class")


def take_rows(t: SamplingTensors, idx: jax.Array) -> SamplingTensors:
    """The rows ``idx`` of ``t`` (every per-row field gathered, SHARED_FIELDS kept)."""
    return t._replace(**{k: v[idx] for k, v in t._asdict().items() if k not in SHARED_FIELDS})


class TokenHistory(NamedTuple):
    """Token ids seen by each row, for the penalties; negative ids are padding.

    prompt_ids: int32[S, Lp], the prompt (repetition penalty only).
    output_ids: int32[S, Lo], tokens generated so far by this sample (all penalties).
    """

    prompt_ids: jax.Array
    output_ids: jax.Array

    @classmethod
    def from_lists(
        cls,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        pad_to: int,
        prompt_len: int,
        output_len: int,
    ) -> TokenHistory:
        """Pad ragged id lists to [pad_to, prompt_len] and [pad_to, output_len] with -1."""
        if len(prompts) != len(outputs):
            raise ValueError(
                f"prompts and outputs must have the same length, got {len(prompts)} "
                f"and {len(outputs)}"
            )
        if pad_to < len(prompts):
            raise ValueError(f"pad_to ({pad_to}) must be at least the number of rows")
        return cls(
            _pad("prompts", prompts, pad_to, prompt_len),
            _pad("outputs", outputs, pad_to, output_len),
        )


def _pad(name: str, rows: Sequence[Sequence[int]], s: int, length: int) -> np.ndarray:
    out = np.full((s, length), -1, np.int32)
    for r, ids in enumerate(rows):
        if len(ids) > length:
            raise ValueError(f"{name}[{r}] has {len(ids)} ids, more than the padded {length}")
        out[r, : len(ids)] = ids
    return out
