"""EAGLE-style draft head (engine/spec/eagle.py, model/eagle.py).

Exactness does not depend on the head's quality (verification is the target's), so a
randomly initialised head on the tiny random Llama is enough for: greedy outputs equal
the plain run across chunked prefill and preemption, the block invariants after every
step, a warmed-up engine compiling nothing. The head's own bookkeeping (its KV pool
under the target's block tables, the catch-up over committed positions, rollback) is
checked directly: after every step the per-slot feature the next proposal starts from
equals a from-scratch dense recomputation of the head over the committed tokens.
Bad head directories fail with errors naming the problem.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.attention import PAD_SLOT, ragged_paged_attention
from pagedjax.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.spec.eagle import forward_with_features
from pagedjax.model import ModelInput, preset_arch
from pagedjax.model.eagle import EagleConfig, EagleHead, init_head, load_head, save_head
from pagedjax.scheduler import RUNNING
from pagedjax.tokenizer import ByteTokenizer
from tests.test_speculative import (
    ARCH,
    BLOCK,
    BUDGET,
    MAX_LEN,
    MAX_SEQS,
    NUM_BLOCKS,
    K,
    _assert_same,
    _drain,
    _greedy,
    _params,
    _prompts,
    _reference,
    check_memory,
)


@functools.cache
def _head_dir(tmp: str) -> str:
    cfg = EagleConfig.for_target(ARCH, target="tiny-llama")
    save_head(tmp, cfg, init_head(cfg, ARCH, seed=1, std=0.1))
    return tmp


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return _head_dir(str(tmp_path_factory.mktemp("eagle_head")))


# A quarter of the ids, never the tiny model's own favourite continuations by design.
SUBSET = np.sort(np.random.default_rng(5).choice(ARCH.vocab_size, ARCH.vocab_size // 4,
                                                 replace=False)).astype(np.int32)  # fmt: skip


@pytest.fixture(scope="module")
def subset_head_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eagle_subset")
    cfg = EagleConfig.for_target(ARCH, target="tiny-llama")
    cfg = dataclasses.replace(cfg, draft_vocab_size=len(SUBSET))
    save_head(tmp, cfg, init_head(cfg, ARCH, seed=1, std=0.1), draft_vocab=SUBSET)
    return str(tmp)


def _config(head: str, warmup: str = "none", **cache) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                          enable_prefix_caching=True, **cache),  # fmt: skip
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
                                  watermark=0.0),  # fmt: skip
        speculative=SpeculativeConfig(method="eagle", model=head, num_speculative_tokens=K),
        warmup=warmup,
    )


def _engine(head: str, warmup: str = "none") -> LLMEngine:
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    return LLMEngine(ARCH, _params(), tok, _config(head, warmup), kv_fill_value=float("nan"))


@functools.partial(jax.jit, static_argnames=("head_arch",))
def _dense_head(params, head_params, tokens, n, *, head_arch):
    """The target's features over tokens[:n] (int32[MAX_LEN], padded) on a fresh pool,
    then the head with next tokens tokens[1:n+1]; returns g at position n - 1."""
    t = MAX_LEN
    nb = t // BLOCK + 1
    pos = jnp.arange(t, dtype=jnp.int32)
    inp = ModelInput(
        tokens=tokens, positions=jnp.where(pos < n, pos, 0),
        slot_mapping=jnp.where(pos < n, BLOCK + pos, PAD_SLOT),
        block_tables=jnp.arange(1, nb, dtype=jnp.int32)[None],
        kv_lens=n[None], cu_q_lens=jnp.stack([jnp.int32(0), n]), logits_indices=n[None] - 1,
    )  # fmt: skip
    shape = (ARCH.num_layers, nb, ARCH.num_kv_heads, BLOCK, ARCH.head_dim)
    kv = (jnp.zeros(shape), jnp.zeros(shape))
    _, _, feats = forward_with_features(params, kv, inp, arch=ARCH,
                                        attention_fn=ragged_paged_attention)  # fmt: skip
    hkv = (jnp.zeros((1, *shape[1:])),) * 2
    module = EagleHead(head_arch, attention_fn=ragged_paged_attention)
    nxt_ids = jnp.concatenate([tokens[1:], jnp.zeros((1,), jnp.int32)])
    nxt = jnp.take(params["embed_tokens"]["embedding"], nxt_ids, axis=0)
    _, g = module.apply({"params": head_params}, hkv, feats, nxt, inp)
    return g[n - 1]


def _dense_head_feature(engine: LLMEngine, ids: list[int]) -> np.ndarray:
    """g_{L-2} for committed tokens ids (length L), recomputed from scratch."""
    e = engine.speculator.eagle
    tokens = jnp.asarray(ids + [0] * (MAX_LEN - len(ids)), jnp.int32)
    n = jnp.int32(len(ids) - 1)
    g = _dense_head(_params(), e.params["head"], tokens, n, head_arch=e.head_arch)
    return np.asarray(g)


def _check_head_features(engine: LLMEngine) -> int:
    """Assert every decoding sequence's head feature equals the head run from scratch
    over its committed tokens; returns how many sequences were checked."""
    st = jax.device_get(engine.state)
    checked = 0
    for s in np.flatnonzero(st.status == RUNNING):
        done = int(st.prompt_len[s] + st.output_len[s])
        if st.num_computed[s] != done - 1:
            continue  # prompt still prefilling
        ids = [int(t) for t in np.asarray(engine.core.device.tokens[s, :done])]
        np.testing.assert_allclose(np.asarray(engine.speculator.eagle.feature[s]),
                                   _dense_head_feature(engine, ids), rtol=1e-4, atol=1e-4)
        checked += 1
    return checked


def test_eagle_greedy_equals_plain_with_chunking_and_preemption(head_dir):
    """Prompts over the token budget (chunked) and a pool small enough to preempt."""
    prompts = dict(enumerate(_prompts(11, 4, lo=12, hi=26)))  # 18, 14, 19, 25
    reqs = [(str(i), p, _greedy(24)) for i, p in prompts.items()]
    ref = _reference(reqs)
    if any(len(r.outputs[0].token_ids) < 24 for r in ref.values()):
        pytest.xfail("the plain run finished a request for capacity (see test_speculative)")
    engine = _engine(head_dir)
    engine.reset_stats()
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    s = engine.stats()
    assert engine.num_preemptions > 0, "the pool was meant to force preemption"
    assert s["spec_proposed_tokens"] > 0 and s["spec_steps"] > 0
    assert 0.0 <= s["spec_acceptance_rate"] <= 1.0
    assert engine.num_free_blocks() == engine.num_usable_blocks()


@pytest.mark.slow  # CI budget: the greedy / preemption test is the fast guard
def test_eagle_head_state_matches_dense_recomputation(head_dir):
    """After every step of a lone request (chunked prompt, then speculative decode steps
    with rollbacks), the feature its next proposal starts from equals the head run from
    scratch over the committed tokens: the head's KV under the target's block tables
    and the catch-up over committed positions are right."""
    engine = _engine(head_dir)
    prompt = _prompts(12, 1, lo=30, hi=31)[0]  # 30 tokens: two chunks of <= 16
    engine.add_request("solo", prompt, _greedy(20))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        checked += _check_head_features(engine)
    assert checked >= 3
    assert engine.stats()["spec_proposed_tokens"] > 0


@pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles
def test_eagle_compiles_nothing_after_warm_up(head_dir):
    prompts = dict(enumerate(_prompts(13, 4, lo=5, hi=30)))
    reqs = [(str(i), p, _greedy(12)) for i, p in prompts.items()]
    engine = _engine(head_dir, warmup="all")
    warm = engine.stats()
    _drain(engine, reqs)
    s = engine.stats()
    assert s["spec_proposed_tokens"] > 0
    assert s["spec_compilations"] == warm["spec_compilations"]
    assert s["compilations"] == warm["compilations"]
    assert set(engine.speculator.eagle.trace_count.values()) == {1}
    assert set(engine.speculator.verifier.trace_count.values()) == {1}


def test_bad_head_directories_named(head_dir, tmp_path):
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    with pytest.raises(FileNotFoundError, match="no eagle head directory"):
        LLMEngine.from_config(_config(str(tmp_path / "missing")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="lacks config.json"):
        LLMEngine(ARCH, _params(), tok, _config(str(empty)))
    # A head for another hidden size.
    other = dataclasses.replace(ARCH, hidden_size=32, head_dim=8)
    wrong = tmp_path / "wrong"
    cfg = EagleConfig.for_target(other)
    save_head(wrong, cfg, init_head(cfg, other))
    with pytest.raises(ValueError, match="hidden_size 32 does not match the target's 64"):
        LLMEngine(ARCH, _params(), tok, _config(str(wrong)))
    # Unknown keys in config.json.
    bad = tmp_path / "bad"
    cfg = EagleConfig.for_target(ARCH)
    save_head(bad, cfg, init_head(cfg, ARCH))
    data = json.loads((bad / "config.json").read_text()) | {"num_layers": 2}
    (bad / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"unknown keys \['num_layers'\]"):
        load_head(bad, ARCH)
    # Quantized KV is refused by name.
    engine = LLMEngine(ARCH, _params(), tok, _config(head_dir, cache_dtype="fp8"))
    with pytest.raises(NotImplementedError, match="eagle' with a quantized KV cache"):
        engine.speculator.eagle.ensure(engine.core)  # at warm-up or the first step


def test_head_round_trips(head_dir):
    cfg, params, vocab = load_head(head_dir, ARCH)
    assert cfg == EagleConfig.for_target(ARCH, target="tiny-llama") and vocab is None
    want = init_head(cfg, ARCH, seed=1, std=0.1)
    jax.tree.map(np.testing.assert_array_equal, params, want)
    assert preset_arch("tiny-llama") == ARCH


@pytest.mark.slow  # CI budget: the greedy / preemption test is the fast guard
def test_training_loss_falls():
    """train_eagle's teacher forcing and loss on the tiny model: a few Adam steps on two
    sequences lower the loss and raise the teacher-forced top-1 agreement."""
    optax = pytest.importorskip("optax")
    from pagedjax.tools.train_eagle import make_loss, teacher_features

    params = _params()
    cfg = EagleConfig.for_target(ARCH)
    hp = init_head(cfg, ARCH)
    seqs = _prompts(3, 2, lo=24, hi=32)
    F = teacher_features(ARCH, params, seqs, 32, rows=2)
    assert F.shape == (2, 32, ARCH.hidden_size)
    X = np.zeros((2, 32), np.int32)
    for i, s in enumerate(seqs):
        X[i, : len(s)] = s
    N = np.asarray([len(s) for s in seqs], np.int32)
    loss_fn = make_loss(ARCH, cfg.head_arch(ARCH), 2, 32, ce_weight=0.1)
    vocab = np.arange(0, ARCH.vocab_size, 2, dtype=np.int32)  # a truncated vocabulary
    t2d = np.full(ARCH.vocab_size, -1, np.int32)
    t2d[vocab] = np.arange(len(vocab))
    tp = {"embed_tokens": params["embed_tokens"], "t2d": jnp.asarray(t2d),
          "lm": params["lm_head"]["kernel"][:, vocab].T}  # fmt: skip
    opt = optax.adam(3e-3)
    state = opt.init(hp)
    start = jnp.zeros((2,), jnp.int32)

    @jax.jit
    def step(hp, state):
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(hp, tp, F, X, N, start)
        upd, state = opt.update(g, state, hp)
        return optax.apply_updates(hp, upd), state, loss, aux[2] / aux[3]

    _, _, first, top_first = step(hp, state)
    for _ in range(40):
        hp, state, loss, top1 = step(hp, state)
    assert float(loss) < 0.5 * float(first)
    assert float(top1) > float(top_first)


@pytest.mark.slow  # CI budget: the greedy / preemption test is the fast guard
def test_training_attention_equals_the_paged_one():
    """The head is trained with train_eagle's dense attention and served with the paged
    backends: on the training layout both give the same outputs."""
    from pagedjax.tools.train_eagle import BLOCK as TB
    from pagedjax.tools.train_eagle import dense_causal_attention, pool, ragged_rows

    cfg = EagleConfig.for_target(ARCH)
    arch = cfg.head_arch(ARCH)
    hp = init_head(cfg, ARCH, seed=2, std=0.2)
    rows, length = 3, 2 * TB
    inp = ragged_rows(rows, length)
    x = jax.random.normal(jax.random.key(0), (2, rows * length, ARCH.hidden_size))
    outs = []
    for fn in (dense_causal_attention, ragged_paged_attention):
        kv = pool(1, rows * length // TB + 1, arch.num_kv_heads, arch.head_dim)
        outs.append(EagleHead(arch, attention_fn=fn).apply({"params": hp}, kv, x[0], x[1], inp)[1])
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_truncated_vocab_round_trip_and_refusals(subset_head_dir, tmp_path):
    cfg, params, vocab = load_head(subset_head_dir, ARCH)
    assert cfg.draft_vocab_size == len(SUBSET)
    np.testing.assert_array_equal(vocab, SUBSET)
    assert vocab.dtype == np.int32
    base = EagleConfig.for_target(ARCH)
    hp = init_head(base, ARCH)
    with pytest.raises(ValueError, match="needs the draft_vocab ids"):
        save_head(tmp_path / "a", dataclasses.replace(base, draft_vocab_size=4), hp)
    sized = dataclasses.replace(base, draft_vocab_size=3)
    with pytest.raises(ValueError, match="distinct and ascending"):
        save_head(tmp_path / "b", sized, hp, draft_vocab=np.asarray([5, 3, 9]))
    with pytest.raises(ValueError, match="ids outside"):
        save_head(tmp_path / "c", sized, hp, draft_vocab=np.asarray([1, 2, ARCH.vocab_size]))
    with pytest.raises(ValueError, match=r"expected int32\[3\]"):
        save_head(tmp_path / "d", sized, hp, draft_vocab=np.asarray([1, 2]))
    # config.json and the file disagree: named at load.
    save_head(tmp_path / "e", sized, hp, draft_vocab=np.asarray([1, 2, 3]))
    data = json.loads((tmp_path / "e" / "config.json").read_text()) | {"draft_vocab_size": 0}
    (tmp_path / "e" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="draft_vocab tensor present"):
        load_head(tmp_path / "e", ARCH)


@pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles
def test_truncated_vocab_greedy_equals_plain_and_drafts_stay_inside(subset_head_dir):
    """A head with a quarter of the vocabulary: outputs equal the plain run, and every
    token the proposal program writes is an id of the subset."""
    prompts = dict(enumerate(_prompts(21, 3, lo=6, hi=20)))
    reqs = [(str(i), p, _greedy(16)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _engine(subset_head_dir)
    e = engine.speculator.eagle
    propose, drafted = e.propose, []

    def spy(*args, **kw):
        kv, tokens = propose(*args, **kw)
        sid, total, counts = (np.asarray(a) for a in args[6:9])
        tok = np.asarray(tokens)
        for r in range(kw["num_seqs"]):
            if sid[r] >= 0:
                drafted.extend(tok[sid[r], total[r] : total[r] + counts[r]].tolist())
        return kv, tokens

    e.propose = spy
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    assert len(drafted) > 0 and set(drafted) <= set(SUBSET.tolist())
    assert e.params["lm"].shape == (len(SUBSET), ARCH.hidden_size)


def test_training_prompts_and_draft_vocabulary():
    from pagedjax.eval.chat import QUESTIONS
    from pagedjax.tools.train_eagle import draft_vocabulary, training_prompts

    qs = training_prompts(300, seed=0)
    assert len(set(qs)) == 300 and not set(qs) & set(QUESTIONS)
    assert training_prompts(300, seed=0) == qs
    v = draft_vocabulary([[5, 5, 7], [7, 5, 9, 2]], 2, 16)
    np.testing.assert_array_equal(v, [5, 7])
    np.testing.assert_array_equal(draft_vocabulary([[3, 1]], 8, 16), [1, 3])  # seen ids only
    assert len(draft_vocabulary([[3]], 0, 16)) == 16


def _variant(head: str, **changes) -> EngineConfig:
    """_config(head) with cache / scheduler fields replaced (``cache__x`` / ``sched__x``)."""
    cfg = _config(head)
    cache = {k[7:]: v for k, v in changes.items() if k.startswith("cache__")}
    sched = {k[7:]: v for k, v in changes.items() if k.startswith("sched__")}
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, **cache),
                               scheduler=dataclasses.replace(cfg.scheduler, **sched))  # fmt: skip


def _tok() -> ByteTokenizer:
    return ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)


def test_head_pool_counted_in_kv_budget(head_dir):
    """The same KV memory gives fewer blocks with a head: both pools fit in it."""
    budget = 64 * 1024
    cfg = _variant(head_dir, cache__num_gpu_blocks_override=None,
                   cache__kv_cache_memory_bytes=budget)  # fmt: skip
    plain = LLMEngine(ARCH, _params(), _tok(), dataclasses.replace(cfg, speculative=None))
    spec = LLMEngine(ARCH, _params(), _tok(), cfg)
    spec.speculator.eagle.ensure(spec.core)
    nbytes = lambda kv: sum(p.nbytes for p in jax.tree.leaves(kv))
    per_block = nbytes(plain.kv) // plain.num_blocks
    head_per_block = nbytes(spec.speculator.eagle.kv) // spec.num_blocks
    assert spec.num_blocks == budget // (per_block + head_per_block) < plain.num_blocks
    assert nbytes(spec.kv) + nbytes(spec.speculator.eagle.kv) <= budget


@pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles
def test_swap_moves_the_head_pool(head_dir):
    """Under swap preemption, every decoding sequence's head feature still equals the
    head run from scratch over its committed tokens, after swap-ins too: the head's
    blocks were copied out and back with the target's (a stale head row would change
    the feature; the outputs alone could not tell, verification keeps them right)."""
    engine = LLMEngine(ARCH, _params(), _tok(), _variant(head_dir, sched__preemption_mode="swap"))
    swaps_in = []
    mirror = engine.speculator.apply_swaps

    def spy(plan, host):
        swaps_in.append(int(host["num_in"]))
        return mirror(plan, host)

    engine.speculator.apply_swaps = spy
    prompts = dict(enumerate(_prompts(11, 4, lo=12, hi=26)))
    for i, p in prompts.items():
        engine.add_request(str(i), p, _greedy(24))
    checked_after_swap = 0
    while engine.has_unfinished_requests():
        engine.step()
        checked = _check_head_features(engine)
        checked_after_swap += checked if sum(swaps_in) > 0 else 0
    assert engine.num_preemptions > 0 and sum(swaps_in) > 0, "the pool was meant to swap"
    assert checked_after_swap >= 3
