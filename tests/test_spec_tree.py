"""Draft trees verified in one step (engine/spec/tree.py, ngram_tree.py; issue 36 item 1).

Greedy outputs with trees equal a plain run's (the n-gram tree proposer and an oracle
tree whose right branch sits behind a decoy, so off-path nodes are verified and
compacted away), through chunked prefill and preemption, with the block invariants
checked after every step and every block free at the end; a tree that is a chain gives
the chain engine's outputs and accepted counts; the KV the compaction leaves for every
accepted token equals what the plain run wrote there (fp32 tolerance); the tree mask
words against a brute-force oracle; the proposer; the refusals. EAGLE-2's dynamic tree
(eagle_tree.py, ``tree.dynamic``): its level expansion against brute force, its config,
and (slow) its parents, exactness, the verification following the device's parents, a
draft vocabulary, warm-up.

The attention backend is the default (on CPU the native kernel with its tree mask,
tests/test_tree_attention_native.py).
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
    DraftTreeConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.spec.ngram_tree import NgramTreeProposer
from pagedjax.engine.spec.tree import check_tree_model, node_depths, node_words
from pagedjax.model import preset_arch
from pagedjax.tokenizer import ByteTokenizer
from tests.test_speculative import (
    ARCH,
    BLOCK,
    BUDGET,
    MAX_LEN,
    MAX_SEQS,
    NUM_BLOCKS,
    _assert_same,
    _drain,
    _greedy,
    _params,
    _prompts,
    _refs,
    check_memory,
)

DEPTH = 4
BACKEND = "auto"  # on CPU the native kernel (its tree mask: test_tree_attention_native.py)


@functools.cache
def _engine(tree: tuple[int, int] | None, spec: bool = True, warmup: str = "none") -> LLMEngine:
    """tree: (budget, top_k) or None (chains); spec False: no speculation."""
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                          enable_prefix_caching=True),  # fmt: skip
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
                                  watermark=0.0),  # fmt: skip
        speculative=SpeculativeConfig(
            method="ngram", num_speculative_tokens=DEPTH, prompt_lookup_max=3,
            prompt_lookup_min=1,
            tree=None if tree is None else DraftTreeConfig(budget=tree[0], top_k=tree[1]),
        ) if spec else None,  # fmt: skip
        attention_backend=BACKEND,
        warmup=warmup,
    )
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    return LLMEngine(ARCH, _params(), tok, config, kv_fill_value=float("nan"))


class OracleTree:
    """A tree per row: a decoy branch first (the right continuation with its first token
    changed), then the reference continuation with every ``bad``-th token corrupted, then
    a sibling under the first right node; chains for unknown prefixes: none."""

    def __init__(self, refs: list[list[int]], bad: int = 3):
        self.refs, self.bad = refs, bad

    def propose_tree(self, ids, depth: int, budget: int | None = None):
        ids = list(ids)
        for full in self.refs:
            if len(full) > len(ids) and full[: len(ids)] == ids:
                right = [(t + 1) % ARCH.vocab_size if (len(ids) + j) % self.bad == 0 else t
                         for j, t in enumerate(full[len(ids): len(ids) + depth])]  # fmt: skip
                decoy = [(right[0] + 7) % ARCH.vocab_size] + right[1:2]
                extra = [(right[1] + 5) % ARCH.vocab_size] if len(right) > 1 else []
                toks = decoy + right + extra
                pars = [-1, 0][: len(decoy)]
                pars += [-1] + list(range(len(decoy), len(decoy) + len(right) - 1))
                pars += [len(decoy)] * len(extra)
                cap = len(toks) if budget is None else max(min(budget, len(toks)), 0)
                return toks[:cap], pars[:cap]
        return [], []


def _reference(reqs) -> dict:
    return _drain(_engine(None, spec=False), reqs)


# ---------------------------------------------------------------------------- units


def _oracle_words(parents: list[int]) -> list[int]:
    """Bit d of node i's word: the key d slots back is visible (root at slot -1)."""
    words = []
    for i in range(len(parents)):
        anc, a = {i}, parents[i]
        while a >= 0:
            anc.add(a)
            a = parents[a]
        w = 0
        for d in range(32):
            key = i - d  # node index; -1 = root, below: prefix
            if key < 0 or key in anc:
                w |= 1 << d
        words.append(w)
    return words


def test_tree_words_and_depths_match_an_oracle():
    rng = np.random.default_rng(0)
    k = 31
    rows = []
    for _ in range(6):
        rows.append([-1] + [int(rng.integers(-1, i)) for i in range(1, k)])
    rows.append(list(range(-1, k - 1)))  # a chain
    parents = jnp.asarray(rows, jnp.int32)
    depth, anc = node_depths(parents)
    words = np.asarray(node_words(anc))
    for r, par in enumerate(rows):
        assert words[r].tolist() == _oracle_words(par), r
        for i, p in enumerate(par):
            assert int(depth[r, i]) == (1 if p < 0 else int(depth[r, p]) + 1)
    # A chain's nodes see every key: the causal rule, bit for bit.
    assert (words[-1] == np.uint32(0xFFFFFFFF)).all()


def test_ngram_tree_proposer():
    p = NgramTreeProposer(1, 2, budget=8, top_k=3)
    ids = [1, 2, 3, 1, 2, 4, 5, 1, 2]
    toks, pars = p.propose_tree(ids, 3)
    # (1, 2) followed by (4, 5, 1) latest, then (3, 1, 2); then n = 1: (2,) -> same ones.
    assert toks[:3] == [4, 5, 1] and pars[:3] == [-1, 0, 1]
    assert toks[3:6] == [3, 1, 2] and pars[3:6] == [-1, 3, 4]
    # The first branch is the chain proposal.
    from pagedjax.engine.spec.ngram import NgramProposer
    assert toks[:3] == NgramProposer(1, 2).propose(ids, 3)
    assert p.propose_tree(ids, 3, budget=4) == ([4, 5, 1, 3], [-1, 0, 1, -1])
    assert p.propose_tree([1, 2, 3], 3) == ([], [])
    # Siblings are distinct; parents come first.
    toks, pars = NgramTreeProposer(1, 1, 16, 4).propose_tree([5, 6, 5, 6, 5, 7, 5], 2)
    seen = set()
    for t, q in zip(toks, pars, strict=True):
        assert (q, t) not in seen and q < len(seen) + 1
        seen.add((q, t))


def test_tree_config_and_refusals():
    c = SpeculativeConfig.from_dict({"method": "ngram", "tree": {"budget": 8, "top_k": 2}})
    assert c.tree == DraftTreeConfig(8, 2)
    with pytest.raises(ConfigError, match="unknown key speculative_config.tree.width"):
        SpeculativeConfig.from_dict({"method": "ngram", "tree": {"width": 3}})
    with pytest.raises(ConfigError, match="tree.budget"):
        SpeculativeConfig.from_dict({"method": "ngram", "tree": {"budget": 32}})
    with pytest.raises(ConfigError, match="ngram, eagle and eagle3 methods"):
        SpeculativeConfig(method="medusa", model="/x", tree=DraftTreeConfig())
    with pytest.raises(ConfigError, match="sampled drafts"):
        SpeculativeConfig(method="eagle", model="/x", tree=DraftTreeConfig(),
                          draft_sample_method="probabilistic")
    for method in ("eagle", "eagle3"):
        with pytest.raises(ConfigError, match="budget >= top_k"):
            SpeculativeConfig(method=method, model="/x", tree=DraftTreeConfig(2, 3))
    # the automatic rule sizes trees by levels now (k_schedule.allocate_levels): accepted
    for method, model in (("ngram", None), ("eagle", "/x")):
        SpeculativeConfig(method=method, model=model, tree=DraftTreeConfig(),
                          auto_num_speculative_tokens=True)  # fmt: skip
    with pytest.raises(ValueError, match="sliding-window"):
        check_tree_model(preset_arch("mistral-7b"))
    check_tree_model(ARCH)


# ---------------------------------------------------------------------------- engine


# In CI (second tier) with the right branch behind a decoy: the tree path, the mask,
# compaction and preemption in one engine (~20 s cold); the other case by hand.
@pytest.mark.parametrize(
    "bad", [pytest.param(2, marks=pytest.mark.slow), pytest.param(100, marks=pytest.mark.tier2)]
)
def test_oracle_tree_greedy_equals_plain_with_chunking_and_preemption(bad):
    prompts = dict(enumerate(_prompts(1, 4, lo=6, hi=40)))  # some over BUDGET: chunked
    reqs = [(str(i), p, _greedy(24)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _engine((8, 2))
    engine.speculator.tree_proposer = OracleTree(_refs(ref, prompts), bad=bad)
    engine.reset_stats()
    before = engine.num_preemptions
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    assert engine.num_preemptions > before, "the pool was meant to force preemption"
    s = engine.stats()
    assert s["spec_accepted_tokens"] > 0
    if bad == 100:  # the right branch sits behind a decoy: accepted through the tree
        assert s["spec_mean_accepted_length"] > 3.0, s
    assert engine.num_free_blocks() == engine.num_usable_blocks()


@pytest.mark.slow
def test_seeded_sampling_with_trees_equals_plain():
    """Per level the target is sampled at the parent with the plain run's key for that
    output position; the child with that token is accepted: seeded outputs unchanged."""
    from pagedjax.sampling import SamplingParams

    prompts = dict(enumerate(_prompts(3, 3, lo=6, hi=20)))
    reqs = [(str(i), p, SamplingParams(temperature=0.9, top_k=50, seed=10 + i, max_tokens=16,
                                       ignore_eos=True)) for i, p in prompts.items()]  # fmt: skip
    ref = _reference(reqs)
    engine = _engine((8, 2))
    engine.speculator.tree_proposer = OracleTree(_refs(ref, prompts), bad=100)
    engine.reset_stats()
    got = _drain(engine, reqs, on_step=check_memory)
    for rid, r in ref.items():
        assert got[rid].outputs[0].token_ids == r.outputs[0].token_ids, rid
    assert engine.stats()["spec_mean_accepted_length"] > 2.0


@pytest.mark.slow
def test_ngram_tree_greedy_equals_plain():
    prompts = dict(enumerate(_prompts(0, 4, lo=5, hi=40)))
    reqs = [(str(i), p, _greedy(20)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _engine((8, 3))
    engine.reset_stats()
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    assert engine.stats()["spec_proposed_tokens"] > 0
    assert engine.num_free_blocks() == engine.num_usable_blocks()


@pytest.mark.slow
def test_tree_of_one_branch_equals_chain():
    """top_k = 1: every tree is the chain proposal; outputs and counts equal the chain's."""
    prompts = dict(enumerate(_prompts(2, 3, lo=5, hi=30)))
    reqs = [(str(i), p, _greedy(16)) for i, p in prompts.items()]
    chain, tree = _engine(None), _engine((DEPTH, 1))
    chain.reset_stats()
    tree.reset_stats()
    a, b = _drain(chain, reqs), _drain(tree, reqs)
    for rid in a:
        assert a[rid].outputs[0].token_ids == b[rid].outputs[0].token_ids
    keys = ("spec_proposed_tokens", "spec_accepted_tokens", "spec_rows")
    assert {k: chain.stats()[k] for k in keys} == {k: tree.stats()[k] for k in keys}


def _kv_by_position(engine: LLMEngine, seen: dict) -> None:
    """Record each running sequence's KV (every layer, K and V) at each computed
    position the first time it is computed (by request id)."""
    st = jax.device_get(engine.state)
    k_pool, v_pool = (np.asarray(x) for x in jax.device_get(engine.kv))
    for slot, (req, _) in engine.core.book.slot_owner.items():
        n = int(st.num_computed[slot])
        table = st.mem.tables.tables[slot]
        rows = seen.setdefault(req.request_id, {})
        for pos in range(n):
            if pos not in rows:
                b, o = table[pos // BLOCK], pos % BLOCK
                rows[pos] = (k_pool[:, b, :, o].copy(), v_pool[:, b, :, o].copy())


@pytest.mark.slow
def test_compaction_leaves_the_plain_runs_kv():
    prompts = {0: [5, 6, 7, 8, 9, 10, 11]}  # no preemption: one sequence
    reqs = [("0", prompts[0], _greedy(24))]
    plain_kv, tree_kv = {}, {}
    ref = _drain(_engine(None, spec=False), reqs, on_step=lambda e: _kv_by_position(e, plain_kv))
    engine = _engine((8, 2))
    engine.speculator.tree_proposer = OracleTree(_refs(ref, prompts), bad=100)
    engine.reset_stats()
    got = _drain(engine, reqs, on_step=lambda e: _kv_by_position(e, tree_kv))
    _assert_same(ref, got)
    assert engine.stats()["spec_mean_accepted_length"] > 2.0  # paths behind the decoy
    a, b = plain_kv["0"], tree_kv["0"]
    assert len(b) >= 7 + 20 and set(b) <= set(a)
    for pos in sorted(b):
        for x, y in zip(a[pos], b[pos], strict=True):
            assert np.isfinite(y).all(), pos
            np.testing.assert_allclose(y, x, rtol=2e-4, atol=2e-5, err_msg=f"position {pos}")


@pytest.mark.slow
def test_tree_warm_up_covers_the_programs():
    """A warmed-up tree engine compiles nothing while generating; every verification
    program is traced once (one per bucket, whatever the trees' shapes)."""
    prompts = dict(enumerate(_prompts(6, 4, lo=5, hi=30)))
    reqs = [(str(i), p, _greedy(12)) for i, p in prompts.items()]
    engine = _engine((8, 3), warmup="all")
    warm = engine.stats()
    _drain(engine, reqs)
    assert engine.stats()["spec_proposed_tokens"] > 0
    assert engine.stats()["spec_compilations"] == warm["spec_compilations"]
    assert engine.stats()["compilations"] == warm["compilations"]
    assert set(engine.speculator.verifier.trace_count.values()) == {1}


# ---------------------------------------------------------------------------- EAGLE trees


def _eagle_tree_engine(head: str, top_k: int = 2, dynamic: bool = False,
                       warmup: str = "none") -> LLMEngine:  # fmt: skip
    from tests.test_spec_eagle import _config

    config = _config(head, warmup)
    tree = DraftTreeConfig(budget=8, top_k=top_k, dynamic=dynamic)
    spec = dataclasses.replace(config.speculative, tree=tree)
    config = dataclasses.replace(config, speculative=spec, attention_backend=BACKEND)
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    return LLMEngine(ARCH, _params(), tok, config, kv_fill_value=float("nan"))


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory):
    from tests.test_spec_eagle import _head_dir

    return _head_dir(str(tmp_path_factory.mktemp("eagle_tree_head")))


@pytest.mark.slow
def test_eagle_tree_greedy_equals_plain_with_chunking_and_preemption(eagle_head):
    """The head's own top-2 first tokens, each continued as a chain (eagle_tree.py)."""
    prompts = dict(enumerate(_prompts(11, 4, lo=12, hi=26)))
    reqs = [(str(i), p, _greedy(24)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _eagle_tree_engine(eagle_head)
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    s = engine.stats()
    assert engine.num_preemptions > 0, "the pool was meant to force preemption"
    assert s["spec_proposed_tokens"] > 0 and s["spec_steps"] > 0
    assert engine.num_free_blocks() == engine.num_usable_blocks()


def _oracle_branches(propose, refs: list[list[int]], branches: int, bad: int):
    """Wrap an EagleTreeDraft.propose: after the head's proposal, branch 0 becomes a decoy
    (the right first token changed) and branch 1 the reference continuation (every
    ``bad``-th token corrupted), so accepted paths run through nodes 1, 1 + b, ...: the
    compaction and the catch-up's feature remap are exercised whatever the head drafts."""

    def wrapped(params, target_params, draft_kv, feature, tokens, mem, sid, total, counts,
                *, num_seqs):  # fmt: skip
        draft_kv, tokens = propose(params, target_params, draft_kv, feature, tokens, mem, sid,
                                   total, counts, num_seqs=num_seqs)  # fmt: skip
        buf = np.array(jax.device_get(tokens))
        sid, total, counts = (np.asarray(x) for x in (sid, total, counts))
        for r in range(num_seqs):
            if sid[r] < 0 or counts[r] == 0:
                continue
            ids = buf[sid[r], : total[r]].tolist()
            full = next((f for f in refs if len(f) > len(ids) and f[: len(ids)] == ids), None)
            if full is None:
                continue
            for j in range(int(counts[r])):
                level, c = divmod(j, branches)
                pos = len(ids) + level
                right = full[pos] if pos < len(full) else 0
                if pos % bad == 0:
                    right = (right + 1) % ARCH.vocab_size
                tok = right if c == 1 else (right + 3 + c) % ARCH.vocab_size
                buf[sid[r], total[r] + j] = tok
        return draft_kv, jnp.asarray(buf)

    return wrapped


@pytest.mark.slow
def test_eagle_tree_catch_up_follows_the_accepted_branch(eagle_head):
    """Accepted paths through the second branch: outputs equal the plain run, and after
    every step each decoding sequence's head feature equals the head recomputed from
    scratch over its committed tokens (the catch-up read the path's features)."""
    from tests.test_spec_eagle import _check_head_features

    prompts = dict(enumerate(_prompts(12, 2, lo=14, hi=30)))
    reqs = [(str(i), p, _greedy(20)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _eagle_tree_engine(eagle_head)
    t = engine.speculator.eagle_tree
    t.propose = _oracle_branches(t.propose, _refs(ref, prompts), t.b, bad=100)
    checked = []

    def on_step(e):
        check_memory(e)
        checked.append(_check_head_features(e))

    got = _drain(engine, reqs, on_step=on_step)
    _assert_same(ref, got)
    assert sum(checked) > 5
    # (the counters directly: stats() counts compilations, and the wrapper is no jit)
    assert engine.speculator.counters.stats()["spec_mean_accepted_length"] > 2.0
    assert engine.num_free_blocks() == engine.num_usable_blocks()


@pytest.mark.slow
def test_eagle_tree_branches_are_blind_to_each_other(eagle_head):
    """The head's tree attention: branch 0 of a top-2 tree (nodes 0, 2, 4, 6) is exactly
    the head's chain proposal from the same state; branch 1 differs from it at its first
    token and has its own continuation (its queries see their own branch only)."""
    engine = _eagle_tree_engine(eagle_head)
    engine.add_request("solo", _prompts(13, 1, lo=14, hi=15)[0], _greedy(12))
    core = engine.core
    while not any(len(s.detok.ids) for _, s in core.book.slot_owner.values()):
        engine.step()
    engine.step()  # one decode step: the head's feature is the catch-up's
    (slot,) = core.book.slot_owner
    st = jax.device_get(engine.state)
    total = int(st.prompt_len[slot] + st.output_len[slot])
    spec, e = engine.speculator, engine.speculator.eagle
    n = MAX_SEQS
    sid = np.full(n, -1, np.int32)
    sid[0] = slot
    tot = np.zeros(n, np.int32)
    tot[0] = total
    mem = core.device.state.mem

    def run(fn, count):
        cnt = np.zeros(n, np.int32)
        cnt[0] = count
        kv = jax.tree.map(lambda x: jnp.array(x, copy=True), e.kv)
        toks = jnp.array(core.device.tokens, copy=True)
        out = fn(e.params, core.params, kv, e.feature, toks, mem, jnp.asarray(sid),
                 jnp.asarray(tot), jnp.asarray(cnt), num_seqs=n)  # fmt: skip
        return np.asarray(out[1][slot, total : total + count]), jax.device_get(out[0])

    (chain, chain_kv), (tree, tree_kv) = run(e.propose, 4), run(spec.eagle_tree.propose, 8)
    assert tree[0::2].tolist() == chain.tolist()
    assert tree[1] != tree[0]
    # The head's own KV: branch 0's entry at level l (slot position L - 1 + 2 l) equals
    # the chain's (L - 1 + l), which a query seeing branch 1's entries would not give.
    table = st.mem.tables.tables[slot]

    def at(pool, pos):
        return np.asarray(pool[:, table[pos // BLOCK], :, pos % BLOCK])

    for level in range(1, 3):
        for x, y in zip(chain_kv, tree_kv, strict=True):
            np.testing.assert_allclose(at(y, total - 1 + 2 * level), at(x, total - 1 + level),
                                       rtol=1e-5, atol=1e-6, err_msg=f"level {level}")


# ---------------------------------------------------------------------------- EAGLE-2 trees


def test_dynamic_tree_config_and_refusals():
    c = SpeculativeConfig.from_dict({"method": "eagle", "model": "/x", "tree": {
        "budget": 8, "top_k": 2, "dynamic": True}})  # fmt: skip
    assert c.tree == DraftTreeConfig(8, 2, dynamic=True)
    assert DraftTreeConfig().dynamic is False  # the default: the fixed branches
    with pytest.raises(ConfigError, match="tree.dynamic.*eagle method only"):
        SpeculativeConfig.from_dict({"method": "ngram", "tree": {"dynamic": True}})
    with pytest.raises(ConfigError, match="tree.dynamic.*eagle method only"):
        SpeculativeConfig(method="eagle3", model="/x", tree=DraftTreeConfig(dynamic=True))
    with pytest.raises(ConfigError, match="sampled drafts"):
        SpeculativeConfig(method="eagle", model="/x", tree=DraftTreeConfig(dynamic=True),
                          draft_sample_method="probabilistic")
    with pytest.raises(ConfigError, match="budget >= top_k"):
        SpeculativeConfig(method="eagle", model="/x", tree=DraftTreeConfig(2, 3, dynamic=True))
    with pytest.raises(ConfigError, match="tree.dynamic"):
        DraftTreeConfig(dynamic="yes")


def test_expand_level_keeps_the_best_cumulative_children():
    """EAGLE-2's level expansion against brute force over the b * b (parent, child)
    candidates: the b best by parent score + child log-softmax, best first."""
    from pagedjax.engine.spec.eagle_tree import expand_level

    rng = np.random.default_rng(3)
    s, b, n = 3, 3, 11
    score = np.sort(rng.normal(size=(s, b)), axis=1)[:, ::-1].astype(np.float32) - 2.0
    logits = rng.normal(size=(s, b, n)).astype(np.float32) * 3
    got_score, got_par, got_ids = (np.asarray(x) for x in expand_level(jnp.asarray(score),
                                                                       jnp.asarray(logits)))
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for r in range(s):
        cands = sorted(((score[r, p] + lp[r, p, t], p, t) for p in range(b) for t in range(n)
                        if t in np.argsort(-lp[r, p])[:b]), reverse=True)[:b]
        np.testing.assert_allclose(got_score[r], [c[0] for c in cands], rtol=1e-5)
        assert got_par[r].tolist() == [c[1] for c in cands]
        assert got_ids[r].tolist() == [c[2] for c in cands]
    # b = 1: the argmax child of the one node (the chain)
    one = expand_level(jnp.zeros((s, 1)), jnp.asarray(logits[:, :1]))
    assert np.asarray(one[2])[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()


@pytest.fixture(scope="module")
def dyn_engine(eagle_head):
    """One EAGLE-2 tree engine (budget 8, top 2) for this section's tests (each leaves it
    with no request): the compiled programs are shared."""
    return _eagle_tree_engine(eagle_head, dynamic=True)


def _one_decoding_row(engine: LLMEngine, seed: int) -> tuple[int, int]:
    """A single request stepped to its first decode step: (slot, total tokens)."""
    engine.add_request("solo", _prompts(seed, 1, lo=14, hi=15)[0], _greedy(12))
    core = engine.core
    while not any(len(s.detok.ids) for _, s in core.book.slot_owner.values()):
        engine.step()
    engine.step()  # one decode step: the head's feature is the catch-up's
    (slot,) = core.book.slot_owner
    st = jax.device_get(engine.state)
    return slot, int(st.prompt_len[slot] + st.output_len[slot])


def _oracle_crossed(propose, refs: list[list[int]], branches: int, bad: int):
    """Wrap the dynamic EagleTreeDraft.propose: its parents replaced by a crossed tree
    (level l + 1's node c under level l's node b - 1 - c, never the static layout's
    j - b) and its tokens by the reference continuation along the path from level 0's
    node 1 (every ``bad``-th token corrupted), decoys elsewhere. Only the device's
    parents make that path acceptable: verified with the static ones, a row would accept
    at most its first node (its static child is a decoy)."""

    def wrapped(params, target_params, draft_kv, feature, tokens, mem, sid, total, counts,
                *, num_seqs):  # fmt: skip
        draft_kv, tokens, parents = propose(params, target_params, draft_kv, feature, tokens,
                                            mem, sid, total, counts, num_seqs=num_seqs)  # fmt: skip
        buf = np.array(jax.device_get(tokens))
        par = np.array(jax.device_get(parents))
        sid, total, counts = (np.asarray(x) for x in (sid, total, counts))
        for r in range(num_seqs):
            if sid[r] < 0 or counts[r] == 0:
                continue
            ids = buf[sid[r], : total[r]].tolist()
            full = next((f for f in refs if len(f) > len(ids) and f[: len(ids)] == ids), None)
            if full is None:
                continue
            on_path = 1  # the path's branch at this level
            for j in range(int(counts[r])):
                level, c = divmod(j, branches)
                if c == 0 and level > 0:
                    on_path = branches - 1 - on_path
                par[r, j] = -1 if level == 0 else (level - 1) * branches + branches - 1 - c
                pos = len(ids) + level
                right = full[pos] if pos < len(full) else 0
                if pos % bad == 0:
                    right = (right + 1) % ARCH.vocab_size
                tok = right if c == on_path else (right + 3 + c) % ARCH.vocab_size
                buf[sid[r], total[r] + j] = tok
        return draft_kv, jnp.asarray(buf), jnp.asarray(par)

    return wrapped


@pytest.mark.slow  # an EAGLE tree engine (~24 s cold for the three)
def test_eagle_dynamic_tree_verifies_the_device_parents(dyn_engine):
    """The verification and the head's catch-up follow the proposal's parents (data),
    not the host's static layout: a crossed tree with the reference on its path gives
    long accepted runs, outputs equal to the plain run, and after every step each
    decoding sequence's head feature equals the head recomputed from scratch."""
    from tests.test_spec_eagle import _check_head_features

    prompts = dict(enumerate(_prompts(12, 2, lo=14, hi=30)))
    reqs = [(str(i), p, _greedy(20)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = dyn_engine
    t = engine.speculator.eagle_tree
    original = t.propose
    t.propose = _oracle_crossed(original, _refs(ref, prompts), t.b, bad=100)
    checked = []

    def on_step(e):
        check_memory(e)
        checked.append(_check_head_features(e))

    try:
        engine.speculator.reset_stats()
        got = _drain(engine, reqs, on_step=on_step)
    finally:
        t.propose = original
    _assert_same(ref, got)
    assert sum(checked) > 5
    assert engine.speculator.counters.stats()["spec_mean_accepted_length"] > 2.5
    assert engine.num_free_blocks() == engine.num_usable_blocks()


@pytest.mark.slow  # by hand: warm-up compiles every bucket
def test_eagle_dynamic_tree_compiles_nothing_after_warm_up(eagle_head):
    """Warm-up covers the dynamic tree's programs: its proposal at every head_rows size
    and the parents' scatter back to batch rows."""
    prompts = dict(enumerate(_prompts(13, 4, lo=5, hi=30)))
    reqs = [(str(i), p, _greedy(12)) for i, p in prompts.items()]
    engine = _eagle_tree_engine(eagle_head, dynamic=True, warmup="all")
    warm = engine.stats()
    _drain(engine, reqs)
    s = engine.stats()
    assert s["spec_proposed_tokens"] > 0
    assert s["spec_compilations"] == warm["spec_compilations"]
    assert s["compilations"] == warm["compilations"]
    assert set(engine.speculator.eagle_tree.trace_count.values()) == {1}


@pytest.mark.slow  # an EAGLE tree engine (~24 s cold for the three)
def test_eagle_dynamic_tree_greedy_equals_plain(dyn_engine):
    """EAGLE-2's dynamic tree (the device's parents verified) through chunked prefill and
    preemption: greedy outputs equal the plain run's, every block free at the end."""
    prompts = dict(enumerate(_prompts(11, 4, lo=12, hi=26)))
    reqs = [(str(i), p, _greedy(24)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = dyn_engine
    engine.reset_stats()
    preempted = engine.num_preemptions
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    s = engine.stats()
    assert engine.num_preemptions > preempted, "the pool was meant to force preemption"
    assert s["spec_proposed_tokens"] > 0 and s["spec_steps"] > 0
    assert engine.num_free_blocks() == engine.num_usable_blocks()


def _propose_once(engine: LLMEngine, fn, slot: int, total: int, count: int):
    """fn (a propose program) for one row (of two: the engine's own head_rows program
    when the dynamic tree's) on copies of the head KV and token buffer: (its count
    tokens, the rest of its outputs past the tokens)."""
    e, core, n = engine.speculator.eagle, engine.core, MAX_SEQS
    sid, tot, cnt = (np.zeros(n, np.int32) for _ in range(3))
    sid[:] = -1
    sid[0], tot[0], cnt[0] = slot, total, count
    kv = jax.tree.map(lambda x: jnp.array(x, copy=True), e.kv)
    toks = jnp.array(core.device.tokens, copy=True)
    out = fn(e.params, core.params, kv, e.feature, toks, core.device.state.mem,
             jnp.asarray(sid), jnp.asarray(tot), jnp.asarray(cnt), num_seqs=2)  # fmt: skip
    return np.asarray(out[1][slot, total : total + count]), out[2:]


@pytest.mark.slow  # an EAGLE tree engine (~24 s cold for the three)
def test_dynamic_tree_parents_are_a_level_major_tree(dyn_engine):
    """The EAGLE-2 proposal's parents (device data): -1 at level 0, else a node of the
    level before (so < the node), -1 past the row's count and on rows without drafts;
    distinct (parent, token) pairs; level 0 is the head's top b first tokens; with b = 1
    the dynamic tree is the head's chain (parents 0, 1, 2 ...)."""
    from pagedjax.engine.spec.eagle_tree import EagleTreeDraft

    engine = dyn_engine
    spec = engine.speculator
    assert spec.eagle_tree.dynamic and spec.k == 8
    slot, total = _one_decoding_row(engine, 13)
    b = 2
    toks, (par,) = _propose_once(engine, spec.eagle_tree.propose, slot, total, 7)
    par = np.asarray(par)
    assert par.shape == (2, 8) and (par[1] == -1).all()  # a row without drafts
    row = par[0]
    assert row[7] == -1  # past the count
    for j in range(7):
        level = j // b
        if level == 0:
            assert row[j] == -1
        else:
            assert 0 <= row[j] < j and row[j] // b == level - 1, (j, row.tolist())
    kids = [(row[j], toks[j]) for j in range(7)]
    assert len(set(kids)) == len(kids)  # distinct (parent, token): the walk is unambiguous
    e = spec.eagle
    logits, vocab = e.draft_logits(e.params, engine.core.params, e.feature[slot][None])
    assert vocab is None
    assert toks[:b].tolist() == np.argsort(-np.asarray(logits[0]), kind="stable")[:b].tolist()
    chain, _ = _propose_once(engine, e.propose, slot, total, 4)
    one, (one_par,) = _propose_once(engine, EagleTreeDraft(e, 1, 4, dynamic=True).propose,
                                    slot, total, 4)  # fmt: skip
    assert one.tolist() == chain.tolist()
    assert np.asarray(one_par)[0, :4].tolist() == [-1, 0, 1, 2]
    engine.abort_request("solo")
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.slow  # another EAGLE tree engine (a truncated-vocabulary head)
def test_dynamic_tree_with_a_draft_vocabulary(tmp_path_factory):
    """A head over a quarter of the vocabulary: the dynamic tree's log-probabilities are
    over the draft vocabulary and its ids mapped back, so every node is an id of the
    subset, outputs equal the plain run."""
    from pagedjax.model.eagle import EagleConfig, init_head, save_head
    from tests.test_spec_eagle import SUBSET

    head = str(tmp_path_factory.mktemp("eagle_subset_tree"))  # as test_spec_eagle's
    cfg = EagleConfig.for_target(ARCH, target="tiny-llama")
    cfg = dataclasses.replace(cfg, draft_vocab_size=len(SUBSET))
    save_head(head, cfg, init_head(cfg, ARCH, seed=1, std=0.1), draft_vocab=SUBSET)
    prompts = dict(enumerate(_prompts(21, 3, lo=6, hi=20)))
    reqs = [(str(i), p, _greedy(16)) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _eagle_tree_engine(head, dynamic=True)
    t = engine.speculator.eagle_tree
    propose, drafted = t.propose, []

    def spy(*args, **kw):
        kv, tokens, parents = propose(*args, **kw)
        sid, total, counts = (np.asarray(a) for a in args[6:9])
        tok = np.asarray(tokens)
        for r in range(kw["num_seqs"]):
            if sid[r] >= 0:
                drafted.extend(tok[sid[r], total[r] : total[r] + counts[r]].tolist())
        return kv, tokens, parents

    t.propose = spy
    got = _drain(engine, reqs, on_step=check_memory)
    _assert_same(ref, got)
    assert len(drafted) > 0 and set(drafted) <= set(SUBSET.tolist())
