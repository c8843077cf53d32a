"""User-facing sampling options: vLLM's names, defaults and validation rules.

`SamplingParams` mirrors `vllm.SamplingParams` for the options this engine honours; an
option the engine does not implement is absent rather than silently ignored (passing it
raises TypeError naming it). Both classes are frozen: the engine derives a copy, e.g.
`params.with_seed(s)` when it assigns a seed to an unseeded request at add_request.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
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
    min_tokens: EOS and stop_token_ids are masked until this many tokens are generated.
    logit_bias: {token id: bias in [-100, 100]} added to the logits (OpenAI's rule).
    allowed_token_ids: only these token ids may be sampled (None = all).
    bad_words: words whose token sequences must never be generated (vLLM's rule: the last
        token of a word's encoding is masked when the tokens before it were just produced).
    structured_outputs: a StructuredOutputsParams constraint on the output (None = none).
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
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None

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
        if _check_int("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        put("logit_bias", _normalise_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _normalise_token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not allowed:
                raise ValueError("allowed_token_ids must not be empty")
            put("allowed_token_ids", allowed)
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, str) or not isinstance(words, Sequence):
                raise ValueError(f"bad_words must be a sequence of str, got {words!r}")
            if not all(isinstance(w, str) and w for w in words):
                raise ValueError(f"bad_words must hold non-empty strings, got {words!r}")
            put("bad_words", tuple(words))
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be StructuredOutputsParams, got"
                f" {type(self.structured_outputs).__name__}"
            )

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


def _normalise_token_ids(ids: object, name: str = "stop_token_ids") -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise ValueError(f"{name} must be a sequence of int, got {ids!r}")
    for i in ids:
        if _check_int(name, i) < 0:
            raise ValueError(f"{name} must be non-negative, got {i}")
    return tuple(ids)


# OpenAI's logit_bias range; vLLM clamps to it on the server and we refuse outside it.
MAX_LOGIT_BIAS = 100.0


def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        # The OpenAI API sends token ids as JSON object keys, i.e. strings of digits.
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if _check_int("logit_bias key", token) < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        value = _check_float("logit_bias value", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        out[token] = value
    return out


# The constraint kinds of StructuredOutputsParams: exactly one is set per request.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM 0.32's StructuredOutputsParams).

    Exactly one kind is set: json (a JSON schema, as a dict or its JSON text), regex,
    choice (the output is one of these strings), grammar (EBNF / Lark text),
    json_object=True (any JSON object), structural_tag (xgrammar's structural tag, JSON
    text). Options: disable_any_whitespace (JSON without free whitespace; default False:
    any whitespace, as vLLM), disable_additional_properties (a schema's objects without
    ``additionalProperties`` get ``false``), whitespace_pattern (a regex for JSON
    whitespace; outlines-style backends), disable_fallback (accepted for vLLM scripts;
    the backend rule never falls back silently here). The engine compiles the constraint
    once per request; an invalid one is a ValueError at add_request.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar,"
                f" json_object, structural_tag; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json must be a schema dict or its JSON text, got {self.json!r}")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a str, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice:
                raise ValueError(f"choice must be a non-empty list of str, got {choice!r}")
            if not all(isinstance(c, str) for c in choice):
                raise ValueError(f"choice must hold strings, got {choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        if self.json_object is not None:
            _check_bool("json_object", self.json_object)
        for name in (
            "disable_fallback",
            "disable_any_whitespace",
            "disable_additional_properties",
        ):
            _check_bool(name, getattr(self, name))

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


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
