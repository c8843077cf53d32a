"""The whole engine serves a quantized model (issue 19): prefix caching, n > 1, beam
search, preemption and the K-step decode loop over in-flight NF4 weights, with no
compilation after the warm-up; and LLM(quantization=...)'s refusals."""

from __future__ import annotations

import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.engine.engine_stats import (
    backend_compilations,
    compilations_by_function,
    engine_compilations,
)
from pagedjax.model.quant.weight import QuantizedWeight
from pagedjax.sampling import BeamSearchParams

ARGS = dict(
    max_model_len=64, block_size=4, num_gpu_blocks_override=20, max_num_seqs=2,
    max_num_batched_tokens=16, num_scheduler_steps=4, warmup="all", watermark=0.0,
    enable_prefix_caching=True, seed=0,
    # Swap, so the quantized KV's host copies are covered (recompute works here too
    # since waiting prefix hits give way to running requests, docs/prefix_caching.md).
    preemption_mode="swap",
)  # fmt: skip


def _per_function(engine) -> dict[str, int]:
    return compilations_by_function(engine.core, engine.multi_step)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.tier2  # second tier (docs/testing.md): among the slowest of the default tier
def test_engine_serves_a_quantized_model_with_a_flat_compile_count():
    llm = LLM("tiny-llama", quantization="nf4", **ARGS)
    engine = llm.llm_engine
    for role in ("q_proj", "o_proj"):
        assert isinstance(engine.params["layers"]["self_attn"][role]["kernel"], QuantizedWeight)
    assert isinstance(engine.params["layers"]["mlp"]["down_proj"]["kernel"], QuantizedWeight)
    compiled, xla = engine_compilations(engine.core, engine.multi_step), backend_compilations()[0]
    per_fn = _per_function(engine)

    shared = list(range(3, 23))  # 5 blocks of a shared prefix
    prompts = [shared + [40, 41], shared + [50], list(range(60, 70)), list(range(70, 78))]
    params = [_greedy(n) for n in (8, 8, 40, 40)]
    alone = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params, strict=True)]
    together = llm.generate(prompts, params, use_tqdm=False)
    # Batched, preempted (two rows of 13 blocks > 19) and looped K steps at a time,
    # every greedy output equals the request run alone.
    assert [len(o.outputs[0].token_ids) for o in together] == [8, 8, 40, 40]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert engine.num_preemptions > 0  # swapped out and back in (these runs and the above)
    # The second prompt reused the first's 5 cached prefix blocks (20 tokens).
    assert engine.stats()["prefix_cache_hit_tokens"] >= 20
    assert engine.multi_step.stats.loops > 0
    sampled = llm.generate([shared], SamplingParams(n=2, seed=3, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]  # fmt: skip
    assert len(sampled.outputs) == 2 and all(len(o.token_ids) == 8 for o in sampled.outputs)
    beams = llm.beam_search([shared[:6]], BeamSearchParams(beam_width=2, max_tokens=6,
                                                             ignore_eos=True))[0]  # fmt: skip
    assert [len(b.tokens) for b in beams.sequences] == [12, 12]
    assert beams.sequences[0].score >= beams.sequences[1].score
    assert _per_function(engine) == per_fn
    assert engine_compilations(engine.core, engine.multi_step) == compiled
    # XLA as a whole compiles 3 small programs more here (2 with the swaps, 1 with beam
    # search), exactly as many as the same run on the unquantized model: not the step
    # programs, which are the engine's jits counted above.
    assert backend_compilations()[0] - xla <= 3


def test_llm_quantization_refusals(tmp_path):
    with pytest.raises(ValueError, match="unknown quantization"):
        LLM("tiny-llama", quantization="int3", warmup="none")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with it"):
        LLM("tiny-llama", quantization="awq", warmup="none")
