"""GGUF weights kept packed (pagedjax/model/quant/gguf_packed.py): every block format
against ``gguf.quants.dequantize`` on random block bytes (the K-quants, which the gguf
package cannot quantize, included), a tiny GGUF model with quantized linears (mixed
types, one role mixed across layers), and the real SmolLM2 file (Q4_1 linears)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")

from model_helpers import PagedRunner, make_tiny_hf_model  # noqa: E402
from test_gguf_loader import HF_TO_GGUF, llama_cpp_permute  # noqa: E402

from pagedjax.model.gguf_loader import load_gguf_checkpoint  # noqa: E402
from pagedjax.model.quant.gguf_packed import (  # noqa: E402
    PACKED_TYPES,
    load_gguf_packed,
    packed_weight,
)
from pagedjax.model.quant.weight import QuantizedWeight, dequantize  # noqa: E402

# Byte ranges of each type's float16 fields (d, dmin / m), kept finite in random blocks.
_F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
               "Q6_K": [-2]}  # fmt: skip


def _random_blocks(qtype: str, n_blocks: int, rng) -> np.ndarray:
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        f = rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16).view(np.uint8)
        raw[:, at : at + 2 if at != -2 else None] = f.reshape(n_blocks, 2)
    return raw


@pytest.mark.parametrize("qtype", PACKED_TYPES)
def test_packed_block_formats_equal_gguf_dequantize(qtype):
    rng = np.random.default_rng(0)
    n_out, n_in = 6, 512  # two K-quant super-blocks per row
    block_values = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    raw = _random_blocks(qtype, n_out * n_in // block_values, rng)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n_out, n_in)
    w = packed_weight(qtype, raw, n_out, n_in)
    np.testing.assert_array_equal(np.asarray(dequantize(w)), want.T)  # bit for bit
    # A row permutation (q/k rotary un-permutation) moves whole output columns.
    perm = rng.permutation(n_out)
    wp = packed_weight(qtype, raw, n_out, n_in, perm)
    np.testing.assert_array_equal(np.asarray(dequantize(wp)), want[perm].T)
    assert w.nbytes() < want.nbytes / (3.5 if w.bits <= 4 else 1.9)


def _write_quantized_gguf(path, types_per_layer):
    """A tiny random Llama (tied Q8_0 embedding) whose linears of layer i are quantized
    with types_per_layer[i][role] (default Q4_0); returns {HF name: dequantized float32}."""
    model = make_tiny_hf_model("llama", num_key_value_heads=2, tie_word_embeddings=True)
    cfg = model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    q8 = gguf.quants.quantize(sd["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, g in HF_TO_GGUF.items():
            x = sd[f"model.layers.{i}.{hf}"]
            if g == "attn_q.weight":
                x = llama_cpp_permute(x, cfg.num_attention_heads)
            elif g == "attn_k.weight":
                x = llama_cpp_permute(x, cfg.num_key_value_heads)
            qtype = types_per_layer[i].get(g, "Q4_0") if x.ndim == 2 else "F32"
            if qtype == "F32":
                w.add_tensor(f"blk.{i}.{g}", np.ascontiguousarray(x))
            else:
                t = gguf.GGMLQuantizationType[qtype]
                w.add_tensor(f"blk.{i}.{g}", gguf.quants.quantize(x, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_model_kept_packed_equals_the_dequantized_load(tmp_path):
    path = tmp_path / "q.gguf"
    layer0 = {"attn_q.weight": "Q8_0", "attn_v.weight": "Q4_1", "ffn_down.weight": "Q8_0"}
    layer1 = {"attn_q.weight": "Q8_0", "attn_v.weight": "Q4_1", "ffn_down.weight": "Q4_1"}
    _write_quantized_gguf(path, [layer0, layer1])
    arch, dense = load_gguf_checkpoint(path)
    arch_p, packed = load_gguf_packed(path)
    assert arch == arch_p
    mlp, attn = packed["layers"]["mlp"], packed["layers"]["self_attn"]
    assert attn["q_proj"]["kernel"].fmt == "gguf Q8_0"
    assert attn["v_proj"]["kernel"].fmt == "gguf Q4_1"
    assert attn["k_proj"]["kernel"].fmt == "gguf Q4_0"
    assert not isinstance(mlp["down_proj"]["kernel"], QuantizedWeight)  # mixed: dequantized
    assert packed["embed_tokens"]["embedding"].fmt == "gguf Q8_0"  # tied: the LM head too
    for role in ("q_proj", "k_proj", "v_proj", "o_proj"):
        for i in range(arch.num_layers):
            q = attn[role]["kernel"]
            one = jax.tree.map(lambda a, i=i: a[i], q)  # layer i of the stack
            np.testing.assert_array_equal(
                np.asarray(dequantize(one)),
                np.asarray(dense["layers"]["self_attn"][role]["kernel"][i]),
            )
    toks = [5, 17, 99, 3, 250, 7, 8, 9, 31]

    def run(params):
        r = PagedRunner(arch, params, block_size=4, max_tokens=12, max_seqs=1, max_len=16)
        return np.concatenate([r.step([(0, toks[:-1])], all_logits=True)[0],
                               r.step([(0, toks[-1:])])[0]])  # fmt: skip

    want, got = run(dense), run(packed)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow  # two loads of the 135M model: about 40 s on a 2-core box
def test_real_gguf_linears_kept_packed_bit_for_bit(smollm2_gguf):
    """SmolLM2's Q4_1 linears: every packed layer dequantizes to exactly the dense
    loader's weights; the tied Q8_0 embedding stays dense (dequantized)."""
    arch, dense = load_gguf_checkpoint(smollm2_gguf)
    _, packed = load_gguf_packed(smollm2_gguf)
    q = packed["layers"]["mlp"]["gate_proj"]["kernel"]
    assert q.fmt == "gguf Q4_1" and q.offset is not None and q.group_size == 32
    for layer in (0, arch.num_layers - 1):
        one = jax.tree.map(lambda a, i=layer: a[i], q)
        np.testing.assert_array_equal(
            np.asarray(dequantize(one)),
            np.asarray(dense["layers"]["mlp"]["gate_proj"]["kernel"][layer]),
        )
    embedding = packed["embed_tokens"]["embedding"]
    assert embedding.fmt == "gguf Q8_0"
    np.testing.assert_array_equal(dequantize(embedding).T, dense["embed_tokens"]["embedding"])
