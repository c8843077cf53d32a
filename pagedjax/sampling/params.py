"""User-facing sampling options: vLLM's names, defaults and validation rules.

`SamplingParams` mirrors `vllm.SamplingParams` for the options this engine honours; an
option the engine does not implement is absent rather than silently ignored (passing it
raises TypeError naming it). Both classes are frozen: the engine derives a copy, e.g.
`params.with_seed(s)` when it assigns a seed to an unseeded request at add_request.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Seeds feed a 32-bit PRNG seed (jax.random.key on a uint32 array).
MAX_SEED = 2**32 - 1


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; `n=True` is almost surely a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    # NaN passes every range comparison below, so reject it explicitly.
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Options for sampling one request (vLLM semantics).

    n: number of output sequences per prompt (each gets its own sample_index).
    temperature: 0 (below SAMPLING_EPS) means greedy; higher is more random.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 = off.
    top_k: keep the k most likely tokens; -1 or 0 = off (stored as 0).
    min_p: drop tokens whose probability is below min_p * the top probability; 0 = off.
    presence_penalty, frequency_penalty: in [-2, 2], over generated tokens only;
        logit -= frequency_penalty * count + presence_penalty * (count > 0).
    repetition_penalty: > 0, over prompt and generated tokens: a seen token's positive
        logit is divided by it, a negative one multiplied by it; 1 = off.
    seed: 0 <= seed < 2**32, or None (the engine then draws one from its own generator
        at add_request, so the request stays reproducible under preemption).
    stop: strings that end the output (stored as a tuple); stop_token_ids likewise.
    ignore_eos: keep generating after the EOS token.
    max_tokens: most tokens to generate; None = up to the model's context length.
    logprobs: number of top logprobs to return per generated token (plus the sampled
        token's own); prompt_logprobs: the same for prompt tokens. None = none.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)  # frozen: normalise in place once

        if _check_int("n", self.n) < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {temperature}")
        put("temperature", temperature)
        top_p = _check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        put("top_p", top_p)
        top_k = 0 if self.top_k is None else _check_int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {top_k}")
        put("top_k", max(top_k, 0))
        min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        put("min_p", min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            put(name, value)
        repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {repetition_penalty}")
        put("repetition_penalty", repetition_penalty)
        if self.seed is not None and not 0 <= _check_int("seed", self.seed) <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        put("stop", _normalise_stop(self.stop))
        put("stop_token_ids", _normalise_token_ids(self.stop_token_ids))
        _check_bool("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and _check_int(name, value) < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    def with_seed(self, seed: int) -> SamplingParams:
        """A copy with `seed` set (validated); how the engine seeds unseeded requests."""
        return dataclasses.replace(self, seed=seed)


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, Sequence) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"stop must be a str or a sequence of str, got {stop!r}")
    if any(s == "" for s in items):
        raise ValueError("stop must not contain an empty string")
    return tuple(items)


def _normalise_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise ValueError(f"stop_token_ids must be a sequence of int, got {ids!r}")
    for i in ids:
        if _check_int("stop_token_ids", i) < 0:
            raise ValueError(f"stop_token_ids must be non-negative, got {i}")
    return tuple(ids)


@dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """Options for ``LLM.beam_search`` (vLLM's BeamSearchParams, plus ``early_stopping``).

    beam_width: beams kept per step (>= 1). max_tokens: most tokens to generate (>= 1).
    ignore_eos: keep EOS out of the search (every hypothesis runs to max_tokens).
    temperature: >= 0; the beams are ranked by log_softmax(logits / temperature)
        (0 = plain log-probs), as vLLM's beam search passes it to the sampler.
    length_penalty: exponent alpha of Hugging Face's score,
        cumulative_logprob / generated_len ** alpha (generated_len counts an EOS token).
    early_stopping: Hugging Face's rule for ending the search (extension; vLLM has no
        such option): True stops as soon as beam_width hypotheses are finished; False
        (HF's default) stops when the best running beam, scored at its current length,
        cannot beat the worst finished one; "never" scores it at max length when
        length_penalty > 0 (the canonical rule).

    Scoring follows Hugging Face ``generate(num_beams=..., do_sample=False)``, not vLLM's
    own beam search: vLLM divides by the length of prompt + output (minus a final EOS),
    keeps every EOS hypothesis and always runs max_tokens steps. See docs/engine.md.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if _check_int("beam_width", self.beam_width) < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_bool("ignore_eos", self.ignore_eos)
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {temperature}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(
            self, "length_penalty", _check_float("length_penalty", self.length_penalty)
        )
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
