"""Sampled drafts (``draft_sample_method="probabilistic"``, engine/spec/draft_sampling.py).

A layer-skip draft (the tiny model's first layer) samples its drafts from its own q at
the request's temperature; the verification applies rejection sampling. The tokens the
engine emits must follow the target's distribution: the plain engine (no speculation)
samples the same requests with other draws of the same distribution, and a two-sample
chi-square test compares the two at each generated position (seeded requests, so the
test is deterministic). The draft's own distribution differs from the target's (one
layer of two), so a verification that kept drafts without the min(1, p/q) rule would
shift the spec engine's tokens towards q (sampling/rejection.py's own test checks the
rule's power on a small vocabulary). Greedy requests keep sample-and-compare: their
outputs equal the plain run's; a seeded sampled request gives the same output alone and
in a batch (its draws depend on (seed, sample, position) only).
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2_contingency

from pagedjax.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.model import preset_arch, random_params
from pagedjax.model.eagle import EagleConfig, init_head, save_head
from pagedjax.model.medusa import MedusaConfig, init_heads, save_heads
from pagedjax.sampling import SamplingParams
from pagedjax.tokenizer import ByteTokenizer
from tests.engine_helpers import drain

ARCH = preset_arch("tiny-llama")  # vocab 512, 2 layers
K = 4  # tests/test_speculative.py's
PROMPT = [5, 17, 99, 3, 250, 17, 99]


@functools.cache
def _params():
    # Larger weights than the other tests: a peaked distribution, so a top-k of a few
    # tokens holds most of the mass and the positions have few outcomes.
    return random_params(ARCH, seed=3, dtype=jnp.float32, std=0.5)


@functools.cache
def _head_dir() -> str:
    """An EAGLE head over a quarter of the vocabulary (q scattered back to V ids)."""
    tmp = tempfile.mkdtemp(prefix="pagedjax_eagle_q_")
    subset = np.sort(np.random.default_rng(5).choice(ARCH.vocab_size, ARCH.vocab_size // 4,
                                                     replace=False)).astype(np.int32)  # fmt: skip
    cfg = EagleConfig.for_target(ARCH, target="tiny-llama")
    cfg = dataclasses.replace(cfg, draft_vocab_size=len(subset))
    save_head(tmp, cfg, init_head(cfg, ARCH, seed=1, std=0.3), draft_vocab=subset)
    return tmp


@functools.cache
def _medusa_dir() -> str:
    """Random Medusa heads (K of them), peaked enough that q differs from p."""
    tmp = tempfile.mkdtemp(prefix="pagedjax_medusa_q_")
    cfg = MedusaConfig.for_target(ARCH, K, 1, target="tiny-llama")
    save_heads(tmp, cfg, init_heads(cfg, seed=2, std=0.3))
    return tmp


def _spec_config(kind: str) -> SpeculativeConfig | None:
    """kind: "plain" (none), "layer_skip" (the first layer), "separate" (the tiny preset's
    own random weights as a separate draft checkpoint), "eagle" (``_head_dir``), "medusa"
    (``_medusa_dir``)."""
    common = dict(num_speculative_tokens=K, draft_sample_method="probabilistic")
    if kind == "layer_skip":
        return SpeculativeConfig(method="draft_model", model="self", draft_num_layers=1,
                                 **common)  # fmt: skip
    if kind == "separate":
        return SpeculativeConfig(method="draft_model", model="tiny-llama", **common)
    if kind == "eagle":
        return SpeculativeConfig(method="eagle", model=_head_dir(), **common)
    if kind == "medusa":
        return SpeculativeConfig(method="medusa", model=_medusa_dir(), **common)
    return None


@functools.cache
def _engine(spec: bool | str) -> LLMEngine:
    """tests/test_speculative.py's geometry (its plain programs come from the persistent
    compilation cache), no warm-up: the tests compile only what they run. spec: True =
    "layer_skip", False = "plain", or a ``_spec_config`` kind."""
    kind = {True: "layer_skip", False: "plain"}.get(spec, spec)
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=64, seed=0),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=24, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, watermark=0.0),
        speculative=_spec_config(kind),
        warmup="none",
    )  # fmt: skip
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    return LLMEngine(ARCH, _params(), tok, config, kv_fill_value=float("nan"))


def _sample(spec: bool | str, seeds, max_tokens: int, **kw) -> list[list[int]]:
    engine = _engine(spec)
    sp = lambda s: SamplingParams(max_tokens=max_tokens, seed=s, ignore_eos=True, **kw)
    got = drain(engine, [(f"s{s}", PROMPT, sp(s)) for s in seeds], max_steps=5000)
    return [got[f"s{s}"].outputs[0].token_ids for s in seeds]


def _same_distribution(a: list[int], b: list[int]) -> float:
    """p-value of a two-sample chi-square test; outcomes rarer than 10 in all pooled."""
    values, counts = np.unique(a + b, return_counts=True)
    common = set(values[counts >= 10].tolist())
    bins = sorted(common) + ["rare"]
    table = np.array([[sum((x if x in common else "rare") == v for x in s) for v in bins]
                      for s in (a, b)])  # fmt: skip
    table = table[:, table.sum(axis=0) > 0]
    return float(chi2_contingency(table)[1])


def _check(n: int, kind: bool | str = True, **kw) -> None:
    seeds = range(n)
    spec = _sample(kind, seeds, 1 + K, **kw)
    plain = _sample(False, range(10_000, 10_000 + n), 1 + K, **kw)
    s = _engine(kind).stats()
    assert s["spec_proposed_tokens"] > 0 and s["spec_accepted_tokens"] > 0
    for pos in range(1, 1 + K):  # position 0 comes from the prefill (no drafts)
        p = _same_distribution([o[pos] for o in spec], [o[pos] for o in plain])
        assert p > 1e-3, (pos, p)
    # Pairs of positions too: the drafts' run is accepted as a whole.
    pairs = lambda outs: [o[1] * 512 + o[2] for o in outs]
    assert _same_distribution(pairs(spec), pairs(plain)) > 1e-3


def test_sampled_drafts_follow_the_targets_distribution():
    _check(64, temperature=1.0, top_k=4)


@pytest.mark.slow  # by hand: more samples, top-p
def test_sampled_drafts_follow_the_targets_distribution_more_samples_top_p():
    _check(400, temperature=0.7, top_p=0.8)


@pytest.mark.tier2  # second tier: two more engines' programs
@pytest.mark.parametrize("kind", ["eagle", "separate", "medusa"])
def test_sampled_drafts_of_eagle_and_a_separate_draft(kind):
    """The EAGLE head (a truncated draft vocabulary: q scattered back to the V ids) and a
    separate draft checkpoint sample their drafts too; same distribution test, and
    greedy requests still equal the plain run."""
    _check(96, kind, temperature=1.0, top_k=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = drain(_engine(False), [("g", PROMPT, greedy)])["g"].outputs[0].token_ids
    assert drain(_engine(kind), [("g", PROMPT, greedy)])["g"].outputs[0].token_ids == ref


@pytest.mark.tier2  # second tier (docs/testing.md): 17 s cold; the distribution test stays
def test_greedy_requests_keep_sample_and_compare_and_seeds_reproduce():
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = drain(_engine(False), [("g", PROMPT, greedy)])["g"].outputs[0].token_ids
    got = drain(_engine(True), [("g", PROMPT, greedy)])["g"].outputs[0].token_ids
    assert got == ref
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    alone = drain(_engine(True), [("a", PROMPT, sp)])["a"].outputs[0].token_ids
    batch = [("b", PROMPT, sp)] + [(f"o{i}", PROMPT[:4], SamplingParams(
        temperature=1.0, max_tokens=6, seed=100 + i, ignore_eos=True)) for i in range(5)]
    together = drain(_engine(True), batch)["b"].outputs[0].token_ids
    assert together == alone
