"""min_tokens, logit_bias, allowed_token_ids and bad_words (issue 33, item 6): the
sampler's masks and bias against a plain-numpy reference, and the engine's host half
(pagedjax/engine/logit_controls.py) on a tiny random model."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.logit_controls import bad_words_token_ids, clear_bits, token_mask
from pagedjax.model import preset_arch, random_params
from pagedjax.sampling import SamplingParams, SamplingTensors, sample
from pagedjax.sampling.tensors import MAX_LOGIT_BIAS_ENTRIES, pack_token_ids
from pagedjax.tokenizer import ByteTokenizer
from tests.engine_helpers import drain

V = 70  # not a multiple of 32: the last mask word is partial


def _unpack(mask: np.ndarray, v: int) -> np.ndarray:
    return np.unpackbits(mask.view(np.uint8), bitorder="little")[:v].astype(bool)


def test_pack_token_ids_round_trip() -> None:
    ids = [0, 1, 31, 32, 63, 64, 69]
    m = pack_token_ids(ids, V)
    assert m.dtype == np.int32 and m.shape == (3,)
    assert np.flatnonzero(_unpack(m, V)).tolist() == ids
    clear_bits(m, [31, 64])
    assert np.flatnonzero(_unpack(m, V)).tolist() == [0, 1, 32, 63, 69]


def _reference(logits: np.ndarray, grammar: np.ndarray, tokens: np.ndarray,
               bias: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(raw logprobs, processed logits) of one row in vLLM's order: grammar mask, then
    raw logprobs; allowed / bad words / min_tokens mask, then logit_bias."""
    x = np.where(grammar, logits, -np.inf)
    raw = x - np.log(np.sum(np.exp(x - x.max()))) - x.max()
    y = np.where(tokens, x, -np.inf)
    for t, b in bias.items():
        y[t] += b
    return raw, y


def test_sampler_masks_and_bias_match_numpy() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    rows = [
        (SamplingParams(temperature=0.0), 0, 0),
        (SamplingParams(temperature=0.0, allowed_token_ids=[3, 40, 69]), 0, 0),
        (SamplingParams(temperature=0.0, logit_bias={5: 100.0, 7: -3.0}), 0, 0),
        (SamplingParams(temperature=0.0, logit_bias={33: 2.5}), 0, 0),
    ]
    t = SamplingTensors.from_params(rows, 4, vocab_size=V)
    grammar = np.ones((4, V), bool)
    grammar[3, rng.choice(V, 50, replace=False)] = False  # a grammar row
    tokens = _unpack(t.token_mask[1], V)
    gm = t.grammar_mask.copy()
    gm[3] = pack_token_ids(np.flatnonzero(grammar[3]), V)
    extra = np.ones((4, V), bool)
    extra[0, [int(np.argmax(logits[0]))]] = False  # a bad-word / min_tokens style mask
    tm = t.token_mask.copy()
    tm[0] = pack_token_ids(np.flatnonzero(extra[0]), V)
    t = t._replace(grammar_mask=gm, token_mask=tm)
    out = sample(jnp.asarray(logits), t, max_logprobs=5)
    masks = [extra[0], tokens, np.ones(V, bool), np.ones(V, bool)]
    biases = [{}, {}, {5: 100.0, 7: -3.0}, {33: 2.5}]
    for r in range(4):
        raw, y = _reference(logits[r], grammar[r], masks[r], biases[r])
        assert int(out.token_ids[r]) == int(np.argmax(y)), r
        np.testing.assert_allclose(float(out.logprobs[r]), raw[int(out.token_ids[r])], rtol=1e-5)
    assert int(out.token_ids[2]) == 5  # the +100 bias wins
    assert int(out.token_ids[1]) in (3, 40, 69)


def test_sampled_rows_never_leave_the_mask() -> None:
    rows = [(SamplingParams(temperature=1.5, seed=i, allowed_token_ids=[2, 9, 65]), 0, i)
            for i in range(8)]  # fmt: skip
    t = SamplingTensors.from_params(rows, 8, vocab_size=V)
    out = sample(jnp.zeros((8, V), jnp.float32), t)
    assert set(np.asarray(out.token_ids).tolist()) <= {2, 9, 65}


def test_static_controls_need_a_vocabulary() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingTensors.from_params([(_greedy(allowed_token_ids=[1]), 0, 0)], 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingTensors.from_params([(_greedy(logit_bias={V: 1.0}), 0, 0)], 1, V)


def test_bad_words_token_ids_follow_vllm() -> None:
    class Words:  # "a b" is one token per word, " x" a token of its own
        vocab = {"ab": [1], " ab": [2], "cd": [3, 4], " cd": [5, 6, 7]}

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert not add_special_tokens
            return self.vocab[text]

    # " ab" starts with another token and has the same length: added; " cd" is longer.
    assert bad_words_token_ids(Words(), ["ab", " cd"], 10) == [[1], [2], [3, 4]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad_words_token_ids(Words(), ["cd"], 4)


class _Seq:
    def __init__(self, params: SamplingParams, out: list[int]):
        self.params = params
        self.detok = type("D", (), {"ids": out})()


class _Req:
    def __init__(self, words: list[list[int]]):
        self.bad_words_ids = words


class _Book:
    def stop_ids(self, seq):
        return {2, 11} - (set() if not seq.params.ignore_eos else {2})


def test_token_mask_min_tokens_and_bad_words() -> None:
    p = SamplingParams(min_tokens=2, stop_token_ids=[11])
    allowed = lambda m: set(np.flatnonzero(_unpack(m, 20)).tolist())  # noqa: E731
    m = token_mask(_Book(), _Req([[5], [7, 8, 9]]), _Seq(p, [1]), 20)
    assert allowed(m) == set(range(20)) - {2, 11, 5}  # stops before min_tokens; 1-token word
    m = token_mask(_Book(), _Req([[5], [7, 8, 9]]), _Seq(p, [1, 7, 8]), 20)
    assert allowed(m) == set(range(20)) - {5, 9}  # min reached; "7 8" just generated
    m = token_mask(_Book(), _Req([[7, 8, 9]]), _Seq(p, [8, 7]), 20)
    assert allowed(m) == set(range(20))


ARCH = preset_arch("tiny-llama")  # vocab 512, EOS 2
EOS = ARCH.eos_token_id


@functools.cache
def _engine() -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=64, seed=0),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=64, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, watermark=0.0),
    )
    tok = ByteTokenizer(eos_token_id=EOS, bos_token_id=ARCH.bos_token_id)
    return LLMEngine(ARCH, random_params(ARCH, seed=0, dtype=jnp.float32, std=0.15), tok, config)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_engine_applies_each_control() -> None:
    engine = _engine()
    plain = drain(engine, [("plain", "hello", _greedy(max_tokens=8, ignore_eos=True))])
    reqs = [
        # EOS pushed to the top: it may end the output only from token min_tokens + 1.
        ("min", "hello", _greedy(max_tokens=12, min_tokens=5, logit_bias={EOS: 100.0})),
        ("allowed", "hello", _greedy(max_tokens=8, allowed_token_ids=[65, 66, 67])),
        ("bias", "hello", _greedy(max_tokens=6, logit_bias={90: 100.0})),
        # "ZZ" is a bad word: Z (90) is the top token, never twice in a row.
        ("bad", "hello", _greedy(max_tokens=10, logit_bias={90: 100.0}, bad_words=["ZZ"])),
        ("plain", "hello", _greedy(max_tokens=8, ignore_eos=True)),
    ]
    out = {k: v.outputs[0] for k, v in drain(engine, reqs).items()}
    assert out["min"].token_ids == out["min"].token_ids[:5] + [EOS]
    assert EOS not in out["min"].token_ids[:5] and out["min"].finish_reason == "stop"
    assert set(out["allowed"].token_ids) <= {65, 66, 67}
    assert out["bias"].token_ids == [90] * 6
    ids = out["bad"].token_ids
    assert ids[0] == 90 and all(not (a == b == 90) for a, b in zip(ids, ids[1:], strict=False))
    assert ids[::2] == [90] * 5  # Z again as soon as the word is broken
    # A row's controls change no other row (the mask is per slot).
    assert out["plain"].token_ids == plain["plain"].outputs[0].token_ids


def test_engine_refuses_bad_controls_before_any_state() -> None:
    engine = _engine()
    for params, match in (
        (SamplingParams(allowed_token_ids=[512]), "allowed_token_ids has token ids"),
        (SamplingParams(logit_bias={600: 1.0}), "logit_bias has token ids"),
        (SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}),
         "at most 300"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            engine.add_request("r", "x", params)
        assert not engine.has_unfinished_requests()
