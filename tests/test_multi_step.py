"""Multi-step decoding (K iterations in one jitted loop) gives the outputs of K = 1;
warm-up leaves nothing to compile; the host-overhead benchmark runs.

Two engines (prefix caching off / on), each built once with ``warmup="all"``; the K = 1
reference runs on the same engine with the loop disabled (``multi_step.enabled``), so
both paths share one set of compiled programs. A 1-layer variant of tiny-llama keeps
compilation (most of this module's time) short.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedjax.engine.engine_stats import (
    backend_compilations,
    compilations_by_function,
    engine_compilations,
)
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.multi_step import loop_buckets
from pagedjax.engine.warmup import bucket_pairs
from pagedjax.model import preset_arch, random_params
from pagedjax.sampling import SamplingParams
from pagedjax.scheduler import FREE
from pagedjax.tokenizer import ByteTokenizer
from tests.engine_helpers import drain

ARCH = dataclasses.replace(preset_arch("tiny-llama"), num_layers=1)
BLOCK = 4
MAX_LEN = 64
MAX_SEQS = 2  # fewer slots than requests: admissions interleave with loops
BUDGET = 16  # prompts over 16 tokens are chunked
NUM_BLOCKS = 14  # 13 usable (52 tokens): two long sequences must preempt
K = 4


@functools.cache
def _engine(caching: bool) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(
            block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=caching
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS, watermark=0.0, num_multi_steps=K
        ),
        warmup="all",
    )
    params = random_params(ARCH, seed=0, dtype=jnp.float32, std=0.15)
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    # NaN pages: anything read from a slot a sequence does not own poisons its logits.
    engine = LLMEngine(ARCH, params, tok, config, kv_fill_value=float("nan"))
    _WARM[caching] = _per_function(engine)  # right after the warm-up
    return engine


_WARM: dict[bool, dict[str, int]] = {}


def _per_function(engine: LLMEngine) -> dict[str, int]:
    return compilations_by_function(engine.core, engine.multi_step)


def _drain(engine: LLMEngine, arrivals: dict[int, list], max_steps: int = 2000) -> dict:
    """Step until idle, adding (request_id, prompt, params) at their arrival steps."""
    return drain(engine, arrivals, max_steps=max_steps)


def _assert_idle(engine: LLMEngine) -> None:
    assert engine.num_free_blocks() == engine.num_usable_blocks()
    assert len(engine.book.free_slots) == engine.max_seqs and not engine.book.slot_owner
    assert np.all(np.asarray(engine.state.status) == FREE)
    assert not engine.book.queue and not engine.book.requests


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, ARCH.vocab_size, size=n).tolist()


def _run(
    engine: LLMEngine, multi: bool, arrivals: dict, eos: set[int], pipeline: bool = True
) -> dict:
    engine.multi_step.enabled = multi
    engine.multi_step.pipeline = pipeline
    saved, engine.book.eos = engine.book.eos, eos
    try:
        return _drain(engine, arrivals)
    finally:
        engine.book.eos = saved
        engine.multi_step.enabled = engine.multi_step.pipeline = True


def _workload(engine: LLMEngine, seed: int) -> tuple[dict, set[int], dict]:
    """Mixed requests: greedy (with logprobs), seeded sampling (top-p, penalties), n = 2,
    a prompt over the budget (chunked), a 1-token output, a stop token id and an EOS
    hitting mid-output, staggered arrivals. Returns (arrivals, eos set, expected stops)."""
    rng = np.random.default_rng(seed)
    p = {i: _prompt(rng, n) for i, n in enumerate([5, 17, 1, 9, 7, 12, 3, 20])}
    # Probe the greedy outputs of the stop requests (K = 1) to place the stops mid-output.
    probe = _run(engine, False, {0: [("p3", p[3], _greedy(20)), ("p4", p[4], _greedy(20))]}, set())
    stop_id = probe["p3"].outputs[0].token_ids[9]
    eos_id = probe["p4"].outputs[0].token_ids[6]
    sampled = dict(temperature=1.0, ignore_eos=True)
    reqs = {
        0: [
            ("g", p[0], _greedy(22, logprobs=2)),
            ("chunked", p[1], SamplingParams(top_p=0.9, seed=7, max_tokens=13, **sampled)),
            ("one", p[2], _greedy(1)),
        ],
        1: [("stopid", p[3], _greedy(20, stop_token_ids=[stop_id]))],
        2: [("eos", p[4], SamplingParams(temperature=0.0, max_tokens=20))],
        4: [
            ("penalty", p[5], SamplingParams(presence_penalty=0.5, seed=3, max_tokens=25,
                                             **sampled)),
            ("n2", p[6], SamplingParams(n=2, seed=11, max_tokens=10, logprobs=1, **sampled)),
        ],
        # Two long ones together (12 + 11 blocks > 13): one is preempted mid-decode.
        9: [("late", p[7][:10], _greedy(36)), ("late2", p[7][10:18], _greedy(36))],
    }  # fmt: skip
    return reqs, {eos_id}, {"stopid": stop_id, "eos": None}


def _same(a, b) -> None:
    assert set(a) == set(b)
    for rid in a:
        assert len(a[rid].outputs) == len(b[rid].outputs)
        for x, y in zip(a[rid].outputs, b[rid].outputs, strict=True):
            assert x.token_ids == y.token_ids, rid
            assert (x.finish_reason, x.stop_reason, x.text) == (
                y.finish_reason,
                y.stop_reason,
                y.text,
            ), rid
            assert math.isclose(x.cumulative_logprob, y.cumulative_logprob, abs_tol=1e-3), rid
            if x.logprobs is not None:
                assert len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
                for ex, ey in zip(x.logprobs, y.logprobs, strict=True):
                    assert ex.keys() == ey.keys(), rid
                    for t in ex:
                        assert abs(ex[t].logprob - ey[t].logprob) < 1e-4, rid
                        assert ex[t].rank == ey[t].rank, rid


@pytest.mark.tier2  # second tier (docs/testing.md): among the slowest of the default tier
@pytest.mark.parametrize(
    "caching",
    # Without caching: a subset of the cached run's paths; slow (run with -m slow) to keep
    # CI under its time limit.
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["no-prefix-cache", "prefix-cache"],
)
def test_k_steps_equal_one_step(caching: bool):
    engine = _engine(caching)
    arrivals, eos, stops = _workload(engine, seed=1)
    pre0 = engine.num_preemptions
    ref = _run(engine, False, arrivals, eos)
    assert engine.num_preemptions > pre0
    engine.reset_stats()
    pre0 = engine.num_preemptions
    got = _run(engine, True, arrivals, eos)
    _same(ref, got)
    # The stops hit mid-output (and so, with K = 4, inside loops).
    for rid, reason in stops.items():
        o = got[rid].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == reason, (rid, o)
        assert 2 < len(o.token_ids) < 20, (rid, o.token_ids)
    ms = engine.multi_step.stats
    assert ms.iterations >= 2 * ms.loops > 0, ms  # loops ran, mostly several iterations each
    assert ms.exits.get("finish", 0) > 0, ms  # left a loop to admit a queued request
    # A preemption ends a loop (rolled back, then run by the one-step path).
    assert engine.num_preemptions > pre0 and ms.exits.get("shape", 0) + ms.rolled_back > 0, ms
    assert ms.pipelined > 0, ms  # some loops were dispatched before the previous replay
    _assert_idle(engine)
    # Without pipelining: the same outputs again.
    engine.reset_stats()
    _same(ref, _run(engine, True, arrivals, eos, pipeline=False))
    assert engine.multi_step.stats.pipelined == 0 < engine.multi_step.stats.loops
    _assert_idle(engine)


@pytest.mark.tier2  # second tier (docs/testing.md): 40 s cold (own engine)
def test_abort_while_a_loop_is_in_flight():
    """A request aborted while its loop's results are unread: they are dropped, its slot
    is reused at once, the other request's output is unchanged."""
    engine = _engine(False)
    rng = np.random.default_rng(7)
    a, b, c = _prompt(rng, 6), _prompt(rng, 3), _prompt(rng, 4)
    arrivals = {0: [("x", a, _greedy(30)), ("y", b, _greedy(30))]}
    ref = _run(engine, False, arrivals, set())
    alone_c = _run(engine, False, {0: [("z", c, _greedy(8))]}, set())["z"]
    for rid, prompt, params in arrivals[0]:
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(100):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if engine.multi_step._inflight is not None:
            break
    assert engine.multi_step._inflight is not None and not done
    engine.abort_request("x")
    engine.add_request("z", c, _greedy(8))  # takes x's slot while the loop is unread
    got = _drain(engine, {})
    done.update(got)
    assert set(done) == {"y", "z"}
    _same({"y": ref["y"], "z": alone_c}, done)
    _assert_idle(engine)


def test_k_steps_register_prefix_blocks_filled_inside_the_loop():
    """A prompt that is an earlier request's prompt + output hits every full block,
    including those the earlier request completed inside a decode loop."""
    engine = _engine(True)
    rng = np.random.default_rng(5)
    prompt = _prompt(rng, 5)  # unique: 1 full block after prefill
    engine.reset_stats()
    first = _drain(engine, {0: [("a", prompt, _greedy(16))]})["a"].outputs[0].token_ids
    assert engine.multi_step.stats.iterations >= 8  # most of its decode ran in loops
    follow = prompt + first[:14]  # 19 tokens: 4 full blocks, 3 of them filled by decode
    hits0 = engine.stats()["prefix_cache_hit_tokens"]
    _drain(engine, {0: [("b", follow, _greedy(2))]})
    assert engine.stats()["prefix_cache_hit_tokens"] - hits0 == 4 * BLOCK
    _assert_idle(engine)


@pytest.mark.parametrize(
    "caching",
    # Without caching: a subset of the cached run's paths; slow (run with -m slow) to keep
    # CI under its time limit.
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["no-prefix-cache", "prefix-cache"],
)
def test_no_compilation_after_warmup(caching: bool):
    engine = _engine(caching)  # built with warmup="all"
    # Every step program compiled at warm-up (traced, or loaded from the program store).
    assert {(t, s) for t, s, _ in engine.runner.programs} >= set(
        bucket_pairs(engine.token_buckets, engine.seq_buckets, "all")
    )
    assert set(engine.multi_step.trace_count) == set(loop_buckets(engine.seq_buckets))
    # Whatever ran on this engine before (other tests too) compiled nothing new.
    warm, xla_before = _WARM[caching], backend_compilations()[0]
    assert _per_function(engine) == warm
    before = sum(warm.values())
    assert engine.stats()["compilations"] == before > 0
    arrivals, eos, _ = _workload(engine, seed=2)
    _run(engine, True, arrivals, eos)
    engine.add_request("abort-me", [5, 6, 7], _greedy(10))
    engine.step()
    engine.abort_request("abort-me")
    assert _per_function(engine) == warm
    assert engine_compilations(engine.core, engine.multi_step) == before
    assert backend_compilations()[0] == xla_before  # nothing in the process compiled
    assert all(v == 1 for v in engine.runner.trace_count.values())
    assert all(v == 1 for v in engine.multi_step.trace_count.values())
    _assert_idle(engine)


def test_host_overhead_benchmark_tiny():
    """The benchmark's measurement on this module's engine (already compiled)."""
    from pagedjax.tools.host_overhead import copy_bandwidth, measure, roofline_seconds

    engine = _engine(False)
    dev, rows = measure(engine, [1, K], K, num_seqs=2, prompt_len=4, output_len=12, repeats=1)
    assert dev > 0 and set(rows) == {(1, False), (K, False), (K, True)}
    for per_iter, iters, lo, hi in rows.values():
        assert 0 < lo <= per_iter <= hi and iters == 11  # the first token: from the prefill
    # Roofline of one iteration: every weight once, plus 2 sequences' K/V at mean position
    # 4 + 13 / 2 = 10.5 tokens, at 1 GB/s.
    seconds, wbytes, kvbytes = roofline_seconds(engine, 2, 4, 12, 1e9)
    assert wbytes == sum(x.nbytes for x in jax.tree.leaves(engine.params))
    assert kvbytes == int(2 * 10.5 * engine.arch.kv_bytes_per_token(engine.kv_spec.dtype))
    assert seconds == pytest.approx((wbytes + kvbytes) / 1e9)
    assert copy_bandwidth(1 << 20, repeats=2) > 1e8  # any machine copies 100 MB/s
    _assert_idle(engine)


def test_loop_runs_while_a_request_waits_in_a_slot_for_memory():
    """A request holding a slot but not admitted (the pool is full) does not stop the
    loop; once memory frees, the loop exits and the prefill runs one step at a time."""
    engine = _engine(False)
    rng = np.random.default_rng(9)
    a, b = _prompt(rng, 8), _prompt(rng, 40)
    ref = _run(engine, False, {0: [("A", a, _greedy(40)), ("B", b, _greedy(6))]}, set())
    engine.reset_stats()
    engine.add_request("A", a, _greedy(40))
    done: dict = {}

    def step() -> int:
        outs = engine.step()
        done.update({o.request_id: o for o in outs if o.finished})
        return max((len(o.outputs[0].token_ids) for o in outs if o.request_id == "A"), default=0)

    while step() < 32:  # A then holds 40 tokens = 10 of the 13 blocks
        pass
    engine.add_request("B", b, _greedy(6))  # its first chunk needs 4 blocks: it waits
    it0 = engine.multi_step.stats.iterations
    while "A" not in done:
        step()
        assert not engine.book.requests["B"].seqs[0].detok.ids  # B got nothing before A ends
    assert engine.multi_step.stats.iterations - it0 >= 4  # A decoded in loops meanwhile
    done.update(_drain(engine, {}))
    _same(ref, done)
    _assert_idle(engine)


def test_step_observer_sees_every_iteration_fused_or_not():
    """``LLMEngine.add_step_observer``: one ``StepRecord`` per engine iteration, the K-step
    loop's iterations included; with the loop on, the batches are those of K = 1 (the same
    rows, token counts and positions), some of them marked fused."""
    engine = _engine(False)  # no prefix cache: the second run schedules as the first
    rng = np.random.default_rng(3)
    arrivals = {0: [("o0", _prompt(rng, 6), _greedy(12)), ("o1", _prompt(rng, 11), _greedy(12))]}

    def observe(multi: bool) -> list:
        records: list = []
        observer = records.append
        engine.add_step_observer(observer)
        steps0 = engine.num_steps
        try:
            _run(engine, multi, arrivals, set())
        finally:
            engine.step_observers.remove(observer)
        assert len(records) == engine.num_steps - steps0  # every iteration, once
        return records

    one, many = observe(False), observe(True)
    assert not any(r.fused for r in one) and any(r.fused for r in many)

    def batch(r) -> tuple:
        assert len(r.seq_ids) == len(r.q_lens) == len(r.start_pos) == r.num_seqs
        assert int(r.q_lens.sum()) == r.num_tokens and r.wall_s > 0
        return r.num_tokens, sorted(zip(r.q_lens.tolist(), r.start_pos.tolist(), strict=True))

    assert [batch(r) for r in one] == [batch(r) for r in many]
    assert sum(r.num_tokens for r in one) == 6 + 11 + 2 * (12 - 1)  # prompts, then decodes
    _assert_idle(engine)
