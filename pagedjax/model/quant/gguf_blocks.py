"""llama.cpp's GGUF block formats decoded with whole-array numpy: codes, scales and offsets
per group (``decode_blocks``, which gguf_packed.py keeps packed) and float32 values
(``dequantize_blocks``, which gguf_loader.py loads).

=======  ==========  ==========================================
type     group       value
=======  ==========  ==========================================
Q8_0     32          d * q (q int8)
Q4_0     32          d * (q - 8)
Q4_1     32          d * q + m
Q4_K     32          (d * sc_j) * q - dmin * m_j
Q5_K     32          (d * sc_j) * q - dmin * m_j
Q6_K     16          (d * sc_j) * (q - 32)
=======  ==========  ==========================================

Scales and offsets are computed in float32 exactly as ``gguf.quants.dequantize`` computes
them and the value with the same operations in the same order, so the values are
bit-identical to gguf-py's (tests/test_quantization_gguf.py, tests/test_gguf_file.py).
Why not gguf-py's own: it walks each tensor in groups of rows through per-type Python
code; these whole-tensor array expressions dequantize SmolLM2's 211 quantized tensors in
~1.4 s against ~3.8 s (load average ~9). Other types: ValueError (callers fall back to
gguf-py for them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

QK_K = 256
PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


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


def type_size(qtype: str) -> int:
    """Bytes per block of a ggml type (gguf-py's table)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]


def dequantize_blocks(qtype: str, raw: np.ndarray) -> np.ndarray:
    """Raw bytes of one tensor of a PACKED_TYPES type (any shape, whole blocks) -> its
    float32 values, flat, bit-identical to ``gguf.quants.dequantize``."""
    dec = decode_blocks(qtype, np.asarray(raw, np.uint8).reshape(-1, type_size(qtype)))
    codes = dec["codes"].reshape(-1, dec["group"]).astype(np.float32)
    if dec["code_offset"]:
        codes -= np.float32(dec["code_offset"])
    values = codes * dec["scale"].reshape(-1, 1)
    if dec["offset"] is not None:
        values += dec["offset"].reshape(-1, 1)
    return values.reshape(-1)
