"""Medusa heads as a speculative proposer (model/medusa.py, engine/spec/medusa.py).

The heads' forward equals a plain numpy re-derivation; both checkpoint layouts
(pagedjax's, vLLM's Medusa names) load to the same params, and bad directories fail
with errors naming the problem. Exactness does not depend on the heads (verification
is the target's), so random heads on the tiny random Llama are enough for: greedy
outputs equal the plain run across chunked prefill and preemption with the block
invariants after every step, and the per-slot feature each proposal starts from equals
the target's feature at L - 2 recomputed from scratch; seeded sampled requests equal
the plain run. Heads trained by train_medusa's self-distillation on the tiny model's
own greedy outputs have nonzero acceptance (printed).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

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
from pagedjax.model import ModelInput
from pagedjax.model.medusa import MedusaConfig, init_heads, load_heads, medusa_logits, save_heads
from pagedjax.sampling import SamplingParams
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

HEADS = 3  # < K: the engine drafts min(K, heads)


def _np_silu(x):
    return x / (1.0 + np.exp(-x))


def _np_medusa(params, f):
    """The heads by their definition, one head and one block at a time, in numpy."""
    w, b, lm = (np.asarray(params[k], np.float64) for k in ("w", "b", "lm_head"))
    out = []
    for i in range(w.shape[0]):
        y = np.asarray(f, np.float64)
        for r in range(w.shape[1]):
            y = y + _np_silu(y @ w[i, r] + b[i, r])
        out.append(y @ lm[i])
    return np.stack(out, axis=1)


def test_forward_equals_numpy_rederivation():
    cfg = MedusaConfig(hidden_size=16, vocab_size=40, num_heads=3, num_hidden_layers=2)
    p = init_heads(cfg, seed=3, std=0.3)
    p["b"] = 0.1 * jax.random.normal(jax.random.key(1), p["b"].shape)
    f = np.asarray(jax.random.normal(jax.random.key(2), (5, 16)))
    got = medusa_logits(p, jnp.asarray(f))
    assert got.shape == (5, 3, 40) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _np_medusa(p, f), rtol=1e-5, atol=1e-5)
    # No blocks: each head is its vocabulary projection of f.
    p0 = init_heads(dataclasses.replace(cfg, num_hidden_layers=0), seed=4)
    np.testing.assert_allclose(np.asarray(medusa_logits(p0, jnp.asarray(f))),
                               np.einsum("sh,nhv->snv", f, p0["lm_head"]), rtol=1e-5, atol=1e-5)


def _vllm_dir(path, cfg, params, *, bias, prefix="", shared=False, extra=None):
    """params written with vLLM's Medusa names (torch out x in layout)."""
    t = {}
    for i in range(cfg.num_heads):
        for r in range(cfg.num_hidden_layers):
            t[f"{prefix}blocks.{i}.layers.{r}.weight"] = np.asarray(params["w"][i, r]).T.copy()
            if bias:
                t[f"{prefix}blocks.{i}.layers.{r}.bias"] = np.asarray(params["b"][i, r])
        if i == 0 or not shared:
            t[f"{prefix}lm_heads.{i}.weight"] = np.asarray(params["lm_head"][i]).T.copy()
    t |= extra or {}
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    conf = {"model_type": "medusa", "architectures": ["MedusaModel"],
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_hidden_layers,
            "medusa_fc_bias": bias, "original_lm_head": shared, "truncated_vocab_size": None}
    (path / "config.json").write_text(json.dumps(conf))
    return path


def test_layouts_round_trip_and_refusals(tmp_path):
    cfg = MedusaConfig.for_target(ARCH, HEADS, 1, target="tiny-llama")
    p = init_heads(cfg, seed=1, std=0.1)
    p["b"] = p["b"] + 0.05
    own = save_heads(tmp_path / "own", cfg, p)
    c, got = load_heads(own, ARCH)
    assert c == cfg
    jax.tree.map(np.testing.assert_array_equal, got, p)
    # vLLM's names (with the medusa_heads. prefix some checkpoints carry), bias on.
    c, got = load_heads(_vllm_dir(tmp_path / "v", cfg, p, bias=True, prefix="medusa_heads."), ARCH)
    assert (c.num_heads, c.num_hidden_layers) == (HEADS, 1)
    jax.tree.map(np.testing.assert_array_equal, got, p)
    # No bias (vLLM's default), one shared LM head (original_lm_head).
    c, got = load_heads(_vllm_dir(tmp_path / "s", cfg, p, bias=False, shared=True), ARCH)
    np.testing.assert_array_equal(got["b"], 0)
    for i in range(HEADS):
        np.testing.assert_array_equal(got["lm_head"][i], p["lm_head"][0])
    # Refusals, by name.
    with pytest.raises(ValueError, match=r"unexpected tensor 'token_map'"):
        load_heads(_vllm_dir(tmp_path / "t", cfg, p, bias=False,
                             extra={"token_map": np.arange(4, dtype=np.int32)}), ARCH)  # fmt: skip
    with pytest.raises(ValueError, match=r"tensors \['blocks.0.layers.0.bias'.* missing"):
        d = _vllm_dir(tmp_path / "m", cfg, p, bias=False)
        conf = json.loads((d / "config.json").read_text()) | {"medusa_fc_bias": True}
        (d / "config.json").write_text(json.dumps(conf))
        load_heads(d, ARCH)
    d = _vllm_dir(tmp_path / "u", cfg, p, bias=False)
    (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text())
                                              | {"truncated_vocab_size": 100}))  # fmt: skip
    with pytest.raises(ValueError, match="truncated_vocab_size 100 .* not built"):
        load_heads(d, ARCH)
    (own / "config.json").write_text(json.dumps(dataclasses.asdict(cfg) | {"heads": 2}))
    with pytest.raises(ValueError, match=r"unknown keys \['heads'\]"):
        load_heads(own, ARCH)
    other = MedusaConfig(32, ARCH.vocab_size, 2)
    wrong = save_heads(tmp_path / "w", other, init_heads(other))
    with pytest.raises(ValueError, match="hidden_size 32 does not match the target's 64"):
        load_heads(wrong, ARCH)
    # vLLM's --speculative-config JSON, keys checked as every method's.
    sc = SpeculativeConfig.from_dict(json.loads(
        f'{{"method": "medusa", "model": "{own}", "num_speculative_tokens": 5}}'))
    assert (sc.method, sc.num_speculative_tokens) == ("medusa", 5)
    (tmp_path / "e").mkdir()
    with pytest.raises(FileNotFoundError, match="lacks config.json"):
        load_heads(tmp_path / "e", ARCH)
    with pytest.raises(FileNotFoundError, match="no medusa head directory"):
        LLMEngine.from_config(_config(str(tmp_path / "missing")))


@functools.cache
def _head_dir(tmp: str) -> str:
    cfg = MedusaConfig.for_target(ARCH, HEADS, 1, target="tiny-llama")
    save_heads(tmp, cfg, init_heads(cfg, seed=1, std=0.1))
    return tmp


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return _head_dir(str(tmp_path_factory.mktemp("medusa_heads")))


def _config(head: str, **spec) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                          enable_prefix_caching=True),  # fmt: skip
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
                                  watermark=0.0),  # fmt: skip
        speculative=SpeculativeConfig(method="medusa", model=head, num_speculative_tokens=K,
                                      **spec),  # fmt: skip
        warmup="none",
    )


def _engine(head: str, warmup: str = "none", **spec) -> LLMEngine:
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    config = dataclasses.replace(_config(head, **spec), warmup=warmup)
    return LLMEngine(ARCH, _params(), tok, config, kv_fill_value=float("nan"))


@jax.jit
def _dense_features(params, tokens, n):
    """The target's post-norm features over tokens[:n] (int32[MAX_LEN]) on a fresh pool."""
    nb = MAX_LEN // BLOCK + 1
    pos = jnp.arange(MAX_LEN, dtype=jnp.int32)
    inp = ModelInput(
        tokens=tokens, positions=jnp.where(pos < n, pos, 0),
        slot_mapping=jnp.where(pos < n, BLOCK + pos, PAD_SLOT),
        block_tables=jnp.arange(1, nb, dtype=jnp.int32)[None],
        kv_lens=n[None], cu_q_lens=jnp.stack([jnp.int32(0), n]), logits_indices=n[None] - 1,
    )  # fmt: skip
    shape = (ARCH.num_layers, nb, ARCH.num_kv_heads, BLOCK, ARCH.head_dim)
    kv = (jnp.zeros(shape), jnp.zeros(shape))
    return forward_with_features(params, kv, inp, arch=ARCH,
                                 attention_fn=ragged_paged_attention)[2]  # fmt: skip


def _check_features(engine: LLMEngine) -> int:
    """Every decoding slot's kept feature equals f_{L-2} recomputed from scratch."""
    st = jax.device_get(engine.state)
    checked = 0
    for s in np.flatnonzero(st.status == RUNNING):
        done = int(st.prompt_len[s] + st.output_len[s])
        if st.num_computed[s] != done - 1:
            continue  # prompt still prefilling
        ids = np.zeros(MAX_LEN, np.int32)
        ids[:done] = np.asarray(engine.core.device.tokens[s, :done])
        f = _dense_features(_params(), jnp.asarray(ids), jnp.int32(done - 1))[done - 2]
        np.testing.assert_allclose(np.asarray(engine.speculator.medusa.feature[s]),
                                   np.asarray(f), rtol=1e-4, atol=1e-4)  # fmt: skip
        checked += 1
    return checked


@pytest.mark.tier2  # second tier (docs/testing.md): the medusa verify program's compiles
def test_medusa_greedy_equals_plain_with_chunking_and_preemption(head_dir):
    prompts = dict(enumerate(_prompts(11, 4, lo=12, hi=26)))
    reqs = [(str(i), p, _greedy(24)) for i, p in prompts.items()]
    ref = _reference(reqs)
    if any(len(r.outputs[0].token_ids) < 24 for r in ref.values()):
        pytest.xfail("the plain run finished a request for capacity (see test_speculative)")
    engine = _engine(head_dir)
    assert engine.speculator.k == HEADS  # min(num_speculative_tokens, num_heads)
    checked = []

    def on_step(e):
        check_memory(e)
        checked.append(_check_features(e))

    got = _drain(engine, reqs, on_step=on_step)
    _assert_same(ref, got)
    s = engine.stats()
    assert engine.num_preemptions > 0, "the pool was meant to force preemption"
    assert s["spec_proposed_tokens"] > 0 and s["spec_proposals_per_step"] <= MAX_SEQS * HEADS
    assert sum(checked) >= 10
    assert engine.num_free_blocks() == engine.num_usable_blocks()


@pytest.mark.tier2  # second tier (docs/testing.md): its own engine's programs
def test_medusa_seeded_sampling_equals_plain(head_dir):
    """Greedy drafts verified by sample-and-compare: a seeded sampled request draws the
    target's token with the plain run's key at each position."""
    prompts = dict(enumerate(_prompts(5, 3, lo=6, hi=20)))
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    reqs = [(str(i), p, sp) for i, p in prompts.items()]
    ref = _reference(reqs)
    engine = _engine(head_dir)
    got = _drain(engine, reqs)
    for rid in ref:
        assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids
    assert engine.stats()["spec_proposed_tokens"] > 0


@pytest.mark.slow  # by hand: warm-up compiles every bucket (the EAGLE test is tier2's guard)
@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_medusa_compiles_nothing_after_warm_up(head_dir, method):
    prompts = dict(enumerate(_prompts(13, 4, lo=5, hi=30)))
    sp = SamplingParams(temperature=0.8, max_tokens=12, seed=3, ignore_eos=True)
    reqs = [(str(i), p, _greedy(12) if i % 2 else sp) for i, p in prompts.items()]
    engine = _engine(head_dir, warmup="all", draft_sample_method=method)
    warm = engine.stats()
    _drain(engine, reqs)
    s = engine.stats()
    assert s["spec_proposed_tokens"] > 0
    assert s["spec_compilations"] == warm["spec_compilations"]
    assert s["compilations"] == warm["compilations"]
    assert set(engine.speculator.medusa.trace_count.values()) == {1}
    assert set(engine.speculator.verifier.trace_count.values()) == {1}


@pytest.mark.tier2  # second tier (docs/testing.md): trains, then runs an engine
def test_trained_heads_accept(tmp_path):
    """train_medusa's self-distillation on the tiny model's own greedy outputs: trained
    heads get nonzero acceptance (greedy outputs still equal the plain run), above
    the untrained heads' (each head = the target's LM head, w = 0)."""
    pytest.importorskip("optax")
    from pagedjax.tools.train_eagle import teacher_features
    from pagedjax.tools.train_medusa import position_examples, target_lm_head, top1, train_heads

    prompts = _prompts(31, 16, lo=6, hi=14)
    reqs = [(str(i), p, _greedy(40)) for i, p in enumerate(prompts)]
    ref = _reference(reqs)
    train = range(12)  # the last 4 requests are held out
    seqs = [prompts[i] + ref[str(i)].outputs[0].token_ids for i in train]
    feats = teacher_features(ARCH, _params(), seqs, MAX_LEN, rows=4)
    x, y = position_examples(feats, seqs, [len(prompts[i]) - 1 for i in train], HEADS)
    cfg = MedusaConfig.for_target(ARCH, HEADS, 1, target="tiny-llama")
    lm = target_lm_head(ARCH, _params())
    hp, meta = train_heads(cfg, x, y, lm_head=lm, steps=300, batch=256, lr=3e-3)
    acc = top1(hp, x, y)
    print(f"medusa tiny: {len(x)} positions, loss {meta['loss']}, teacher-forced top-1"
          f" per head {np.round(acc, 3).tolist()}")  # fmt: skip
    rates = {}
    engine = _engine(str(save_heads(tmp_path / "trained", cfg, hp)))
    for name, params in (("untrained", init_heads(cfg, lm_head=lm) | {"w": 0 * hp["w"]}),
                         ("trained", hp)):  # fmt: skip
        engine.speculator.medusa.params = params  # same shapes: the same programs
        for part, sub in (("seen", reqs[8:12]), ("held-out", reqs[12:])):
            engine.reset_stats()
            got = _drain(engine, sub)
            _assert_same({k: ref[k] for k in got}, got)
            s = engine.stats()
            rates[name, part] = s["spec_acceptance_rate"]
            print(f"medusa tiny {name} heads, {part} prompts: acceptance"
                  f" {s['spec_acceptance_rate']:.3f}, mean accepted length"
                  f" {s['spec_mean_accepted_length']:.2f}")  # fmt: skip
    assert rates["trained", "seen"] > max(0.0, rates["untrained", "seen"])


@pytest.mark.slow  # by hand (~35 s): the CLI end to end on the tiny preset
def test_train_medusa_cli_on_the_tiny_preset(tmp_path, monkeypatch):
    """``python -m pagedjax.tools.train_medusa`` with train_eagle's data generation (the
    byte tokenizer: questions as they are), into a directory the engine loads."""
    pytest.importorskip("optax")
    from pagedjax.tools.train_medusa import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "heads"
    assert main(["--model", "tiny-llama", "--prompts", "16", "--gen-tokens", "24",
                 "--steps", "40", "--out", str(out)]) == 0  # fmt: skip
    cfg, params = load_heads(out, ARCH)
    assert cfg.num_heads == 3 and cfg.train["steps"] == 40
    assert params["lm_head"].shape == (3, ARCH.hidden_size, ARCH.vocab_size)
