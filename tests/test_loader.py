"""Checkpoint loading, architecture parsing, presets, Orbax round trip, tokenizers."""

from __future__ import annotations

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import PagedRunner, save_tiny_hf_model

from pagedjax.model import (
    ModelArch,
    abstract_params,
    allocate_kv_cache,
    arch_from_hf_config,
    dummy_input,
    forward,
    load_hf_checkpoint,
    preset_arch,
    random_params,
    restore_params,
    save_params,
)
from pagedjax.model.presets import PRESETS
from pagedjax.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    save_tiny_hf_model("llama", d)
    return d


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        load_hf_checkpoint(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_hf_checkpoint(tmp_path)


def test_missing_weights(llama_dir, tmp_path):
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_unknown_architecture(llama_dir, tmp_path):
    d = _copy_with_config(llama_dir, tmp_path / "c", model_type="gpt2")
    with pytest.raises(ValueError, match="unknown architecture model_type='gpt2'"):
        load_hf_checkpoint(d)


def test_shape_mismatch_names_the_tensor(llama_dir, tmp_path):
    d = _copy_with_config(llama_dir, tmp_path / "c", intermediate_size=96)
    with pytest.raises(ValueError, match=r"shape mismatch for tensor 'model\.layers\.0\.mlp\."):
        load_hf_checkpoint(d)


def test_missing_and_unexpected_tensors(llama_dir, tmp_path):
    d = _copy_with_config(llama_dir, tmp_path / "more", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"missing tensors: \['layers\.2\."):
        load_hf_checkpoint(d)
    d = _copy_with_config(llama_dir, tmp_path / "fewer", num_hidden_layers=1)
    with pytest.raises(ValueError, match="tensors the config does not use.*layers.1"):
        load_hf_checkpoint(d)


def test_sharded_equals_unsharded_and_missing_shard(llama_dir, tmp_path):
    save_tiny_hf_model("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    _, a = load_hf_checkpoint(llama_dir)
    _, b = load_hf_checkpoint(tmp_path / "sharded")
    jax.tree.map(np.testing.assert_array_equal, a, b)
    next((tmp_path / "sharded").glob("*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="listed in model.safetensors.index.json"):
        load_hf_checkpoint(tmp_path / "sharded")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, "bfloat16"])
def test_dtypes(llama_dir, dtype):
    _, p32 = load_hf_checkpoint(llama_dir)
    _, p = load_hf_checkpoint(llama_dir, dtype=dtype)
    want = jnp.dtype(dtype)
    for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(p32), strict=True):
        assert x.dtype == want
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y.astype(want)))
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_hf_checkpoint(llama_dir, dtype="int8")


def test_bf16_checkpoint_on_disk_and_tied_weights(tmp_path):
    import torch

    model = save_tiny_hf_model("llama3", tmp_path / "f32")  # tie_word_embeddings=True
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    arch, p = load_hf_checkpoint(tmp_path / "bf16")
    assert arch.tie_word_embeddings and "lm_head" not in p
    _, p32 = load_hf_checkpoint(tmp_path / "f32")
    want = model.model.embed_tokens.weight.detach().float().numpy()  # the bf16 values, exactly
    np.testing.assert_array_equal(np.asarray(p["embed_tokens"]["embedding"]), want)
    assert np.abs(np.asarray(p32["embed_tokens"]["embedding"]) - want).max() > 0


def test_orbax_round_trip(llama_dir, tmp_path):
    arch, params = load_hf_checkpoint(llama_dir, dtype=jnp.bfloat16)
    save_params(tmp_path / "conv", arch, params)
    arch2, params2 = restore_params(tmp_path / "conv")
    assert arch2 == arch
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(FileNotFoundError, match="no saved params"):
        restore_params(tmp_path / "absent")


def test_legacy_rope_config_parses_like_v5():
    base = dict(model_type="llama", vocab_size=8, hidden_size=16, num_hidden_layers=1,
                num_attention_heads=2, intermediate_size=8)  # fmt: skip
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)  # fmt: skip
    v5 = arch_from_hf_config(
        dict(base, rope_parameters=dict(scaling, rope_type="llama3", rope_theta=5e5))
    )
    legacy = arch_from_hf_config(
        dict(base, rope_theta=5e5, rope_scaling=dict(scaling, type="llama3"))
    )
    assert v5 == legacy and v5.rope_type == "llama3" and v5.rope_theta == 5e5
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        arch_from_hf_config(dict(base, rope_scaling=dict(rope_type="yarn", factor=2.0)))
    with pytest.raises(ValueError, match="missing required field 'vocab_size'"):
        arch_from_hf_config({k: v for k, v in base.items() if k != "vocab_size"})


def test_sliding_window_per_layer():
    base = dict(vocab_size=8, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                intermediate_size=8, sliding_window=5)  # fmt: skip
    assert arch_from_hf_config(dict(base, model_type="mistral")).layer_windows == (5, 5, 5)
    assert arch_from_hf_config(dict(base, model_type="qwen2")).layer_windows == (None,) * 3
    qwen = arch_from_hf_config(
        dict(base, model_type="qwen2", use_sliding_window=True,
             layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    )  # fmt: skip
    assert qwen.layer_windows == (None, 5, 5) and qwen.qkv_bias


def test_presets_and_kv_bytes():
    assert {"llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2-7b", "opt-125m", "opt-13b",
            "tiny-llama"} <= set(PRESETS)  # fmt: skip
    # The paper: OPT-13B holds 800 KB of KV per token in fp16; Llama-2-7B 512 KiB.
    assert preset_arch("opt-13b").kv_bytes_per_token(jnp.float16) == 800 * 1024
    assert preset_arch("llama-2-7b").kv_bytes_per_token(jnp.bfloat16) == 512 * 1024
    assert preset_arch("llama-3-8b").kv_bytes_per_token(jnp.bfloat16) == 128 * 1024
    assert preset_arch("mistral-7b").sliding_window == 4096
    n = sum(np.prod(s.shape) for s in jax.tree.leaves(abstract_params(preset_arch("llama-2-7b"))))
    assert abs(n - 6.74e9) < 0.01e9  # Llama-2-7B's published parameter count
    with pytest.raises(ValueError, match="unknown preset"):
        preset_arch("llama-1000b")


def test_random_params_run_and_arch_json_round_trip():
    arch = preset_arch("tiny-llama")
    assert ModelArch.from_json(arch.to_json()) == arch
    params = random_params(arch, seed=0, dtype=jnp.float32)
    runner = PagedRunner(arch, params, block_size=4, max_tokens=8, max_seqs=2, max_len=16)
    before = runner.kv[0]
    out = runner.step([(0, [5, 6, 7]), (1, [9])])
    assert out[0].shape == (1, arch.vocab_size) and np.isfinite(out[0]).all()
    assert np.abs(out[0] - out[1]).max() > 0
    assert before.is_deleted(), "the KV cache must be donated to the jitted step"
    runner.step([(0, [8]), (1, [10, 11, 12])])  # other lengths, same padded shapes
    assert runner.forward._cache_size() == 1, "a step with new lengths recompiled"


def test_kv_cache_allocation():
    arch = preset_arch("tiny-llama")
    cache = allocate_kv_cache(arch, num_blocks=6, block_size=16, dtype=jnp.bfloat16)
    k, v = cache  # stacked over layers: [L, blocks, kv heads, block size, head dim]
    assert k.shape == v.shape == (arch.num_layers, 6, 2, 16, 16) and v.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_cache(arch, num_blocks=1, block_size=16)
    params = abstract_params(arch)
    batch = dummy_input(4, 2, 3)
    one_layer = (k[:1], v[:1])
    with pytest.raises(ValueError, match=r"kv_cache must be \(k, v\), each \[2, num_blocks"):
        jax.eval_shape(functools.partial(forward, arch=arch), params, one_layer, batch)
    other = jax.eval_shape(
        lambda: allocate_kv_cache(preset_arch("llama-2-7b"), num_blocks=2, block_size=1)
    )
    with pytest.raises(ValueError, match="kv_cache must be"):
        jax.eval_shape(functools.partial(forward, arch=arch), params, other, batch)


def test_tokenizers(tmp_path, llama_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["paged attention serves many requests"] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(tmp_path / "tok"))  # fmt: skip
    hf = load_tokenizer(tmp_path / "tok")
    assert isinstance(hf, HFTokenizer) and hf.eos_token_id == 2
    ids = hf.encode("paged attention")
    assert ids and hf.decode(ids).replace(" ", "") == "pagedattention"

    fallback = load_tokenizer(llama_dir)  # config.json but no tokenizer files
    assert isinstance(fallback, ByteTokenizer)
    assert (fallback.bos_token_id, fallback.eos_token_id) == (1, 2)
    ids = fallback.encode("héllo")
    assert ids[0] == 1 and fallback.decode(ids + [2, 300]) == "héllo"
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "missing")
