"""Speculative decoding (engine/spec/decoder.py): outputs, memory and compiles.

Greedy outputs with speculation equal those without it, across chunked prefill,
preemption, prefix-cache hits, n > 1, stops inside an accepted run and max_tokens
reached mid-run; seeded sampling too (the target's token at each position is drawn
with the same key as without speculation). After every step each running sequence
holds exactly the blocks its accepted length needs, refcounts equal the block tables'
references and the free count is the pool minus those blocks; no cached block holds a
rejected token. The verification program compiles once per bucket.

Two proposers drive it: the real n-gram one, and an oracle that proposes the reference
run's continuation with some tokens corrupted, so every accepted length 0..k (and
stops inside accepted runs) is exercised whatever the random model does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedjax.engine.beams import beam_search
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.spec.ngram import NgramProposer
from pagedjax.model import preset_arch, random_params
from pagedjax.sampling import BeamSearchParams, SamplingParams
from pagedjax.scheduler import RUNNING
from pagedjax.tokenizer import ByteTokenizer
from tests.engine_helpers import drain

ARCH = preset_arch("tiny-llama")  # vocab 512, 2 layers
BLOCK = 4
NUM_BLOCKS = 24  # 23 usable: four sequences of up to 16 blocks must preempt
MAX_LEN = 64
MAX_SEQS = 4
BUDGET = 16  # prompts over 16 tokens are chunked
K = 4
NUM_BLOCKS = 24  # 23 usable: four sequences of up to 16 blocks must preempt
TIE_GAP = 1e-4


@functools.cache
def _params():
    return random_params(ARCH, seed=0, dtype=jnp.float32, std=0.15)


@functools.cache
def _engine(spec: bool, method: str = "ngram", warmup: str = "none",
            steps: int | str = "auto") -> LLMEngine:  # fmt: skip
    """One geometry for every test (prefix caching on; a pool small enough to preempt),
    so the plain and the speculative engine share compiled programs through the
    session's persistent compilation cache."""
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(
            block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=True
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS, watermark=0.0,
            num_multi_steps=steps,
        ),
        speculative=SpeculativeConfig(
            method=method, num_speculative_tokens=K, prompt_lookup_max=3, prompt_lookup_min=1,
            model="self" if method == "draft_model" else None,
            draft_num_layers=1 if method == "draft_model" else None,
        )
        if spec
        else None,
        warmup=warmup,
    )
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    return LLMEngine(ARCH, _params(), tok, config, kv_fill_value=float("nan"))


def _drain(engine: LLMEngine, requests, on_step=None, max_steps: int = 1000):
    """All requests at step 0 (tests/engine_helpers.drain)."""
    return drain(engine, list(requests), max_steps=max_steps, on_step=on_step)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, **kw)


def _prompts(seed: int, count: int, lo: int = 5, hi: int = 30) -> list[list[int]]:
    """Copy-heavy prompts: a short random phrase repeated, so n-gram lookup proposes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        phrase = rng.integers(3, ARCH.vocab_size, size=int(rng.integers(2, 6))).tolist()
        n = int(rng.integers(lo, hi))
        out.append((phrase * (n // len(phrase) + 1))[:n])
    return out


def _reference(requests) -> dict:
    return _drain(_engine(False), requests)


def _assert_same(ref: dict, got: dict) -> None:
    """Same ids and finish reasons, up to the first near-tie of the reference run."""
    assert ref.keys() == got.keys()
    for rid, r in ref.items():
        for a, b in zip(r.outputs, got[rid].outputs, strict=True):
            gaps = [
                sorted((lp.logprob for lp in e.values()), reverse=True) for e in a.logprobs
            ]
            n = len(a.token_ids)
            for i, g in enumerate(gaps):
                if len(g) > 1 and g[0] - g[1] < TIE_GAP:
                    n = i
                    break
            assert b.token_ids[:n] == a.token_ids[:n], (rid, a.token_ids, b.token_ids)
            if n == len(a.token_ids):
                assert b.token_ids == a.token_ids, rid
                assert b.finish_reason == a.finish_reason, rid
                assert b.text == a.text, rid


class OracleProposer:
    """Proposes the reference continuation of ``ids`` with every ``bad``-th position
    (counted from the sequence length) corrupted; [] for unknown prefixes."""

    def __init__(self, refs: list[list[int]], bad: int = 3):
        self.refs, self.bad = refs, bad
        self.calls = 0

    def propose(self, ids, k: int) -> list[int]:
        self.calls += 1
        ids = list(ids)
        for full in self.refs:
            if len(full) > len(ids) and full[: len(ids)] == ids:
                out = full[len(ids) : len(ids) + k]
                return [
                    (t + 1) % ARCH.vocab_size if (len(ids) + j) % self.bad == 0 else t
                    for j, t in enumerate(out)
                ]
        return []


def _refs(ref: dict, prompts: dict) -> list[list[int]]:
    """Each reference sequence in full (prompts: by request id or by its int)."""
    by_id = {str(k): v for k, v in prompts.items()}
    return [by_id[rid] + o.token_ids for rid, r in ref.items() for o in r.outputs]


def check_memory(engine: LLMEngine) -> None:
    """Block invariants of the current state (see the module docstring)."""
    st = jax.device_get(engine.state)
    mem, b = st.mem, engine.block_size
    tables, lengths = mem.tables.tables, mem.tables.lengths
    on_host = mem.on_host if mem.on_host is not None else np.zeros(len(lengths), bool)
    for s in np.flatnonzero(st.status == RUNNING):
        if on_host[s]:
            continue
        assert lengths[s] == st.num_computed[s], (s, lengths[s], st.num_computed[s])
        held = int(np.sum(tables[s] != 0))
        assert held == -(-int(lengths[s]) // b), (s, held, lengths[s])
        # KV never covers more than the tokens but the last (no draft is kept); less
        # while a prompt (or a recompute after preemption) is still being prefilled.
        if st.output_len[s] > 0:
            assert st.num_computed[s] <= st.prompt_len[s] + st.output_len[s] - 1
    rows = tables[~on_host].reshape(-1)
    refs = np.bincount(rows[rows != 0], minlength=engine.num_blocks)
    np.testing.assert_array_equal(mem.pool.refcount[1:], refs[1:])
    assert int(mem.pool.num_free) == engine.num_usable_blocks() - int(np.sum(refs[1:] > 0))


# ---------------------------------------------------------------------------- units


def test_config_rejects_unknown_and_bad_keys():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match="unknown key speculative_config.lookahead"):
        SpeculativeConfig.from_dict({"method": "ngram", "lookahead": 3})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ConfigError, match="method"):
        SpeculativeConfig.from_dict({"method": "medusa"})
    with pytest.raises(ConfigError, match="draft model"):
        SpeculativeConfig(method="draft_model")


def test_missing_eagle_head_refused_before_loading():
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN),
        speculative=SpeculativeConfig(method="eagle", model="/nowhere"),
    )
    with pytest.raises(FileNotFoundError, match="'/nowhere': no eagle head directory"):
        LLMEngine.from_config(config)


def test_ngram_proposer():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # 3-gram (1, 2, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 9) == [4, 1, 2, 3]  # up to the end
    assert p.propose([5, 6, 7, 5, 8, 9, 5], 2) == [8, 9]  # latest occurrence of (5,)
    assert p.propose([1, 2, 3, 4], 3) == []
    assert p.propose([7, 7], 3) == [7]
    assert p.propose([1, 2, 1], 0) == []
    assert NgramProposer(2, 2).propose([1, 2, 9, 2], 2) == []  # (9, 2) never seen before


# ---------------------------------------------------------------------------- engine


def test_ngram_greedy_equals_plain_with_chunking_and_stats():
    prompts = dict(enumerate(_prompts(0, 4, lo=5, hi=40)))  # some over BUDGET: chunked
    reqs = [(str(i), p, _greedy(20)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _engine(True)
    engine.reset_stats()
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    s = engine.stats()
    assert s["spec_proposed_tokens"] > 0, "copy-heavy prompts were meant to propose"
    assert 0.0 <= s["spec_acceptance_rate"] <= 1.0
    assert s["spec_mean_accepted_length"] == pytest.approx(
        (s["spec_rows"] + s["spec_accepted_tokens"]) / s["spec_rows"]
    )
    assert engine.num_free_blocks() == engine.num_usable_blocks()


@pytest.mark.parametrize("bad", [2, 3, 100])
def test_oracle_greedy_equals_plain_with_preemption(bad):
    """A small pool forces preemption; the oracle makes runs of every length."""
    prompts = dict(enumerate(_prompts(1, 4, lo=6, hi=20)))
    reqs = [(str(i), p, _greedy(24)) for i, p in prompts.items()]
    ref = _reference(reqs)
    # Every request runs to max_tokens: waiting slots' prefix hits give way to running
    # ones (docs/prefix_caching.md), so none is finished for capacity.
    assert all(len(r.outputs[0].token_ids) == 24 for r in ref.values())
    engine = _engine(True)
    engine.speculator.proposer = OracleProposer(_refs(ref, prompts), bad=bad)
    engine.reset_stats()
    before = engine.num_preemptions
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    assert engine.num_preemptions > before, "the pool was meant to force preemption"
    s = engine.stats()
    assert s["spec_accepted_tokens"] > 0
    if bad == 100:
        assert s["spec_accepted_tokens"] > 0.7 * s["spec_proposed_tokens"]
    assert engine.num_free_blocks() == engine.num_usable_blocks()


def test_stops_and_max_tokens_inside_accepted_runs():
    """EOS / stop ids / stop strings / max_tokens that fall inside an accepted run end
    the output there, exactly where the plain run ends it."""
    prompts = dict(enumerate(_prompts(2, 4, lo=6, hi=14)))
    plain = _reference([(str(i), p, _greedy(24)) for i, p in prompts.items()])
    refs = _refs(plain, prompts)
    cases = {}
    for i, p in prompts.items():
        out = plain[str(i)].outputs[0].token_ids
        cases[f"len{i}"] = (p, _greedy(7 + i))  # max_tokens mid-run
        cases[f"id{i}"] = (p, _greedy(24, stop_token_ids=[out[9 + i]]))
        cases[f"eos{i}"] = (p, _greedy(24, ignore_eos=False, stop_token_ids=[]))
        text = ByteTokenizer().decode(out[:12])
        if len(text) >= 3:
            cases[f"str{i}"] = (p, _greedy(24, stop=[text[-3:]]))
    reqs = [(rid, p, sp) for rid, (p, sp) in cases.items()]
    ref = _reference(reqs)
    engine = _engine(True)
    engine.speculator.proposer = OracleProposer(refs, bad=100)
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    for rid, (_, sp) in cases.items():
        assert len(got[rid].outputs[0].token_ids) <= sp.max_tokens


def test_n_gt_1_and_prefix_hits_no_rejected_token_cached():
    prompts = dict(enumerate(_prompts(3, 3, lo=9, hi=20)))
    shared = _prompts(4, 1, lo=12, hi=13)[0]
    reqs = [(str(i), p, _greedy(16, n=2)) for i, p in prompts.items()]
    reqs += [(f"s{j}", shared, _greedy(16)) for j in range(2)]  # the second hits the cache
    ref = _reference(reqs)
    engine = _engine(True)
    all_prompts = {**{str(i): p for i, p in prompts.items()}, "s0": shared, "s1": shared}
    engine.speculator.proposer = OracleProposer(_refs(ref, all_prompts), bad=2)
    engine.reset_stats()
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    # Every cached block holds a block of some final sequence, never a rejected draft.
    chunks = set()
    for rid, r in got.items():
        for o in r.outputs:
            full = all_prompts[rid] + o.token_ids
            chunks |= {tuple(full[i : i + BLOCK]) for i in range(0, len(full) - BLOCK + 1, BLOCK)}
    pc = jax.device_get(engine.state.mem.prefix)
    for blk in np.flatnonzero(pc.cached):
        assert tuple(pc.tokens[blk].tolist()) in chunks, blk


def test_seeded_sampling_equals_plain():
    """Sampled rows draw the target's token with the (seed, sample, position) key, so a
    seeded request gives the same output with and without speculation."""
    prompts = dict(enumerate(_prompts(5, 3, lo=6, hi=20)))
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    reqs = [(str(i), p, sp) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _engine(True)
    engine.speculator.proposer = OracleProposer(_refs(ref, prompts), bad=3)
    engine.reset_stats()
    got = _drain(engine, reqs)
    for rid in ref:
        assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids
    assert engine.stats()["spec_accepted_tokens"] > 0


@pytest.mark.tier2  # second tier (docs/testing.md): 22 s cold: its own fused program
@pytest.mark.parametrize("seeded", [False, True])
def test_ngram_fused_in_the_k_step_program_equals_plain(seeded):
    """With num_scheduler_steps = 4 the n-gram method drafts, schedules and verifies
    inside the fused K-step program (``spec_fused_steps``); outputs equal the plain
    one-step run's, greedy and seeded, with stop ids and max_tokens inside accepted
    runs, chunked prompts and prefix caching."""
    prompts = dict(enumerate(_prompts(6, 4, lo=6, hi=30)))
    if seeded:
        kw = dict(temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, logprobs=2)
        reqs = [(str(i), p, SamplingParams(max_tokens=18, **kw)) for i, p in prompts.items()]
    else:
        plain = _reference([(str(i), p, _greedy(20)) for i, p in prompts.items()])
        reqs = []
        for i, p in prompts.items():
            out = plain[str(i)].outputs[0].token_ids
            reqs += [(f"len{i}", p, _greedy(9 + i)),
                     (f"id{i}", p, _greedy(20, stop_token_ids=[out[11 + i]]))]  # fmt: skip
    ref = _reference(reqs)
    engine = _engine(True, steps=4)
    engine.reset_stats()
    got = _drain(engine, reqs, on_step=check_memory)
    if seeded:
        for rid in ref:
            assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids, rid
    else:
        _assert_same(ref, got)
    s = engine.stats()
    assert s["spec_fused_steps"] > 0, "the loop was meant to speculate"
    assert s["multi_step_iterations"] > 0
    assert s["spec_proposed_tokens"] > 0
    if not seeded:  # greedy copies the prompts' phrases: drafts are accepted
        assert s["spec_accepted_tokens"] > 0
    assert engine.num_free_blocks() == engine.num_usable_blocks()


@pytest.mark.tier2  # second tier (docs/testing.md): 17 s cold: compiles every bucket
def test_compiles_once_per_bucket_and_warm_up_covers_them():
    """A warmed-up speculative engine compiles nothing while generating; a second run
    compiles nothing either, and every verification program was traced once."""
    prompts = dict(enumerate(_prompts(6, 4, lo=5, hi=30)))
    reqs = [(str(i), p, _greedy(12)) for i, p in prompts.items()]
    engine = _engine(True, warmup="all")
    warm = engine.stats()
    _drain(engine, reqs)
    assert engine.stats()["spec_proposed_tokens"] > 0
    assert engine.stats()["spec_compilations"] == warm["spec_compilations"]
    assert engine.stats()["compilations"] == warm["compilations"]
    counts = dict(engine.speculator.verifier.trace_count)
    before = engine.stats()
    _drain(engine, [(f"again{i}", p, sp) for i, p, sp in reqs])
    after = engine.stats()
    assert engine.speculator.verifier.trace_count == counts
    assert all(v == 1 for v in counts.values())
    assert after["spec_compilations"] == before["spec_compilations"]
    assert after["compilations"] == before["compilations"]


def test_beam_search_with_speculation_refused():
    with pytest.raises(ValueError, match="beam search with speculative decoding"):
        beam_search(_engine(True), [[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=4))


def test_layer_skip_draft_greedy_equals_plain():
    """The target's first layer drafts (draft_model, model "self") on one shared pool."""
    prompts = dict(enumerate(_prompts(7, 4, lo=6, hi=24)))
    reqs = [(str(i), p, _greedy(24)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _engine(True, "draft_model")
    engine.reset_stats()
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    s = engine.stats()
    assert s["spec_proposed_tokens"] > 0 and s["spec_steps"] > 0
    assert set(engine.speculator.draft.trace_count.values()) == {1}
    assert engine.num_free_blocks() == engine.num_usable_blocks()


def test_verify_and_draft_programs_take_the_plain_steps_matmul(monkeypatch):
    """The verification and layer-skip draft programs multiply the stacked layer weights
    the way the plain step does (on one device: the CPU kernel, model/native_matmul.py).
    Without it the k + 1-row verification ran XLA's copy-then-dot under the layer loop,
    1.6-2x a plain step on SmolLM2, which alone cost speculation its speed-up."""
    import pagedjax.model.layers as layers

    seen: list[bool] = []
    real = layers.stacked_matmul

    def spy(x, w, layer, *, native):  # runs at trace time
        seen.append(native)
        return real(x, w, layer, native=native)

    monkeypatch.setattr(layers, "stacked_matmul", spy)
    engine = _engine.__wrapped__(True, "draft_model")  # a fresh engine: its programs trace
    assert engine.runner.native_matmul
    seen.clear()  # loading traced the module's init (shapes only)
    prompt = _prompts(7, 1, lo=8, hi=12)[0]
    _drain(engine, [("0", prompt, _greedy(8))])
    assert engine.stats()["spec_steps"] > 0
    assert seen and all(seen)


def test_disable_by_batch_size():
    """No proposals in steps with at least disable_by_batch_size sequences."""
    engine = _engine(True)
    old = engine.speculator.config
    engine.speculator.config = dataclasses.replace(old, disable_by_batch_size=1)
    try:
        engine.reset_stats()
        prompts = _prompts(9, 2, lo=8, hi=16)
        _drain(engine, [(f"d{i}", p, _greedy(8)) for i, p in enumerate(prompts)])
        assert engine.stats()["spec_proposed_tokens"] == 0
    finally:
        engine.speculator.config = old


# ------------------------------------------------- separate draft checkpoint (own pool)


def _write_llama_dir(directory, config: dict, params) -> str:
    """A Hugging Face Llama directory (config.json + model.safetensors, fp32) holding
    ``params`` (pagedjax's layout: stacked layers, [in, out] kernels), no torch needed."""
    import json

    from safetensors.numpy import save_file

    tensors = {}

    def put(path, x):
        *mods, leaf = [p.key for p in path]
        hf_leaf = {"kernel": "weight", "embedding": "weight", "scale": "weight"}.get(leaf, leaf)
        x = np.asarray(x, np.float32)
        name = lambda ms: ("" if ms[0] == "lm_head" else "model.") + ".".join([*ms, hf_leaf])
        rows = [(["layers", str(i), *mods[1:]], x[i]) for i in range(x.shape[0])] if (
            mods[0] == "layers") else [(mods, x)]  # fmt: skip
        for ms, t in rows:
            tensors[name(ms)] = np.ascontiguousarray(t.T if leaf == "kernel" else t)

    jax.tree_util.tree_map_with_path(put, params)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    cfg = dict(config, architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (directory / "config.json").write_text(json.dumps(cfg))
    return str(directory)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    """"target": the tests' tiny Llama (``_params()``, so the plain reference is
    ``_engine(False)``'s) as a checkpoint directory; "trunc": the same model cut to its
    first layer (same embeddings and head: drafts accepted sometimes, runs of every
    length); "vocab384": a 1-layer Llama with another vocabulary. The "tiny-mixtral"
    preset (random weights, 2 layers of 4 experts) is a draft of another family."""
    from pagedjax.model import PRESETS, arch_from_hf_config

    root = tmp_path_factory.mktemp("draft_model")
    base = PRESETS["tiny-llama"]
    trunc = {**_params(), "layers": jax.tree.map(lambda x: x[:1], _params()["layers"])}
    other = dict(base, vocab_size=384, num_hidden_layers=1)
    other_params = random_params(arch_from_hf_config(other), seed=3, dtype=jnp.float32)
    return dict(
        target=_write_llama_dir(root / "target", base, _params()),
        trunc=_write_llama_dir(root / "trunc", dict(base, num_hidden_layers=1), trunc),
        vocab384=_write_llama_dir(root / "vocab384", other, other_params),
        mixtral="tiny-mixtral",
    )


def _dir_engine(target: str, draft: str | None, *, preemption: str = "recompute",
                warmup: str = "none", **cache) -> LLMEngine:  # fmt: skip
    """The test geometry above, on a checkpoint directory; draft: a separate draft."""
    spec = None
    if draft is not None:
        spec = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=K)
    cache = dict(block_size=BLOCK, enable_prefix_caching=True, **cache)
    cache.setdefault("num_gpu_blocks_override", NUM_BLOCKS)
    config = EngineConfig(
        model=ModelConfig(model=target, dtype="float32", max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
                                  watermark=0.0, preemption_mode=preemption),  # fmt: skip
        speculative=spec,
        warmup=warmup,
    )
    return LLMEngine.from_config(config, kv_fill_value=float("nan"))


def _dir_requests() -> list:
    """Chunked prompts (some over BUDGET), n = 2, a shared prompt (a prefix hit),
    max_tokens ending inside runs; with the small pool, preemption."""
    prompts = _prompts(12, 4, lo=6, hi=30)
    reqs = [(f"p{i}", p, _greedy(16 - 2 * i)) for i, p in enumerate(prompts)]
    reqs[1] = (reqs[1][0], reqs[1][1], _greedy(12, n=2))
    reqs += [(f"s{j}", prompts[2], _greedy(9)) for j in range(2)]  # s1 hits the cache
    return reqs


@functools.cache
def _dir_reference() -> dict:
    return _reference(_dir_requests())


@pytest.mark.tier2  # second tier (docs/testing.md): among the slowest of the default tier
@pytest.mark.parametrize("draft", ["trunc", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_separate_draft_greedy_equals_plain(draft_dirs, draft):
    """A separate draft with its own pool: greedy outputs equal the plain run across
    chunked prefill, recompute preemption, n = 2, a prefix hit and max_tokens mid-run,
    with the block invariants after every step; warmed up, the engine compiles nothing
    while generating (the draft's program traced once per bucket)."""
    reqs, ref = _dir_requests(), _dir_reference()
    engine = _dir_engine(draft_dirs["target"], draft_dirs[draft], warmup="all")
    warm = engine.stats()
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    s = engine.stats()
    assert s["spec_compilations"] == warm["spec_compilations"]
    assert s["compilations"] == warm["compilations"]
    assert set(engine.speculator.separate.trace_count.values()) == {1}
    assert s["spec_proposed_tokens"] > 0
    assert engine.num_preemptions > 0, "the pool was meant to force preemption"
    assert s["prefix_cache_hit_tokens"] > 0
    if draft == "trunc":  # partial runs: some drafts kept, some rejected
        assert 0 < s["spec_accepted_tokens"] < s["spec_proposed_tokens"]
    assert engine.num_free_blocks() == engine.num_usable_blocks()
    d = engine.speculator.separate
    assert d.kv[0].shape[:4] == (d.arch.num_layers, engine.num_blocks, d.arch.num_kv_heads,
                                 BLOCK)  # fmt: skip


@pytest.mark.tier2  # second tier (docs/testing.md): 24-28 s cold
@pytest.mark.parametrize("preemption", ["swap", pytest.param("recompute", marks=pytest.mark.slow)])
def test_draft_equal_to_target_accepts_everything(draft_dirs, preemption):
    """The target's own directory as its draft: every draft is accepted, through
    preemption (swap moves the draft pool's blocks too: a stale or missing draft row
    would show as a rejection), prefix hits and chunked prefill."""
    reqs, ref = _dir_requests(), _dir_reference()
    # 16 blocks: the scheduler budgets the drafts' slots before admissions (vLLM's
    # lookahead slots), so the test's 24-block pool no longer forces a preemption.
    engine = _dir_engine(draft_dirs["target"], draft_dirs["target"], preemption=preemption,
                         num_gpu_blocks_override=16)  # fmt: skip
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    s = engine.stats()
    assert s["spec_proposed_tokens"] > 0
    assert s["spec_acceptance_rate"] == 1.0
    assert s["spec_mean_accepted_length"] == pytest.approx(
        1 + s["spec_proposed_tokens"] / s["spec_rows"]
    )
    if preemption == "swap":
        assert s["swapped_out_blocks"] > 0 and s["swapped_in_blocks"] > 0
    else:
        assert engine.num_preemptions > 0
    assert engine.num_free_blocks() == engine.num_usable_blocks()


def test_draft_pool_counted_in_kv_budget(draft_dirs):
    """The same KV memory gives fewer blocks with a draft: both pools fit in it."""
    budget = 64 * 1024
    plain = _dir_engine(draft_dirs["target"], None, num_gpu_blocks_override=None,
                        kv_cache_memory_bytes=budget)  # fmt: skip
    spec = _dir_engine(draft_dirs["target"], draft_dirs["trunc"], num_gpu_blocks_override=None,
                       kv_cache_memory_bytes=budget)  # fmt: skip
    nbytes = lambda kv: sum(p.nbytes for p in jax.tree.leaves(kv))
    per_block = nbytes(plain.kv) // plain.num_blocks
    draft_per_block = nbytes(spec.speculator.separate.kv) // spec.num_blocks
    assert spec.num_blocks == budget // (per_block + draft_per_block) < plain.num_blocks
    assert nbytes(spec.kv) + nbytes(spec.speculator.separate.kv) <= budget


def test_separate_draft_refusals(draft_dirs):
    """Vocabulary mismatch (both sizes named), missing checkpoint (before loading), a
    layer-skip key on another model, model "self" without draft_num_layers."""
    with pytest.raises(ValueError, match=r"vocab384' has vocab_size 384, the target .* has 512"):
        _dir_engine(draft_dirs["target"], draft_dirs["vocab384"])
    with pytest.raises(FileNotFoundError, match="'/nowhere': no draft checkpoint"):
        _dir_engine(draft_dirs["target"], "/nowhere")
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN),
        speculative=SpeculativeConfig(method="draft_model", model="other", draft_num_layers=1),
    )
    with pytest.raises(ValueError, match="layer-skip draft"):
        LLMEngine.from_config(config)
    with pytest.raises(ConfigError, match="draft_num_layers"):
        SpeculativeConfig(method="draft_model", model="self")


def test_tokenizer_mismatch_refused(tmp_path):
    """Equal vocab sizes, different ids for the same text: refused, naming both."""
    import json
    import shutil

    from pagedjax.engine.spec.draft_model import check_same_vocab
    from pagedjax.tokenizer import HFTokenizer
    from tests.model_helpers import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    spec = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["T"], vocab["h"] = vocab["h"], vocab["T"]  # same size, two ids swapped
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(spec))
    a, b = HFTokenizer(tmp_path / "a"), HFTokenizer(tmp_path / "b")
    check_same_vocab(("target", ARCH, a), ("draft", ARCH, HFTokenizer(tmp_path / "a")))
    with pytest.raises(ValueError, match="'draft' and target 'target'.*different tokenizers"):
        check_same_vocab(("target", ARCH, a), ("draft", ARCH, b))
