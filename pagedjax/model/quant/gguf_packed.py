"""GGUF tensors kept packed: llama.cpp's block formats -> ``QuantizedWeight``.

Each GGUF block covers consecutive values of one row of a torch-layout [out, in] weight,
so a block is a group along our input axis. Formats held as they are (blocks decoded by
gguf_blocks.py, codes repacked into weight.py's layout, scales and offsets computed in
float32 exactly as ``gguf.quants.dequantize`` computes them, so the dequantized weights
are bit-identical):

=======  ==========  ==========================================  ============
type     group       value                                       codes kept
=======  ==========  ==========================================  ============
Q8_0     32          d * q (q int8)                              int8
Q4_0     32          d * (q - 8)                                 4-bit
Q4_1     32          d * q + m                                   4-bit
Q4_K     32          (d * sc_j) * q - dmin * m_j                 4-bit
Q5_K     32          (d * sc_j) * q - dmin * m_j                 5-bit (a byte)
Q6_K     16          (d * sc_j) * (q - 32)                       6-bit (a byte)
=======  ==========  ==========================================  ============

Other types (F32, F16, BF16, the remaining quant types) load dequantized through
gguf_loader.py. A linear role whose layers mix types (llama.cpp's Q4_K_M gives some layers'
ffn_down / attn_v Q6_K) cannot share one layer-loop body: that role is dequantized to the
compute dtype and the log says so. A quantized token embedding stays packed too, in the
LM head's orientation [hidden, vocab] (layers.Embedding): a lookup dequantizes only the
looked-up rows, and when tied (the real model's Q8_0 embedding) it is the quantized LM
head; an untied quantized ``output.weight`` is a packed linear like the others.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import numpy as np

from pagedjax.model.config import ModelArch
from pagedjax.model.forward import Params
from pagedjax.model.gguf_loader import (
    GGUFSource,
    arch_from_gguf_metadata,
    gguf_dequantize,
    hf_tensor_name,
    open_gguf,
    unpermute_rotary_rows,
)
from pagedjax.model.hf_keys import canonical_tensors
from pagedjax.model.loader import convert_hf_tensors, resolve_dtype
from pagedjax.model.quant.gguf_blocks import PACKED_TYPES, decode_blocks, type_size
from pagedjax.model.quant.weight import QuantizedWeight, dequantize, pack_nibbles

log = logging.getLogger(__name__)


def packed_weight(qtype: str, raw: np.ndarray, out_features: int, in_features: int,
                  row_perm: np.ndarray | None = None) -> QuantizedWeight:  # fmt: skip
    """A GGUF tensor's raw bytes ([out, bytes per row] or flat) -> QuantizedWeight of the
    [in, out] weight; row_perm reorders the torch rows (q/k rotary un-permutation)."""
    dec = decode_blocks(qtype, np.asarray(raw, np.uint8).reshape(-1, type_size(qtype)))
    gs = dec["group"]
    codes = dec["codes"].reshape(out_features, in_features)
    scale = dec["scale"].reshape(out_features, in_features // gs)
    offset = None if dec["offset"] is None else dec["offset"].reshape(scale.shape)
    if row_perm is not None:
        codes, scale = codes[row_perm], scale[row_perm]
        offset = None if offset is None else offset[row_perm]
    codes = np.ascontiguousarray(codes.T)
    data = pack_nibbles(codes) if dec["bits"] <= 4 else codes
    return QuantizedWeight(
        data, np.ascontiguousarray(scale.T),
        offset=None if offset is None else np.ascontiguousarray(offset.T),
        in_features=in_features, bits=dec["bits"], group_size=gs,
        code_offset=dec["code_offset"], fmt=f"gguf {qtype}",
    ).check()  # fmt: skip


def load_gguf_packed(source: GGUFSource, dtype: Any = np.float32) -> tuple[ModelArch, Params]:
    """(arch, params) of a GGUF file (a path or a parsed ``GGUFFile``) with its decoder
    linears kept packed where the table above holds their type and every layer of the
    role shares it."""
    from gguf.constants import GGMLQuantizationType

    to_float = gguf_dequantize()
    gf = open_gguf(source)
    arch = arch_from_gguf_metadata(gf.metadata, gf.tensor_names)
    dense: dict[str, np.ndarray] = {}
    packed: dict[str, QuantizedWeight] = {}
    roles: dict[str, set[str]] = defaultdict(set)
    role = lambda gguf_name: gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") \
        else gguf_name  # fmt: skip
    for t in gf.tensors:
        roles[role(t.name)].add(t.type_name)
    for t in gf.tensors:
        name = hf_tensor_name(t.name)
        shape = tuple(reversed(t.dims))  # torch [out, in]
        heads = arch.num_heads if ".q_proj." in name else arch.num_kv_heads
        rotary = ".q_proj." in name or ".k_proj." in name
        role_types, qtype = roles[role(t.name)], t.type_name
        if len(shape) == 2 and len(role_types) == 1 and qtype in PACKED_TYPES:
            perm = None
            if rotary:
                perm = unpermute_rotary_rows(np.arange(shape[0]), heads)
            (key,) = canonical_tensors(arch, {name: np.zeros(0)})
            packed[key] = packed_weight(qtype, gf.tensor_data(t), shape[0], shape[1], perm)
            continue
        if len(role_types) > 1 and qtype in PACKED_TYPES:
            log.info("GGUF %s: layers mix %s; dequantized", t.name, sorted(role_types))
        data = gf.tensor_data(t)
        w = np.asarray(to_float(data, GGMLQuantizationType(t.type_id)), np.float32).reshape(shape)
        if rotary:
            w = unpermute_rotary_rows(w, heads)
        dense[name] = w
    return arch, convert_hf_tensors(arch, dense, resolve_dtype(dtype), kernels=packed)


def dequantized(w: QuantizedWeight) -> np.ndarray:
    """Host float32 [in, out] of one layer's weight (tests, diagnostics)."""
    return np.asarray(dequantize(w))
