"""Pipeline parallelism (pagedjax/model/pipeline.py, docs/parallelism.md).

In process: the stage split (vLLM's rule, as properties, with Hypothesis), the partition's
checks and its environment variable, the refusals, the micro-batch ranges
(``pipeline_microbatches``; Hypothesis). In a subprocess with 8 host CPU
devices (``tests/pipeline_cases.py`` says what each case asserts): the pipelined model
function equals one device's and each device holds 1 / PP of the bytes (default tier), and
engines at PP 2, PP 4, PP 2 x TP 2, an uneven split and the K-step loop equal one device
over the mixed workload, and PP 2 with 2 micro-batches (second tier and slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig
from pagedjax.model.pipeline import (
    microbatch_input,
    microbatch_ranges,
    parse_partition,
    stage_layer_ranges,
    token_slots,
)
from tests.engine_helpers import xla_flags_with_devices

ROOT = Path(__file__).resolve().parents[1]


def _cases(*names: str, timeout: float = 900) -> dict[str, dict]:
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(8),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "pipeline_cases.py"), *names],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in rows}


# ------------------------------------------------------------------ the stage split


@settings(max_examples=50, deadline=None)
@given(layers=st.integers(1, 200), pp=st.integers(1, 16))
def test_default_split_is_vllms_rule(layers: int, pp: int):
    """vLLM's get_pp_indices: L // PP layers per stage, the remainder r one layer each on
    the r stages just before the last (the last stage runs the final norm and head; the
    first the embedding), contiguous, covering every layer once."""
    if layers < pp:
        with pytest.raises(ValueError, match=f"pipeline_parallel_size={pp} exceeds"):
            stage_layer_ranges(layers, pp)
        return
    ranges = stage_layer_ranges(layers, pp)
    sizes = [b - a for a, b in ranges]
    assert len(ranges) == pp and ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(pp - 1))
    base, r = divmod(layers, pp)
    bigger = [i for i, n in enumerate(sizes) if n == base + 1]
    assert sorted(set(sizes)) == sorted({base, base + 1} if r else {base})
    assert bigger == list(range(pp - 1 - r, pp - 1))  # just before the last stage
    assert sizes[-1] == base


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_explicit_partition_is_kept(sizes: list[int]):
    ranges = stage_layer_ranges(sum(sizes), len(sizes), sizes)
    assert [b - a for a, b in ranges] == sizes
    assert ranges[0][0] == 0
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(sizes) - 1))


def test_examples_and_refusals():
    assert stage_layer_ranges(3, 2) == ((0, 2), (2, 3))  # the brief's "2,1"
    assert stage_layer_ranges(10, 4) == ((0, 2), (2, 5), (5, 8), (8, 10))  # 2,3,3,2
    with pytest.raises(ValueError, match=r"has 3 stages, not pipeline_parallel_size=2"):
        stage_layer_ranges(4, 2, (1, 1, 2))
    with pytest.raises(ValueError, match="sums to 3, not the model's 4 layers"):
        stage_layer_ranges(4, 2, (1, 2))
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layer_ranges(4, 2, (0, 4))
    with pytest.raises(ValueError, match="must be >= 1"):
        stage_layer_ranges(4, 0)
    assert parse_partition("2,1") == (2, 1) and parse_partition(None) is None
    with pytest.raises(ValueError, match="PAGEDJAX_PP_LAYER_PARTITION='2;1'"):
        parse_partition("2;1")
    with pytest.raises(ConfigError, match="pipeline_layer_partition"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_layer_partition=(3,))


def test_env_partition_reaches_the_config(monkeypatch):
    from pagedjax.entrypoints.llm import engine_config

    monkeypatch.setenv("PAGEDJAX_PP_LAYER_PARTITION", "1,3")
    par = engine_config("tiny-llama-tp", pipeline_parallel_size=2).parallel
    assert (par.pipeline_parallel_size, par.pipeline_layer_partition) == (2, (1, 3))
    assert engine_config("tiny-llama-tp").parallel.pipeline_layer_partition is None  # PP 1


def test_unbuilt_combinations_are_refused_by_name():
    from pagedjax.config import LoRAConfig, SpeculativeConfig
    from pagedjax.engine.unbuilt import reject_unbuilt_pipeline

    base = EngineConfig(model=ModelConfig(model="tiny-llama-tp"),
                        parallel=ParallelConfig(pipeline_parallel_size=2))  # fmt: skip
    reject_unbuilt_pipeline(base)  # PP alone: fine
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    for cfg, name in (
        (EngineConfig(model=base.model, parallel=base.parallel, speculative=spec),
         "speculative_config"),
        (EngineConfig(model=base.model, parallel=base.parallel, lora=LoRAConfig()),
         "enable_lora"),
        (EngineConfig(model=base.model, parallel=ParallelConfig(
            pipeline_parallel_size=2, data_parallel_size=2)), "data_parallel_size=2"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name} with pipeline_parallel_size=2: not built"):
            reject_unbuilt_pipeline(cfg)


def test_llm_counts_the_stages_devices_before_loading():
    from pagedjax import LLM

    with pytest.raises(ValueError, match=r"x pipeline_parallel_size=2 needs 2 devices"):
        LLM("no-such-model", pipeline_parallel_size=2)


# ------------------------------------------------------------------ simulated devices


def test_pp2_forward_equals_one_device_and_splits_the_bytes():
    """The model function at PP 2 (4 layers, 2 per stage) on 2 simulated devices: logits
    and every layer's KV pages equal one device's over a prefill and a decode step; each
    device holds half the layers' weights and pool (addressable shards), about 1 / 2 of
    one device's bytes."""
    out = _cases("forward-pp2")["forward-pp2"]
    assert out["max_logit_diff"] < 1e-5
    assert abs(out["ratio"] - 0.5) < 0.01


@pytest.mark.slow  # ~50 s at load 8: three subprocess cases of two compilations each
def test_pp_forward_other_families_and_pp4():
    """The model function of OPT (learned positions, replicated) and GPT-NeoX (parallel
    residual, partial rotary) at PP 2, and the Llama at PP 4, equal one device's logits
    and KV pages; bytes per device as the case counts them."""
    out = _cases("forward-pp2-opt", "forward-pp2-gpt_neox", "forward-pp4")
    assert all(c["max_logit_diff"] < 1e-5 for c in out.values())
    assert abs(out["forward-pp4"]["ratio"] - 0.25) < 0.01


@pytest.mark.tier2
def test_pp2_tp2_and_microbatched_pp2_engines_equal_one_device():
    """The mixed workload (chunked prefill, decode, preemption by recompute and swap, a
    prefix hit, n = 2 seeded samples, beam search) at PP 2 x TP 2 on 4 devices (the
    attention's shard_map nested in the stage's) equals one device token for token; each
    device holds 1 / 4 of the pool (2 stages x 2 KV-head shards). And at PP 2 with
    pipeline_microbatches=2 (the same subprocess and one-device reference): equal too
    (every step as two micro-batches, prefill chunks cut between them). 34 s cold at load
    3 (the micro-batched engine: ~12 s of it), 9 s with a warm compilation cache."""
    out = _cases("engine-pp2-tp2", "engine-pp2-mb2")
    case = out["engine-pp2-tp2"]
    assert case["kv_per_device"] * 4 == case["kv_total"]
    assert case["ranges"] == [[0, 2], [2, 4]]
    assert out["engine-pp2-mb2"]["microbatches"] == 2


@pytest.mark.slow  # 281 s at load 9 on the 2-core box: one reference and one engine each
def test_pp2_pp4_uneven_and_kstep_engines_equal_one_device():
    """The same workload at PP 2, PP 4, PP 2 over 3 layers (vLLM's default 2,1 and an
    explicit 1,2 partition) and PP 2 under the fused K-step decode loop (K = 4) equals
    one device; KV bytes per device 1 / PP of the pool, parameters shrink with PP."""
    out = _cases("engine-pp2", "engine-pp4", "engine-pp2-layers3",
                 "engine-pp2-layers3-part1_2", "engine-pp2-k4", timeout=1800)  # fmt: skip
    for pp in (2, 4):
        case = out[f"engine-pp{pp}"]
        assert case["kv_per_device"] * pp == case["kv_total"]
    assert out["engine-pp4"]["params_per_device"] < out["engine-pp2"]["params_per_device"]
    assert out["engine-pp2-layers3"]["ranges"] == [[0, 2], [2, 3]]
    assert out["engine-pp2-layers3-part1_2"]["ranges"] == [[0, 1], [1, 3]]
    assert out["engine-pp2-k4"]["multi_step_loops"] > 0  # the fused loop ran under PP


@pytest.mark.slow  # each case ran by hand in 4-31 s at load 2-5 on the 2-core box
def test_microbatches_other_families_pp4_tp2_and_kstep_equal_one_device():
    """pipeline_microbatches beyond the tier2 case: the model function of OPT and GPT-NeoX
    at PP 2 with 2 micro-batches (the prefill's 5-token sequence cut 4 + 1); engines at
    PP 4 with 4 micro-batches, PP 2 x TP 2 with 2, and PP 2 with 2 under the K-step loop
    (K = 4) equal one device over the mixed workload."""
    out = _cases("forward-pp2-opt-mb2", "forward-pp2-gpt_neox-mb2", "engine-pp4-mb4",
                 "engine-pp2-tp2-mb2", "engine-pp2-mb2-k4", timeout=1800)  # fmt: skip
    for name, case in out.items():
        if name.startswith("forward"):
            assert case["max_logit_diff"] < 1e-5
        else:
            assert case["microbatches"] == int(name.split("mb")[1][0]), name
    assert out["engine-pp2-mb2-k4"]["multi_step_loops"] > 0


# ------------------------------------------------------------------ micro-batches


@settings(max_examples=200, deadline=None)
@given(q=st.lists(st.integers(0, 40), min_size=1, max_size=24), groups=st.integers(1, 6),
       slack=st.integers(0, 64))  # fmt: skip
def test_microbatch_ranges_cover_every_token_once_within_slots(q, groups, slack):
    """The micro-batches' token ranges are consecutive, cover the step's tokens once,
    each within its slots, all but the last full; a micro-batch's rows are exactly the
    sequences with a token in its range, and the parts of each sequence add up to its
    q_len (a chunk cut between consecutive micro-batches, never lost or repeated)."""
    cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    total = int(cu[-1])
    slots = token_slots(total + slack, groups)
    start, end, first, last = microbatch_ranges(cu, groups, slots)
    assert start[0] == 0 and end[-1] == total and np.all(start[1:] == end[:-1])
    assert np.all(end - start <= slots)
    full = np.flatnonzero(end - start < slots)
    assert full.size == 0 or np.all(end[full[0]:] == total)  # only the tail is short
    parts = np.zeros(len(q), np.int64)
    for g in range(groups):
        lo, hi = int(start[g]), int(end[g])
        rows = [i for i in range(len(q)) if q[i] and cu[i] < hi and cu[i + 1] > lo]
        got = list(range(int(first[g]), int(last[g])))
        assert [i for i in got if q[i] > 0] == rows  # empty rows inside a range: harmless
        for i in rows:
            parts[i] += min(cu[i + 1], hi) - max(cu[i], lo)
    assert parts.tolist() == q


def test_microbatch_input_reassembles_the_batch():
    """The micro-batches' own arrays (jnp, as in the step) cover the step once: their
    tokens concatenated are the step's; a sequence cut between two micro-batches has its
    query tokens split and its context grow (kv_len of the first part = the context up
    to the cut); padding writes nowhere (PAD_SLOT) and covers no query."""
    import jax.numpy as jnp

    from pagedjax.attention import PAD_SLOT
    from pagedjax.model import ModelInput

    q = [3, 1, 2, 1, 0]  # 4 sequences and a padding row; 7 of 10 token slots used
    cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    t = 10
    batch = ModelInput(tokens=jnp.arange(100, 100 + t), positions=jnp.arange(t),
                       slot_mapping=jnp.arange(20, 20 + t),
                       block_tables=jnp.arange(10).reshape(5, 2),
                       kv_lens=jnp.asarray([9, 8, 7, 6, 0]), cu_q_lens=jnp.asarray(cu),
                       logits_indices=jnp.asarray(cu[1:] - 1))  # fmt: skip
    slots = token_slots(t, 2)  # 5: tokens 0-4 | 5-6, sequence 2 (tokens 4, 5) cut 1 + 1
    ranges = microbatch_ranges(batch.cu_q_lens, 2, slots, xp=jnp)
    assert [np.asarray(r).tolist() for r in ranges] == [[0, 5], [5, 7], [0, 2], [3, 4]]
    subs = [microbatch_input(batch, *(r[g] for r in ranges), slots) for g in range(2)]
    assert [np.asarray(s.cu_q_lens).tolist() for s in subs] == [[0, 3, 4, 5, 5, 5],
                                                                [0, 1, 2, 2, 2, 2]]
    assert [np.asarray(s.kv_lens).tolist() for s in subs] == [[9, 8, 6, 0, 0], [7, 6, 0, 0, 0]]
    assert np.asarray(subs[1].block_tables[0]).tolist() == [4, 5]  # sequence 2's pages
    toks = [int(x) for s, n in zip(subs, (5, 2), strict=True) for x in s.tokens[:n]]
    assert toks == list(range(100, 107))
    assert np.all(np.asarray(subs[1].slot_mapping[2:]) == PAD_SLOT)
    assert subs[0].tokens.shape == (slots,) and subs[0].block_tables.shape == (5, 2)


def test_microbatches_are_refused_without_stages():
    with pytest.raises(ConfigError, match="pipeline_microbatches.*needs pipeline_parallel_size"):
        ParallelConfig(pipeline_microbatches=2)
    with pytest.raises(ConfigError, match="pipeline_microbatches"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_microbatches=0)
    from pagedjax.entrypoints.llm import engine_config
    from pagedjax.entrypoints.openai.cli_args import llm_kwargs, make_parser

    args = make_parser().parse_args(["--model", "tiny-llama-tp", "-pp", "2",
                                     "--pipeline-microbatches", "2"])  # fmt: skip
    par = engine_config(**llm_kwargs(args)).parallel
    assert (par.pipeline_parallel_size, par.pipeline_microbatches) == (2, 2)


def test_simulator_prices_stages_transfers_and_the_bubble():
    """PP 1 is the roofline itself; PP 2 runs half the layers per stage (plus the head,
    so more than half the time), sends [tokens, hidden] once per hop at the link's
    bandwidth, and idles half the time with one batch in flight, none with two."""
    from pagedjax.simulator.cost_model import roofline
    from pagedjax.simulator.pipeline import pipeline_step, stage_layers

    cost = roofline("H100-80GB", "llama-3-70b", tp=4)
    work = (0, 64, 64 * 1024)  # 64 decoding sequences of 1,024-token contexts
    one = pipeline_step(cost, 1, *work)
    assert one.latency() == pytest.approx(float(cost(*work)), rel=1e-6)
    # the host's per-sequence cost is paid once per step, not once per stage
    host = roofline("H100-80GB", "llama-3-70b", tp=4, seq_overhead_s=1e-4)
    assert pipeline_step(host, 1, *work).latency() == pytest.approx(float(host(*work)), rel=1e-6)
    extra = pipeline_step(host, 2, *work).latency() - pipeline_step(cost, 2, *work).latency()
    assert extra == pytest.approx(64 * 1e-4, rel=1e-3)
    two = pipeline_step(cost, 2, *work, link="internode")
    assert one.stage_s / 2 < two.stage_s < one.stage_s
    assert two.transfer_s == pytest.approx(64 * 8192 * 2 / (0.7 * 50e9) + 30e-6)
    assert two.latency() == pytest.approx(2 * two.stage_s + two.transfer_s + 2e-3)
    assert (two.bubble(1), two.bubble(2)) == (0.5, 0.0)
    assert two.throughput_steps_per_s(2) > two.throughput_steps_per_s(1)
    assert stage_layers(80, 3) == 27
    with pytest.raises(ValueError, match="in_flight"):
        two.bubble(3)


def test_simulator_prices_microbatches_as_built():
    """pagedjax's micro-batches (M per step, drained every step): M = 1 is the one-batch
    step; M = 2 at PP 2 runs 3 ticks of half the work, bubble 1 / 3. A compute-bound
    prefill step gets faster; a decode step, bound by reading the stage's weights, which
    every micro-batch reads again, gets slower (3 weight reads per stage instead of 2)."""
    from pagedjax.simulator.cost_model import roofline
    from pagedjax.simulator.pipeline import microbatch_step, pipeline_step

    cost = roofline("H100-80GB", "llama-3-70b", tp=4)
    prefill, decode = (2048, 0, 2048), (0, 256, 256 * 1024)
    for work in (prefill, decode):
        one = microbatch_step(cost, 2, 1, *work)
        assert one.latency() == pytest.approx(pipeline_step(cost, 2, *work).latency())
    two = microbatch_step(cost, 2, 2, *prefill)
    assert two.ticks == 3 and two.bubble() == pytest.approx(1 / 3)
    assert two.latency() < 0.8 * microbatch_step(cost, 2, 1, *prefill).latency()
    assert microbatch_step(cost, 2, 2, *decode).latency() > microbatch_step(
        cost, 2, 1, *decode).latency()  # fmt: skip
    with pytest.raises(ValueError, match="microbatches"):
        microbatch_step(cost, 2, 0, *prefill)
