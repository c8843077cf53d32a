"""GGUF tensors kept packed: llama.cpp's block formats -> ``QuantizedWeight``.

Each GGUF block covers consecutive values of one row of a torch-layout [out, in] weight,
so a block is a group along our input axis. Formats held as they are (codes repacked into
weight.py's layout, scales and offsets computed in float32 exactly as
``gguf.quants.dequantize`` computes them, so the dequantized weights are bit-identical):

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
from pagedjax.model.quant.weight import QuantizedWeight, dequantize, pack_nibbles

QK_K = 256
PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
log = logging.getLogger(__name__)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """Bytes [..., n] holding value j (low nibble) and j + half (high nibble) of each
    chunk of 2 * half values -> codes [..., 2n] in value order."""
    q = qs.reshape(*qs.shape[:-1], -1, half)
    return np.concatenate([q & 0x0F, q >> 4], axis=-1).reshape(*qs.shape[:-1], -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes -> 6-bit (scale, min) of the 8 sub-blocks."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode_blocks(qtype: str, blocks: np.ndarray) -> dict[str, Any]:
    """Raw blocks uint8 [n, type_size] of one GGUF type -> {"codes" [n, values],
    "scale" / "offset" [n, groups] float32, group, bits, code_offset}."""
    n = blocks.shape[0]
    if qtype == "Q8_0":
        d, q = _f16(blocks[:, :2]), blocks[:, 2:].view(np.int8)
        return dict(codes=q, scale=d, offset=None, group=32, bits=8, code_offset=0)
    if qtype in ("Q4_0", "Q4_1"):
        d = _f16(blocks[:, :2])
        m = _f16(blocks[:, 2:4]) if qtype == "Q4_1" else None
        q = _nibbles(blocks[:, 4 if m is not None else 2 :], 16)
        return dict(codes=q, scale=d, offset=m, group=32, bits=4,
                    code_offset=0 if m is not None else 8)  # fmt: skip
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        if qtype == "Q4_K":
            q = _nibbles(blocks[:, 16:], 32)
            bits = 4
        else:
            qh, qs = blocks[:, 16 : 16 + QK_K // 8], blocks[:, 16 + QK_K // 8 :]
            low = _nibbles(qs, 32)  # [n, 256]
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = low | (high.reshape(n, QK_K) << 4)
            bits = 5
        return dict(codes=q.astype(np.uint8), scale=d * sc, offset=-(dmin * mn), group=32,
                    bits=bits, code_offset=0)  # fmt: skip
    if qtype == "Q6_K":
        ql, qh = blocks[:, : QK_K // 2], blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
        sc = blocks[:, QK_K // 2 + QK_K // 4 : -2].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, -2:])
        low = _nibbles(ql, 64)  # [n, 256]: each 64 bytes give 128 values
        high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None])
        high = (high & 3).reshape(n, QK_K)
        q = (low | (high << 4)).astype(np.uint8)
        return dict(codes=q, scale=d * sc, offset=None, group=16, bits=6, code_offset=32)
    raise ValueError(f"GGUF type {qtype} is not kept packed (packed: {PACKED_TYPES})")


def packed_weight(qtype: str, raw: np.ndarray, out_features: int, in_features: int,
                  row_perm: np.ndarray | None = None) -> QuantizedWeight:  # fmt: skip
    """A GGUF tensor's raw bytes ([out, bytes per row] or flat) -> QuantizedWeight of the
    [in, out] weight; row_perm reorders the torch rows (q/k rotary un-permutation)."""
    dec = decode_blocks(qtype, np.asarray(raw, np.uint8).reshape(-1, _type_size(qtype)))
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


def _type_size(qtype: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]


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
