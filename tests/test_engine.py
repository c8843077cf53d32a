"""LLMEngine: batched greedy output equals each request alone (chunking, preemption,
staggered arrivals), seeded sampling independent of the batch, one compilation per
bucket, KV donation, abort, stop handling, and the host-side helpers.

One engine geometry is built once per module (``_engine()``), so Hypothesis examples
reuse its compiled step instead of recompiling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedjax.engine.buckets import pick, pow2_buckets, step_buckets
from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.engine.kv_budget import cpu_default_kv_bytes, num_kv_blocks
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.model_runner import ModelRunner
from pagedjax.model import preset_arch, random_params
from pagedjax.sampling import SamplingParams
from pagedjax.scheduler import FREE
from pagedjax.tokenizer import ByteTokenizer
from tests.engine_helpers import drain

ARCH = preset_arch("tiny-llama")  # vocab 512, 2 layers, 4 q / 2 kv heads, head_dim 16
BLOCK = 4
MAX_LEN = 64
MAX_SEQS = 4
BUDGET = 16  # tokens per step: prompts over 16 tokens are chunked
NUM_BLOCKS = 24  # 23 usable: 4 sequences of up to 48 tokens (12 blocks) must preempt; the
# geometry of test_sharing and test_speculative (programs shared through the compile cache)
MAX_PROMPT, MAX_OUT = 24, 24
TIE_GAP = 1e-4


@functools.cache
def _params():
    # initializer_range ~0.15 so greedy choices are rarely near-ties.
    return random_params(ARCH, seed=0, dtype=jnp.float32, std=0.15)


@functools.cache
def _engine(budget: int = BUDGET) -> LLMEngine:
    """One engine (one set of compiled buckets) per token budget."""
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(
            block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=False
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=MAX_SEQS, watermark=0.0
        ),
    )
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    # NaN pages: anything read from a slot a sequence does not own poisons its logits.
    return LLMEngine(ARCH, _params(), tok, config, kv_fill_value=float("nan"))


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _drain(engine: LLMEngine, arrivals: dict[int, list] | None = None, max_steps: int = 2000,
           on_step=None):  # fmt: skip
    """tests/engine_helpers.drain; on_step() takes no argument here."""
    hook = None if on_step is None else (lambda _engine: on_step())
    return drain(engine, arrivals, max_steps=max_steps, on_step=hook)


def _assert_idle(engine: LLMEngine) -> None:
    """Every block back in the pool, every slot free, on host and device."""
    assert engine.num_free_blocks() == engine.num_usable_blocks()
    assert len(engine.book.free_slots) == engine.max_seqs and not engine.book.slot_owner
    assert np.all(np.asarray(engine.state.status) == FREE)
    assert not engine.book.queue and not engine.book.requests


_ALONE: dict[tuple[int, ...], tuple[list[int], np.ndarray]] = {}


def _alone(prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy ids of MAX_OUT tokens for prompt run alone, and each step's top-2 gap."""
    key = tuple(prompt)
    if key not in _ALONE:
        engine = _engine()
        engine.add_request("alone", prompt, _greedy(MAX_OUT, logprobs=2))
        out = _drain(engine)["alone"].outputs[0]
        gaps = []
        for entry in out.logprobs:
            lps = sorted((lp.logprob for lp in entry.values()), reverse=True)
            gaps.append(lps[0] - lps[1])
        _ALONE[key] = (out.token_ids, np.asarray(gaps))
    return _ALONE[key]


def _compare(prompt: list[int], got: list[int]) -> bool:
    """got equals the alone run's prefix, up to the first near-tie step. Returns whether a
    near-tie cut the comparison short."""
    ref, gaps = _alone(prompt)
    for i, tok in enumerate(got):
        if gaps[i] < TIE_GAP:
            return True
        assert tok == ref[i], f"token {i}: batched {got} vs alone {ref[: len(got)]}"
    return False


def _workload_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, ARCH.vocab_size, size=n).tolist()


requests_st = st.lists(
    st.tuples(
        st.integers(1, MAX_PROMPT),  # prompt length
        st.integers(1, MAX_OUT),  # max_tokens
        st.integers(0, 6),  # arrival step
    ),
    # At least 3 requests, so every example batches (a lone request is the reference).
    min_size=3,
    max_size=7,
)


@settings(max_examples=5)  # 5 of 8 before: the CI time limit (each example ~10 s)
@given(
    reqs=requests_st,
    seed=st.integers(0, 2**16),
    # Two budgets (each compiles its own buckets once): 8 chunks most prompts, 16 fewer.
    budget=st.sampled_from([BUDGET, BUDGET // 2]),
)
def test_batched_greedy_equals_alone(reqs, seed, budget):
    engine = _engine(budget)
    rng = np.random.default_rng(seed)
    arrivals: dict[int, list] = {}
    prompts = {}
    for i, (plen, max_tokens, at) in enumerate(reqs):
        prompt = _workload_prompt(rng, plen)
        prompts[f"r{i}"] = (prompt, max_tokens)
        arrivals.setdefault(at, []).append((f"r{i}", prompt, _greedy(max_tokens)))
    done = _drain(engine, arrivals)
    assert set(done) == set(prompts), "a request was lost"
    for rid, (prompt, max_tokens) in prompts.items():
        out = done[rid].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        _compare(prompt, out.token_ids)
    _assert_idle(engine)


def test_preemption_keeps_greedy_outputs():
    engine = _engine()
    before = engine.num_preemptions
    rng = np.random.default_rng(1)
    prompts = {f"p{i}": _workload_prompt(rng, MAX_PROMPT - i) for i in range(6)}
    arrivals = {0: [(rid, p, _greedy(MAX_OUT)) for rid, p in prompts.items()]}
    done = _drain(engine, arrivals)
    assert engine.num_preemptions > before, "the pool was meant to force preemption"
    ties = sum(_compare(p, done[rid].outputs[0].token_ids) for rid, p in prompts.items())
    assert ties <= 1
    _assert_idle(engine)


def test_seeded_sampling_independent_of_batch_and_preemption():
    engine = _engine()
    rng = np.random.default_rng(2)
    prompt = _workload_prompt(rng, 10)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _drain(engine, {0: [("s", prompt, params)]})["s"].outputs[0].token_ids
    # The same request among greedy neighbours arriving earlier, in a pool small enough
    # that the sampled request (the latest arrival: FCFS's victim) is preempted.
    preempted = []

    def watch():
        req = engine.book.requests.get("s")
        if req is not None and req.seqs[0].slot is not None:
            preempted.append(int(engine.state.num_preemptions[req.seqs[0].slot]))

    others = [(f"o{i}", _workload_prompt(rng, 20), _greedy(MAX_OUT)) for i in range(3)]
    done = _drain(engine, {0: others, 2: [("s", prompt, params)]}, on_step=watch)
    assert max(preempted) >= 1, "the sampled request was meant to be preempted"
    assert done["s"].outputs[0].token_ids == alone
    # Different seed, different sample (the seed is actually used).
    other = _drain(engine, {0: [("t", prompt, params.__class__(**{**_kw(params), "seed": 99}))]})
    assert other["t"].outputs[0].token_ids != alone
    _assert_idle(engine)


def _kw(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_n_samples_are_distinct_sequences():
    engine = _engine()
    prompt = [5, 6, 7]
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=2)
    out = _drain(engine, {0: [("u", prompt, p)]})["u"]
    a, b = (o.token_ids for o in out.outputs)
    assert [o.index for o in out.outputs] == [0, 1]
    assert a != b  # n = 2 samples use different sample indices
    _assert_idle(engine)


def test_step_compiles_once_per_bucket():
    engine = _engine()
    rng = np.random.default_rng(3)
    arrivals = {
        s: [(f"c{s}{i}", _workload_prompt(rng, 1 + 7 * i), _greedy(3 + s)) for i in range(s % 3)]
        for s in range(5)
    }
    _drain(engine, arrivals)
    counts = engine.runner.trace_count
    assert counts and all(v == 1 for v in counts.values()), counts
    assert all(k[0] in engine.token_buckets and k[1] in engine.seq_buckets for k in counts)
    assert engine.runner.step._cache_size() == len(counts)
    assert engine.core.device.jits()["schedule"]._cache_size() == 1
    _assert_idle(engine)


def test_warmup_compiles_the_executable_real_steps_use():
    engine = _engine()
    prompt = [3, 9, 27]
    ref = _drain(engine, {0: [("w0", prompt, _greedy(4))]})["w0"].outputs[0].token_ids
    compiled = engine.runner.step._cache_size()
    traces = dict(engine.runner.trace_count)
    # The pair the lone request ran in: T = 16, S = min(T, max_num_seqs) (one program per T).
    assert engine.warmup([(16, MAX_SEQS)]) == [(16, MAX_SEQS)]
    assert engine.runner.step._cache_size() == compiled  # a cache hit: same executable
    assert engine.runner.trace_count == traces
    # The padding step changed nothing: same output again, pool intact.
    again = _drain(engine, {0: [("w1", prompt, _greedy(4))]})["w1"].outputs[0].token_ids
    assert again == ref
    with pytest.raises(ValueError, match="bucket pair"):
        engine.warmup([(17, 1)])
    _assert_idle(engine)


def test_kv_pool_is_donated_to_the_step():
    engine = _engine()
    old = jax.tree.leaves(engine.kv)
    old_tokens = engine.core.device.tokens
    engine.add_request("d", [4, 5, 6], _greedy(2))
    engine.step()
    assert all(x.is_deleted() for x in old) and old_tokens.is_deleted()
    _drain(engine)
    _assert_idle(engine)


def test_step_aliases_the_pool_without_a_pool_sized_copy():
    """Compiled with a large pool, the step's outputs alias the pool (in-place update) and
    its scratch memory is far below one layer's pages: no copy of the pool is made."""
    engine = _engine()
    runner = ModelRunner(ARCH, BLOCK, engine.runner._attention_fn, engine.max_logprobs)
    pages = (4096, ARCH.num_kv_heads, BLOCK, ARCH.head_dim)
    kv = (jax.ShapeDtypeStruct((ARCH.num_layers, *pages), jnp.float32),) * 2
    pool_bytes = 2 * ARCH.num_layers * int(np.prod(pages)) * 4
    state, batch = engine.core.device.preview_schedule()
    sampling = engine.core.device.sampling()
    compiled = runner.step.lower(
        engine.params, kv, engine.core.device.tokens, state.mem, batch, sampling,
        state.prompt_len, state.output_len, num_tokens=16, num_seqs=4,
    ).compile()  # fmt: skip
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= pool_bytes
    assert mem.temp_size_in_bytes < pool_bytes // (2 * ARCH.num_layers)


def test_abort_frees_blocks_at_once_and_others_continue():
    engine = _engine()
    engine.add_request("a", list(range(3, 23)), _greedy(20))
    engine.add_request("b", [7, 8, 9], _greedy(5))
    for _ in range(3):
        engine.step()
    used = engine.num_usable_blocks() - engine.num_free_blocks()
    engine.abort_request("a")
    assert engine.num_usable_blocks() - engine.num_free_blocks() < used
    engine.abort_request("never-existed")  # ignored, as vLLM
    done = _drain(engine)
    assert set(done) == {"b"} and len(done["b"].outputs[0].token_ids) == 5
    _compare([7, 8, 9], done["b"].outputs[0].token_ids)
    _assert_idle(engine)


def test_stop_token_ids_eos_and_stop_strings():
    engine = _engine()
    prompt = [10, 11, 12]
    ref, _ = _alone(prompt)
    # stop_token_ids: ends at the first occurrence, token kept, stop_reason = the id.
    stop_id = ref[3]
    out = _drain(engine, {0: [("s", prompt, _greedy(MAX_OUT, stop_token_ids=[stop_id]))]})
    o = out["s"].outputs[0]
    first = ref.index(stop_id)
    assert o.token_ids == ref[: first + 1]
    assert (o.finish_reason, o.stop_reason) == ("stop", stop_id)
    # EOS unless ignore_eos: use a tokenizer whose EOS is the model's 3rd greedy token.
    eos_tok = ref[2]
    saved = engine.book.eos
    engine.book.eos = {eos_tok}
    try:
        p = SamplingParams(temperature=0.0, max_tokens=MAX_OUT)
        o = _drain(engine, {0: [("e", prompt, p)]})["e"].outputs[0]
        assert o.token_ids == ref[: ref.index(eos_tok) + 1] and o.finish_reason == "stop"
        assert o.stop_reason is None
        o = _drain(engine, {0: [("i", prompt, _greedy(6))]})["i"].outputs[0]
        assert o.token_ids == ref[:6] and o.finish_reason == "length"
    finally:
        engine.book.eos = saved
    _assert_idle(engine)


class _CharTokenizer:
    """Token id i is the printable character chr(0x4E00 + i): every id decodes to text."""

    eos_token_id = None
    bos_token_id = None
    vocab_size = ARCH.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - 0x4E00 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


def test_stop_string_truncates_text():
    engine = _engine()
    prompt = [20, 21, 22, 23]
    ref, _ = _alone(prompt)
    tok = _CharTokenizer()
    text = tok.decode(ref)
    stop = text[4:6]  # spans two tokens; the text ends right before it
    saved = engine.tokenizer
    engine.tokenizer = tok
    try:
        done = _drain(engine, {0: [("t", prompt, _greedy(MAX_OUT, stop=[stop, "never"]))]})
    finally:
        engine.tokenizer = saved
    out = done["t"].outputs[0]
    cut = text.index(stop)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[:cut] and out.token_ids == ref[: cut + len(stop)]
    _assert_idle(engine)


def test_invalid_requests_raise_and_engine_keeps_serving():
    engine = _engine()
    engine.add_request("ok", [3, 4, 5], _greedy(4))
    bad = [
        ("long", list(range(3, 3 + MAX_LEN + 1)), _greedy(1), ValueError, "longer than"),
        ("empty", [], _greedy(1), ValueError, "empty"),
        ("vocab", [ARCH.vocab_size], _greedy(1), ValueError, "vocabulary"),
        ("neg", [-1], _greedy(1), ValueError, "vocabulary"),
        ("ok", [3], _greedy(1), ValueError, "already in use"),
        ("plp", [3], SamplingParams(prompt_logprobs=21), ValueError, "prompt_logprobs=21"),
        ("lp", [3], SamplingParams(logprobs=21), ValueError, "max_logprobs"),
        ("type", [3], {"temperature": 0}, TypeError, "SamplingParams"),
    ]
    for rid, prompt, params, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            engine.add_request(rid, prompt, params)
    done = _drain(engine)
    assert set(done) == {"ok"}
    _compare([3, 4, 5], done["ok"].outputs[0].token_ids)
    _assert_idle(engine)


@pytest.mark.tier2  # second tier (docs/testing.md): 17 s cold: its own pool geometry
def test_requests_that_can_never_fit_the_pool():
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=4, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=2),
    )
    engine = LLMEngine(ARCH, _params(), ByteTokenizer(), config)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("x", list(range(3, 3 + 3 * BLOCK + 1)), _greedy(1))
    assert not engine.has_unfinished_requests()
    # A prompt that fits but whose output outgrows the 3-block pool even alone finishes
    # ("length", vLLM's ignored sequence) instead of preempting itself forever; the
    # engine then serves the next request normally.
    prompt = list(range(3, 3 + 2 * BLOCK))
    done = _drain(engine, {0: [("grow", prompt, _greedy(20))], 1: [("next", [5, 6], _greedy(3))]})
    out = done["grow"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) < 20
    assert len(out.token_ids) >= BLOCK  # it ran until the pool was full
    assert len(done["next"].outputs[0].token_ids) == 3
    _assert_idle(engine)


def test_paper_mode_rejects_prompts_over_the_budget():
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN),
        cache=CacheConfig(
            block_size=BLOCK, num_gpu_blocks_override=40, enable_prefix_caching=False
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=BUDGET, max_num_seqs=2, scheduling_mode="paper"
        ),
    )
    engine = LLMEngine(ARCH, _params(), ByteTokenizer(), config)
    with pytest.raises(ValueError, match="does not chunk"):
        engine.add_request("x", list(range(3, 3 + BUDGET + 1)), _greedy(1))
    assert not engine.has_unfinished_requests()


def test_max_model_len_over_the_model_limit_is_rejected():
    config = EngineConfig(
        model=ModelConfig(max_model_len=ARCH.max_position_embeddings + 1),
        cache=CacheConfig(enable_prefix_caching=False),
    )
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(ARCH, _params(), ByteTokenizer(), config)


def test_parallel_sizes_the_engine_cannot_serve_raise():
    """TP over more devices than JAX sees, or DP (replicas are DataParallelEngine's), is a
    clear error at start-up (tests/test_parallel.py runs TP and DP on 8 host devices)."""
    cache = CacheConfig(enable_prefix_caching=False)
    if len(jax.devices()) >= 4:  # ARCH has 4 query heads: TP 4 is the largest valid size
        pytest.skip("this process sees enough devices for TP 4")
    config = EngineConfig(cache=cache, parallel=ParallelConfig(tensor_parallel_size=4))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 .* needs 4 devices"):
        LLMEngine(ARCH, _params(), ByteTokenizer(), config)
    config = EngineConfig(cache=cache, parallel=ParallelConfig(data_parallel_size=2))
    with pytest.raises(ValueError, match="DataParallelEngine"):
        LLMEngine(ARCH, _params(), ByteTokenizer(), config)


# ---------------------------------------------------------------- host-side helpers


def test_buckets():
    assert step_buckets(256) == (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
    assert step_buckets(2048, 16)[:4] == (16, 32, 48, 64) and step_buckets(100)[-2:] == (96, 100)
    assert step_buckets(4) == (1, 2, 4) and step_buckets(16, 16) == (16,)
    for cap in range(1, 600):  # rows padded: under half up to 32, at most a third above
        b = step_buckets(cap)
        assert b[-1] == cap and list(b) == sorted(set(b))
        for n in range(1, cap + 1):
            assert pick(b, n) < 2 * n if n <= 32 else 2 * pick(b, n) <= 3 * n
    assert pow2_buckets(48, 8) == (8, 16, 32, 48)
    assert pow2_buckets(16, 16) == (16,)
    b = pow2_buckets(256)
    assert pick(b, 1) == 1 and pick(b, 3) == 4 and pick(b, 256) == 256
    with pytest.raises(ValueError):
        pick(b, 257)


def test_kv_budget_cpu_paths():
    kw = dict(
        kv_bytes_per_token=1024,
        block_size=16,
        max_blocks_needed=10_000_000,
        gpu_memory_utilization=0.9,
        device=jax.devices("cpu")[0],
    )
    assert num_kv_blocks(num_gpu_blocks_override=7, kv_cache_memory_bytes=None, **kw) == 7
    assert num_kv_blocks(num_gpu_blocks_override=None, kv_cache_memory_bytes=1 << 20, **kw) == 64
    n = num_kv_blocks(num_gpu_blocks_override=None, kv_cache_memory_bytes=None, **kw)
    assert n == cpu_default_kv_bytes()[0] // (1024 * 16)
    assert 0 < cpu_default_kv_bytes()[0] <= 4 << 30
    capped = dict(kw, max_blocks_needed=9)
    assert num_kv_blocks(num_gpu_blocks_override=None, kv_cache_memory_bytes=None, **capped) == 10
    with pytest.raises(ValueError, match="too small"):
        num_kv_blocks(num_gpu_blocks_override=None, kv_cache_memory_bytes=100, **kw)


def test_cpu_default_kv_bytes_is_stable_across_starts(monkeypatch):
    """The default pool is a program shape: free memory that drifts by a few hundred MiB
    between two starts must give the same pool (else the compilation cache misses)."""
    from pagedjax.engine import kv_budget

    sizes = set()
    for avail_gib in (9.1, 9.6, 10.4, 11.7, 15.9):
        monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda a=avail_gib: int(a * 2**30))
        sizes.add(kv_budget.cpu_default_kv_bytes()[0])
    assert sizes == {2 << 30}
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 64 << 30)
    assert kv_budget.cpu_default_kv_bytes()[0] == 4 << 30
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 3 << 30)
    assert kv_budget.cpu_default_kv_bytes()[0] == 512 << 20


class _FakeGPU:
    platform = "gpu"

    def __init__(self):
        self.profiled = False

    def memory_stats(self):
        peak = 3 << 30 if self.profiled else 1 << 30
        return {"bytes_limit": 10 << 30, "peak_bytes_in_use": peak}


def test_kv_budget_gpu_path_subtracts_profiled_peak():
    dev = _FakeGPU()

    def profile():
        dev.profiled = True

    n = num_kv_blocks(
        kv_bytes_per_token=1 << 10, block_size=16, max_blocks_needed=10**9,
        num_gpu_blocks_override=None, kv_cache_memory_bytes=None,
        gpu_memory_utilization=0.5, device=dev, profile=profile,
    )  # fmt: skip
    assert dev.profiled and n == ((5 << 30) - (3 << 30)) // (16 << 10)


def test_detokenizer_incremental_matches_full_decode_and_holds_partial_utf8():
    tok = ByteTokenizer()
    ids = list("héllo wörld".encode())
    d = IncrementalDetokenizer(tok)
    texts = []
    for i in ids:
        d.append(i)
        texts.append(d.text)
        assert "\ufffd" not in d.text  # a split multi-byte char is held back
    assert d.text == "héllo wörld"


def test_detokenizer_stop_string_across_tokens():
    d = IncrementalDetokenizer(ByteTokenizer(), stop=("zz", "lo w"))
    hits = []
    for i in b"hello world":
        hits.append(d.append(i))
        if hits[-1]:
            break
    assert hits == [None] * 6 + ["lo w"] and d.text == "hel"


def test_detokenizer_stop_strings_wait_for_min_tokens():
    """vLLM's rule: a stop string counts once more than min_tokens ids are out; one
    completed earlier is passed over. text=False keeps ids only and matches nothing."""
    def first_hit(**kw):
        d = IncrementalDetokenizer(ByteTokenizer(), stop=("l",), **kw)
        return next((n for n, b in enumerate(b"hello world", 1) if d.append(b)), None)

    assert first_hit() == 3  # "hel"
    assert first_hit(min_tokens=3) == 4  # the first "l" is the 3rd id: too early
    assert first_hit(min_tokens=4) == 10  # both l's of "hello" too early; "worl"
    assert first_hit(text=False) is None
