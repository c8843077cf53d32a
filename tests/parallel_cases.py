"""Multi-device cases, run as a script in a subprocess that sees 8 host CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``; tests/test_parallel.py).

``python tests/parallel_cases.py CASE [CASE ...]`` runs each case, asserts inside it, and
prints one JSON line ``{"case": ..., ...facts}`` per case for the test to check further.
The device count must be fixed before JAX starts, hence a subprocess: the test process
itself has already initialized JAX with one device.

Cases (``tp<N>-<model>[-<backend>]`` and ``dp``; ``memory-tp<N>-<model>`` builds the
engine only and reports its bytes per device): greedy and seeded
outputs of a mixed workload at TP N equal the single-device outputs of the same engine
configuration; the workload is built to exercise chunked prefill, decode, preemption by
recompute (single sequences) and by swap (the n = 2 group), prefix-cache hits, n > 1
and beam search, and each case asserts on the reference run's counters that it did.
"""

from __future__ import annotations

import functools
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PAGEDJAX_WARMUP", "none")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pagedjax.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedjax.engine.beams import beam_search  # noqa: E402
from pagedjax.engine.fronts.data_parallel import DataParallelEngine  # noqa: E402
from pagedjax.engine.fronts.router import Router  # noqa: E402
from pagedjax.engine.llm_engine import LLMEngine  # noqa: E402
from pagedjax.model import preset_arch, random_params  # noqa: E402
from pagedjax.model.quant.inflight import quantize_params  # noqa: E402
from pagedjax.model.quant.weight import QuantizedWeight  # noqa: E402
from pagedjax.model.sharding import per_device_bytes  # noqa: E402
from pagedjax.sampling import BeamSearchParams, SamplingParams  # noqa: E402
from pagedjax.tokenizer import ByteTokenizer  # noqa: E402

BLOCK, MAX_LEN, MAX_SEQS, BUDGET, NUM_BLOCKS = 4, 64, 6, 16, 20


@functools.cache
def params_of(model: str, quant: str | None = None):
    # std 0.15: greedy choices are rarely near-ties (DESIGN.md, testing).
    params = random_params(preset_arch(model), seed=0, dtype=jnp.float32, std=0.15)
    if quant == "int4":
        # Groups of 32 (the default would be one group per column at hidden 64): o_proj's
        # 2 and down_proj's 4 groups are then split between devices at group boundaries.
        params = quantize_params(params, "int4", group_size=32)
    return params


def config(model: str, tp: int, backend: str, dp: int = 1, routing: str = "least_tokens",
           swap_space: float = 0.01):  # fmt: skip
    return EngineConfig(
        model=ModelConfig(model=model, max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                          enable_prefix_caching=True, swap_space=swap_space),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
                                  watermark=0.0),
        parallel=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp,
                                data_parallel_routing=routing),  # type: ignore[arg-type]
        attention_backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip


def engine(model: str, tp: int, backend: str = "auto", quant: str | None = None, **kw):
    arch = preset_arch(model)
    tok = ByteTokenizer(eos_token_id=arch.eos_token_id, bos_token_id=arch.bos_token_id)
    cls = DataParallelEngine if kw.get("dp", 1) > 1 else LLMEngine
    # NaN pages: a read of a slot a sequence does not own poisons its logits.
    return cls(arch, params_of(model, quant), tok, config(model, tp, backend, **kw),
               kv_fill_value=float("nan"))  # fmt: skip


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def workload(vocab: int) -> dict[int, list]:
    """Arrivals by step: (request id, prompt ids, params). 20 usable blocks of 4 tokens
    cannot hold them all: preemption happens; E shares A's first 16 tokens (prefix hit);
    B is a group of n = 2 seeded samples (swapped when preempted)."""
    rng = np.random.default_rng(7)
    p = lambda n: [int(x) for x in rng.integers(3, vocab, n)]  # noqa: E731
    a = p(20)
    return {
        0: [("A", a, greedy(16)),
            ("B", p(7), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16,
                                       ignore_eos=True)),
            ("C", p(11), greedy(20))],
        1: [("E", a[:16] + p(3), greedy(10))],  # after A's first 16 tokens are cached
        4: [("D", p(9), greedy(12))],
    }  # fmt: skip


def drain(eng, arrivals, max_steps: int = 3000) -> tuple[dict, dict]:
    """Step until idle; ({id: [token ids per sample]}, {id: replica} for a DP engine)."""
    done, where, step = {}, {}, 0
    while eng.has_unfinished_requests() or any(k >= step for k in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            where[rid] = eng.add_request(rid, prompt, params)
        for out in eng.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
        step += 1
        assert step < max_steps, "engine did not finish"
    return done, where


def beams(eng, vocab: int) -> list:
    rng = np.random.default_rng(11)
    prompt = [int(x) for x in rng.integers(3, vocab, 6)]
    out = beam_search(eng, [prompt], BeamSearchParams(beam_width=2, max_tokens=8,
                                                      ignore_eos=True))  # fmt: skip
    return [list(s.tokens) for s in out[0].sequences]


@functools.cache
def reference(model: str, backend: str, quant: str | None = None) -> tuple[dict, list, dict]:
    """Single-device outputs of the workload and of beam search, and the counters that
    show which features the workload exercised."""
    eng = engine(model, 1, backend, quant)
    vocab = eng.arch.vocab_size
    outs, _ = drain(eng, workload(vocab))
    stats = eng.stats()
    facts = {k: stats[k] for k in ("preemptions_recompute", "preemptions_swap",
                                   "prefix_cache_hit_tokens", "forked_samples")}  # fmt: skip
    assert facts["preemptions_recompute"] > 0, facts
    assert facts["preemptions_swap"] > 0, facts
    assert facts["prefix_cache_hit_tokens"] > 0, facts
    assert facts["forked_samples"] > 0, facts
    return outs, beams(eng, vocab), facts


def case_tp(tp: int, model: str, backend: str = "auto", quant: str | None = None) -> dict:
    ref_outs, ref_beams, facts = reference(model, backend, quant)
    eng = engine(model, tp, backend, quant)
    outs, _ = drain(eng, workload(eng.arch.vocab_size))
    for rid in ref_outs:
        assert outs[rid] == ref_outs[rid], f"{rid}: TP {tp} {outs[rid]} vs TP 1 {ref_outs[rid]}"
    got_beams = beams(eng, eng.arch.vocab_size)
    assert got_beams == ref_beams, f"beams: TP {tp} {got_beams} vs TP 1 {ref_beams}"
    layout = eng.placement.layout
    # The pool keeps its head sharding through every program (no silent re-layout).
    for p in eng.kv:
        assert p.sharding.is_equivalent_to(layout.kv_sharding, p.ndim), p.sharding
    traces = {f"{t}x{s}": c for (t, s), c in eng.runner.trace_count.items()}
    assert all(c == 1 for c in traces.values()), f"recompiled: {traces}"
    # Warm-up compiles the executable real steps use (same shardings): a cache hit.
    compiled = eng.runner.step._cache_size()
    eng.warmup([next(iter(eng.runner.trace_count))])
    assert eng.runner.step._cache_size() == compiled, "warm-up compiled a different program"
    return dict(facts, attention_backend=eng.attention_backend, buckets=len(traces),
                kv_shards=layout.kv_shards, kv_replicas=layout.kv_replicas,
                **memory(eng, tp))  # fmt: skip


def _ways(path: tuple[str, ...], tp: int, kv_shards: int) -> int:
    """How many ways the test expects a parameter split (stated here independently of
    the module's rule table)."""
    names = set(path)
    if names & {"k_proj", "v_proj"}:  # kernel and bias
        return kv_shards
    if names & {"q_proj", "gate_proj", "up_proj", "fc1", "embed_tokens", "lm_head"}:
        return tp
    # A dense kernel, or any array of a quantized one (path ..., kernel, .data / .scale)
    # with groups of 32: every one of them splits at group boundaries here.
    if names & {"o_proj", "down_proj", "out_proj", "fc2"} and "kernel" in path:
        return tp
    return 1  # norms, row-parallel biases, OPT's position embeddings


def memory(eng, tp: int) -> dict:
    """Each device holds 1/N of the split parameters and 1/min(N, kv_heads) of the pool,
    read from the arrays' shardings (per-device byte counts)."""
    arch = eng.arch
    kv_shards = min(tp, arch.num_kv_heads)
    expected = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(eng.params)[0]:
        names = tuple(str(getattr(k, "key", k)) for k in path)
        expected += leaf.nbytes // _ways(names, tp, kv_shards)
    total_params = sum(x.nbytes for x in jax.tree.leaves(eng.params))
    by_dev = per_device_bytes(eng.params)
    assert len(by_dev) == tp, by_dev
    assert all(b == expected for b in by_dev.values()), (by_dev, expected)
    kv_total = sum(p.nbytes for p in eng.kv)
    kv_dev = per_device_bytes(eng.kv)
    assert all(b * kv_shards == kv_total for b in kv_dev.values()), (kv_dev, kv_total)
    return dict(params_total=total_params, params_per_device=expected, kv_total=kv_total,
                kv_per_device=kv_total // kv_shards)  # fmt: skip


def case_dp() -> dict:
    """DP 2 x TP 2 on 4 devices: outputs equal single-device ones; both replicas serve;
    then, routed by prefix affinity, prompts sharing two whole blocks meet on one replica
    (the same engine with a new router: no new compilations)."""
    model = "tiny-llama-tp"
    ref_outs, _, _ = reference(model, "auto")
    eng = engine(model, 2, dp=2)
    outs, where = drain(eng, workload(eng.arch.vocab_size))
    assert outs == ref_outs, (outs, ref_outs)
    devs = [sorted(d.id for d in r.placement.layout.devices) for r in eng.replicas]
    assert devs == [[0, 1], [2, 3]], devs
    assert set(where.values()) == {0, 1}, where
    eng.router = Router(2, "prefix_affinity", block_size=BLOCK)
    facts = dict(replica_of=where, devices=devs, **affinity(eng))
    return dict(facts, **served(eng, ref_outs["A"][0], workload(eng.arch.vocab_size)[0][0][1]))


def served(eng, want: list[int], prompt: list[int]) -> dict:
    """The server's front (AsyncLLMEngine, /metrics) over the DP engine: A's output."""
    import asyncio

    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.metrics import ServerMetrics

    front = AsyncLLMEngine(eng)

    async def one() -> tuple[list[int], bytes]:
        last = None
        async for out in front.generate(prompt, greedy(len(want)), "srv"):
            last = out
        # What /metrics reads, on the engine thread (render() swallows its errors).
        await front.call(lambda e: (e.request_counts()["running"], e.stats()["compilations"],
                                    e.num_free_blocks() / e.num_usable_blocks(),
                                    e.num_preemptions))  # fmt: skip
        return list(last.outputs[0].token_ids), await ServerMetrics("tp").render(front)

    try:
        got, metrics = asyncio.run(one())
    finally:
        front.shutdown()
    assert got == want, (got, want)
    assert b"pagedjax:" in metrics
    return dict(served_tokens=len(got))


def affinity(eng) -> dict:
    for r in eng.replicas:
        r.reset_stats()
    rng = np.random.default_rng(5)
    shared = [int(x) for x in rng.integers(3, 500, 2 * BLOCK)]
    # s0 is cached by the time s1..s3 arrive (its 10-token prompt is one step).
    arrivals = {
        0: [("s0", shared + [10, 20], greedy(4))]
        + [(f"u{i}", [int(x) for x in rng.integers(3, 500, 9)], greedy(4)) for i in range(3)],
        3: [(f"s{i}", shared + [10 + i, 20 + i], greedy(4)) for i in range(1, 4)],
    }
    # fmt: skip
    _, where = drain(eng, arrivals)
    shared_on = {where[f"s{i}"] for i in range(4)}
    assert len(shared_on) == 1, where
    assert set(where.values()) == {0, 1}, where  # the others still spread
    hits = [r.stats()["prefix_cache_hit_tokens"] for r in eng.replicas]
    assert hits[shared_on.pop()] > 0, hits
    return dict(affinity_replica_of=where, affinity_hit_tokens=hits)


def case_errors() -> dict:
    """A start-up error that needs the devices to exist: heads N does not divide."""
    from pagedjax import LLM

    want = "tensor_parallel_size=3 does not divide the model's 8 query heads"
    try:
        LLM("tiny-llama-tp", tensor_parallel_size=3, warmup="none")
    except ValueError as e:
        assert want in str(e), str(e)
        return dict(message=str(e))
    raise AssertionError("TP 3 was accepted")


def logprobs_of(eng, vocab: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the top-4 log-probabilities (by rank) of every prompt and output
    position of one request: the logits, as the engine's sampler reports them."""
    rng = np.random.default_rng(13)
    prompt = [int(x) for x in rng.integers(3, vocab, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=4,
                            prompt_logprobs=4)  # fmt: skip
    eng.add_request("L", prompt, params)
    last = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            last = out
    positions = [p for p in last.prompt_logprobs if p] + list(last.outputs[0].logprobs)
    table = [[lp.logprob for lp in sorted(p.values(), key=lambda lp: lp.rank)][:4]
             for p in positions]  # fmt: skip
    return list(last.outputs[0].token_ids), np.asarray(table, np.float64)


def case_tp_int4(tp: int) -> dict:
    """One engine pair, TP ``tp`` and TP 1, with the same int4 weights (groups of 32):
    the mixed workload's tokens are equal, one request's prompt and sampled log-probs
    agree within float32 rounding, each device holds 1/tp of every quantized array with
    row-parallel codes and scales split at group boundaries, and nothing recompiles."""
    model = "tiny-llama-tp"
    one, many = engine(model, 1, quant="int4"), engine(model, tp, quant="int4")
    vocab = one.arch.vocab_size
    want_outs, _ = drain(one, workload(vocab))
    got_outs, _ = drain(many, workload(vocab))
    assert got_outs == want_outs, (got_outs, want_outs)
    stats = one.stats()
    assert stats["preemptions_recompute"] > 0 and stats["preemptions_swap"] > 0, stats
    want_tokens, want = logprobs_of(one, vocab)
    got_tokens, got = logprobs_of(many, vocab)
    assert got_tokens == want_tokens, (got_tokens, want_tokens)
    diff = float(np.max(np.abs(got - want)))
    assert diff < 2e-5, diff
    down = many.params["layers"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(down, QuantizedWeight) and down.num_groups == 4, down
    for arr in (down.data, down.scale):  # [L, rows, out]: rows split tp ways
        shard = arr.sharding.shard_shape(arr.shape)
        assert shard[-2] * tp == arr.shape[-2] and shard[-1] == arr.shape[-1], shard
    traces = many.runner.trace_count
    assert all(c == 1 for c in traces.values()), f"recompiled: {traces}"
    return dict(max_logprob_diff=diff, logprob_positions=len(want), **memory(many, tp))


def case_memory(tp: int, model: str) -> dict:
    """Only the engine's placement at TP ``tp`` (no workload, nothing compiled): the bytes
    per device, for a test that compares them with another TP size's."""
    return memory(engine(model, tp), tp)


def run(name: str) -> dict:
    if name.startswith("memory-"):  # memory-tp2-tiny-llama
        _, tp, *model = name.split("-")
        return case_memory(int(tp[2:]), "-".join(model) + "-tp")
    if name.endswith("-int4"):  # tp2-int4
        return case_tp_int4(int(name.split("-")[0][2:]))
    parts = name.split("-")
    if parts[0].startswith("tp"):
        tp = int(parts[0][2:])
        model = "-".join(parts[1:3]) + "-tp"  # e.g. tp2-tiny-llama -> tiny-llama-tp
        backend = parts[3] if len(parts) > 3 else "auto"
        return case_tp(tp, model, backend)
    if name == "dp":
        return case_dp()
    if name == "errors":
        return case_errors()
    raise ValueError(f"unknown case {name!r}")


if __name__ == "__main__":
    import time

    for case in sys.argv[1:]:
        t = time.perf_counter()
        facts = run(case)
        facts["seconds"] = round(time.perf_counter() - t, 1)
        print(json.dumps({"case": case, **facts}, default=str), flush=True)
