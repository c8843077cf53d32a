"""Validation and normalisation of SamplingParams and BeamSearchParams."""

import dataclasses
import math

import pytest

from pagedjax.sampling import BeamSearchParams, SamplingParams, StructuredOutputsParams

INVALID_SAMPLING = [
    ("n", 0, "n must be at least 1"),
    ("n", 1.5, "n must be an int"),
    ("n", True, "n must be an int"),
    ("temperature", -0.1, "temperature must be non-negative"),
    ("temperature", math.nan, "temperature must be finite"),
    ("temperature", math.inf, "temperature must be finite"),
    ("temperature", "hot", "temperature must be a number"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.01, r"top_p must be in \(0, 1\]"),
    ("top_p", math.nan, "top_p must be finite"),
    ("top_k", -2, "top_k must be -1 or 0"),
    ("top_k", 2.0, "top_k must be an int"),
    ("min_p", -0.01, r"min_p must be in \[0, 1\]"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
    ("presence_penalty", -2.01, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", math.nan, "frequency_penalty must be finite"),
    ("repetition_penalty", 0.0, "repetition_penalty must be positive"),
    ("repetition_penalty", -1.0, "repetition_penalty must be positive"),
    ("seed", -1, r"seed must be in \[0, 2\*\*32\)"),
    ("seed", 2**32, r"seed must be in \[0, 2\*\*32\)"),
    ("seed", 1.0, "seed must be an int"),
    ("stop", "", "stop must not contain an empty string"),
    ("stop", ["a", ""], "stop must not contain an empty string"),
    ("stop", [1], "stop must be a str or a sequence of str"),
    ("stop_token_ids", [-1], "stop_token_ids must be non-negative"),
    ("stop_token_ids", 7, "stop_token_ids must be a sequence of int"),
    ("stop_token_ids", [1.0], "stop_token_ids must be an int"),
    ("ignore_eos", 1, "ignore_eos must be a bool"),
    ("max_tokens", 0, "max_tokens must be at least 1"),
    ("max_tokens", 2.0, "max_tokens must be an int"),
    ("logprobs", -1, "logprobs must be non-negative"),
    ("prompt_logprobs", -1, "prompt_logprobs must be non-negative"),
    ("min_tokens", -1, "min_tokens must be non-negative"),
    ("min_tokens", 17, r"min_tokens \(17\) must be at most max_tokens"),
    ("logit_bias", {5: 101.0}, r"logit_bias values must be in \[-100, 100\]"),
    ("logit_bias", {-1: 1.0}, "logit_bias keys must be non-negative"),
    ("logit_bias", [1, 2], "logit_bias must be a mapping"),
    ("logit_bias", {1: math.nan}, "logit_bias value must be finite"),
    ("allowed_token_ids", [], "allowed_token_ids must not be empty"),
    ("allowed_token_ids", [-3], "allowed_token_ids must be non-negative"),
    ("bad_words", "word", "bad_words must be a sequence of str"),
    ("bad_words", [""], "bad_words must hold non-empty strings"),
    ("structured_outputs", {"json": {}}, "structured_outputs must be StructuredOutputsParams"),
]


@pytest.mark.parametrize(("name", "value", "message"), INVALID_SAMPLING)
def test_invalid_sampling_params(name: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{name: value})


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, (), (), False)
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs) == (16, None, None)
    assert not p.greedy


def test_normalisation() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=None).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[2, 3]).stop_token_ids == (2, 3)
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    # Edges of the valid ranges are accepted.
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, seed=2**32 - 1)


def test_unknown_keyword_names_it() -> None:
    with pytest.raises(TypeError, match="best_off"):
        SamplingParams(best_off=2)


def test_frozen_and_with_seed() -> None:
    p = SamplingParams(temperature=0.7, stop="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.seed = 3  # type: ignore[misc]
    q = p.with_seed(3)
    assert (q.seed, q.temperature, q.stop, p.seed) == (3, 0.7, ("x",), None)
    with pytest.raises(ValueError, match="seed"):
        p.with_seed(-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(beam_width=0, max_tokens=4), "beam_width must be at least 1"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be at least 1"),
        (dict(beam_width=2.0, max_tokens=4), "beam_width must be an int"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be non-negative"),
        (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty must be"),
        (dict(beam_width=2, max_tokens=4, ignore_eos="no"), "ignore_eos must be a bool"),
    ],
)
def test_invalid_beam_search_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_beam_search_defaults() -> None:
    b = BeamSearchParams(beam_width=4, max_tokens=8)
    assert (b.ignore_eos, b.temperature, b.length_penalty) == (False, 0.0, 1.0)
    with pytest.raises(TypeError, match="beam_witdh"):
        BeamSearchParams(beam_witdh=4, max_tokens=8)


def test_logit_controls_normalised() -> None:
    p = SamplingParams(logit_bias={"7": 2, 3: -1.5}, allowed_token_ids=[4, 5], bad_words=["x"])
    assert p.logit_bias == {7: 2.0, 3: -1.5}
    assert (p.allowed_token_ids, p.bad_words, p.min_tokens) == ((4, 5), ("x",), 0)


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        (dict(json={"type": "object"}), "json"),
        (dict(json='{"type": "string"}'), "json"),
        (dict(regex="[a-z]+"), "regex"),
        (dict(choice=["yes", "no"]), "choice"),
        (dict(grammar='root ::= "a"'), "grammar"),
        (dict(json_object=True), "json_object"),
        (dict(structural_tag="{}"), "structural_tag"),
    ],
)
def test_structured_outputs_one_kind(kwargs: dict, kind: str) -> None:
    s = StructuredOutputsParams(**kwargs)
    assert s.kind == kind
    assert SamplingParams(structured_outputs=s).structured_outputs is s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "exactly one of"),
        (dict(json_object=False), "exactly one of"),
        (dict(regex="a", choice=["a"]), "exactly one of"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice="ab"), "choice must be a non-empty list"),
        (dict(choice=["a", 1]), "choice must hold strings"),
        (dict(json=3), "json must be a schema dict"),
        (dict(regex=5), "regex must be a str"),
        (dict(regex="a", disable_any_whitespace=1), "disable_any_whitespace must be a bool"),
    ],
)
def test_invalid_structured_outputs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)
