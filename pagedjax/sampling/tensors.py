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

    @classmethod
    def from_params(
        cls, rows: Sequence[tuple[SamplingParams, int, int]], pad_to: int
    ) -> SamplingTensors:
        """Build the arrays from (params, sample_index, output_position) per row.

        Rows beyond len(rows) up to pad_to are neutral greedy padding. A sampled
        (non-greedy) row must have a seed: the engine assigns one at add_request.
        Returns numpy arrays (jit transfers them; no device placement here).
        """
        if pad_to < len(rows):
            raise ValueError(f"pad_to ({pad_to}) must be at least the number of rows ({len(rows)})")
        t = _neutral(pad_to)
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
        return cls(**t)


def _neutral(s: int) -> dict[str, np.ndarray]:
    f32, i32 = np.float32, np.int32
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
    )


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
