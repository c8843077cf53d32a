"""GGUF files (llama.cpp's format) -> ModelArch + an HF-style tensor dict -> params.

Contract: ``read_gguf(path)`` gives the architecture from the file's metadata and every
tensor dequantized to float32 numpy under its Hugging Face name
(``model.layers.0.self_attn.q_proj.weight``, shape [out, in] as in torch), so the one
HF conversion path (``convert_hf_tensors``) builds the params and nothing else in
pagedjax knows GGUF. ``load_gguf_checkpoint(path, dtype)`` does both steps.

Supported: ``general.architecture == "llama"`` (Llama 2/3 style models such as
SmolLM2), tensors of any type ``gguf.quants.dequantize`` reads (F32, F16, BF16, Q4_0,
Q4_1, Q8_0, K-quants...); the six types of quant/gguf_blocks.py are dequantized
there (the same values, whole tensors at once: ~2.5x faster). Quantized weights are
dequantized at load: the model then runs in ``dtype`` like any HF checkpoint (about 4x
the file size in fp32).

Why the Q/K un-permutation: llama.cpp's converter reorders the rows of q_proj and
k_proj per head from HF's rotate-half layout (pairs i, i + d/2) to its interleaved
rotary layout (pairs 2i, 2i + 1). We undo it exactly as transformers' GGUF loader does,
so the weights, and hence the logits, equal what ``AutoModelForCausalLM.from_pretrained
(dir, gguf_file=...)`` builds from the same file.

Every function takes a path or a ``GGUFFile`` already parsed by ``gguf_file.parse_gguf``
(our header reader: ~0.2 s where gguf-py's ``GGUFReader`` takes ~8-10 s on SmolLM2's
vocabulary), so an engine build parses the file once and hands it along.

Refusals: another architecture, a tensor with no HF name (e.g. llama3 ``rope_freqs``),
or missing metadata raise ValueError naming it. Dequantizing tensors needs the ``gguf``
package (the ``real`` extra), imported on first use.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from pagedjax.gguf_file import GGUFFile, parse_gguf
from pagedjax.model.config import ModelArch
from pagedjax.model.forward import Params
from pagedjax.model.loader import convert_hf_tensors
from pagedjax.model.quant.gguf_blocks import PACKED_TYPES, dequantize_blocks

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


GGUFSource = str | Path | GGUFFile  # a path, or a file already parsed by parse_gguf


def open_gguf(source: GGUFSource) -> GGUFFile:
    """The parsed header of ``source`` (parsed now when it is a path): callers parse a file
    once per engine build and hand the ``GGUFFile`` to every step that needs it."""
    return source if isinstance(source, GGUFFile) else parse_gguf(source)


def gguf_dequantize() -> Any:
    """gguf-py's ``dequantize(data, qtype)`` (block formats -> float values)."""
    try:
        from gguf.quants import dequantize
    except ImportError as e:  # the optional extra is missing
        raise ImportError(
            "reading GGUF tensors needs the `gguf` package: pip install 'pagedjax[real]'"
        ) from e
    return dequantize


def hf_tensor_name(gguf_name: str) -> str:
    """GGUF name -> HF name; ValueError for a tensor this loader does not know."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` of q_proj / k_proj rows (per head: interleaved
    rotary pairs back to rotate-half); w: [num_heads * head_dim, ...] (weight or bias)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def arch_from_gguf_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelArch:
    """ModelArch from GGUF metadata; tied embeddings when the file has no output.weight."""
    arch_name = meta.get("general.architecture")
    if arch_name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch_name!r} is not supported;"
            f" supported: {SUPPORTED_ARCHITECTURES}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch_name}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch_name}.{key}")
        return value

    scaling = meta.get(f"{arch_name}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF rope_freqs (llama3 rope scaling) is not supported")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch_name}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF metadata lacks {arch_name}.vocab_size and a token list")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelArch(
        model_type="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        intermediate_size=int(get("feed_forward_length")),
        max_position_embeddings=int(get("context_length")),
        # float32 in the file (9.9999997e-06 for 1e-5): transformers reads the same value.
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def load_gguf_arch(source: GGUFSource) -> ModelArch:
    """The architecture alone (metadata only; no tensor is read)."""
    gf = open_gguf(source)
    return arch_from_gguf_metadata(gf.metadata, gf.tensor_names)


def read_gguf(source: GGUFSource) -> tuple[ModelArch, dict[str, np.ndarray], dict[str, Any]]:
    """(arch, HF-named float32 tensors, metadata) of a GGUF file."""
    from gguf.constants import GGMLQuantizationType

    dequantize = gguf_dequantize()
    gf = open_gguf(source)
    arch = arch_from_gguf_metadata(gf.metadata, gf.tensor_names)
    tensors: dict[str, np.ndarray] = {}
    for t in gf.tensors:
        name = hf_tensor_name(t.name)
        data = gf.tensor_data(t)
        if t.type_name in PACKED_TYPES:  # whole-tensor numpy, bit-identical to gguf-py's
            w = dequantize_blocks(t.type_name, data)
        else:
            w = np.asarray(dequantize(data, GGMLQuantizationType(t.type_id)), dtype=np.float32)
        # GGUF lists dims innermost first; numpy data is already [out, in] like torch.
        w = w.reshape(tuple(reversed(t.dims)))
        if ".q_proj." in name:
            w = unpermute_rotary_rows(w, arch.num_heads)
        elif ".k_proj." in name:
            w = unpermute_rotary_rows(w, arch.num_kv_heads)
        tensors[name] = w
    return arch, tensors, gf.metadata


def load_gguf_checkpoint(source: GGUFSource, dtype: Any = np.float32) -> tuple[ModelArch, Params]:
    """(arch, params in dtype) from a GGUF file; quantized tensors dequantized at load."""
    arch, tensors, _ = read_gguf(source)
    return arch, convert_hf_tensors(arch, tensors, dtype)
