"""Pre-quantized Hugging Face checkpoints -> ``QuantizedWeight``: AWQ (GEMM), GPTQ and
compressed-tensors, each read from its published tensor layout and repacked, losslessly,
into the one representation (weight.py), so the forward has one matmul for all of them.

Layouts (per linear module ``<name>``; "in" / "out" are the layer's input / output sizes):

- AWQ GEMM (AutoAWQ ``WQLinear_GEMM``, vLLM's ``awq``): ``qweight`` int32 [in, out/8],
  ``qzeros`` int32 [in/group, out/8], ``scales`` fp16 [in/group, out]; each int32 holds
  eight 4-bit values of consecutive output columns in AWQ's interleaved order (nibble k
  holds column ``AWQ_ORDER[k]`` of its eight). w = (q - z) * s.
- GPTQ (AutoGPTQ / GPTQModel's common "gptq" format, 4 or 8 bits): ``qweight`` int32
  [in * bits / 32, out] packed along the input (value k of a word at bits k*bits),
  ``qzeros`` int32 [G, out * bits / 32] packed along the output, ``scales`` fp16 [G, out],
  ``g_idx`` int32 [in] (each input row's group; any order with ``desc_act``). The stored
  zero point is the true one minus 1 (the format's historical offset; ``checkpoint_format
  == "gptq_v2"`` stores it as is). w[i] = (q[i] - z[g_idx[i]]) * s[g_idx[i]]. With act
  order the rows are sorted by group at load and the matmul permutes x instead (perm).
- compressed-tensors (llm-compressor): ``pack-quantized`` (W4A16 / W8A16, grouped or
  per channel): ``weight_packed`` int32 [out, in * bits / 32] (packed along the input,
  values stored with an offset of 2^(bits-1)), ``weight_scale`` [out, G],
  optional ``weight_g_idx`` int32 [in] (``actorder: "group"``, written by llm-compressor
  before compressed-tensors 0.20 dropped it, e.g. in RedHatAI's w4a16 models: input i
  belongs to group g_idx[i]; sorted by group at load like GPTQ's act order),
  optional ``weight_zero_point`` [out, G] (asymmetric; not built: refused);
  ``int-quantized`` (W8A8 int8): ``weight`` int8 [out, in], ``weight_scale`` [out, 1];
  ``float-quantized`` (FP8 W8A8): ``weight`` float8_e4m3fn [out, in], ``weight_scale``
  [out, 1] or a scalar; W8A8 activations use dynamic per-token scales (a static
  ``input_scale`` in the checkpoint is read and not used: refused unless dynamic).

Refusals (ValueError naming the tensor): a module missing one of its tensors, shapes that
disagree with the config, AWQ other than 4-bit GEMM, GPTQ bits other than 4 / 8, act-order
groups of unequal size or a g_idx / weight_g_idx of the wrong length, an asymmetric
compressed-tensors scheme.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pagedjax.model.quant.weight import QuantizedWeight, pack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column AWQ_ORDER[k]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]


def unpack_int32(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Sequentially packed int32 words -> uint8 codes, expanded along ``axis`` (value k
    of a word at bits [k*bits, (k+1)*bits))."""
    per = 32 // bits
    u = np.asarray(words).astype(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits).reshape(
        [per if a == axis + 1 else 1 for a in range(u.ndim + 1)]
    )
    vals = (np.expand_dims(u, axis + 1) >> shifts) & ((1 << bits) - 1)
    shape = list(u.shape)
    shape[axis] *= per
    return vals.reshape(shape).astype(np.uint8)


def pack_int32(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Inverse of unpack_int32 (tests and writers): codes < 2^bits packed along axis."""
    per = 32 // bits
    c = np.moveaxis(np.asarray(codes, np.uint32), axis, 0)
    c = c.reshape(c.shape[0] // per, per, *c.shape[1:])
    words = np.zeros(c.shape[:1] + c.shape[2:], np.uint32)
    for k in range(per):
        words |= c[:, k] << np.uint32(k * bits)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), 0, axis))


def _awq_columns(codes: np.ndarray) -> np.ndarray:
    """Sequential unpack of AWQ words [r, out] -> natural column order (undo AWQ_ORDER)."""
    r, n = codes.shape
    by_nibble = codes.reshape(r, n // 8, 8)
    return by_nibble[:, :, list(AWQ_REVERSE_ORDER)].reshape(r, n)


def awq_to_codes(words: np.ndarray) -> np.ndarray:
    """AWQ int32 [rows, out/8] -> uint8 4-bit codes [rows, out] in column order."""
    return _awq_columns(unpack_int32(words, 4, axis=1))


def codes_to_awq(codes: np.ndarray) -> np.ndarray:
    """Inverse of awq_to_codes (for tests writing AWQ checkpoints)."""
    r, n = codes.shape
    interleaved = np.asarray(codes).reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)]
    return pack_int32(interleaved.reshape(r, n), 4, axis=1)


def _group_size(in_features: int, groups: int, name: str) -> int:
    if groups < 1 or in_features % groups:
        raise ValueError(f"{name}: {groups} groups do not divide {in_features} inputs")
    return in_features // groups


def act_order_perm(
    g_idx: np.ndarray | None, n_in: int, groups: int, name: str
) -> np.ndarray | None:
    """The row order that makes act-order groups contiguous: ``g_idx`` [in] gives each
    input row's group (GPTQ ``desc_act``, compressed-tensors ``actorder: group``); None
    when absent or already contiguous (row i in group i // group_size), else int32
    ``argsort(g_idx)`` (stable), which sorts the rows by group (QuantizedWeight.perm).
    ValueError when g_idx is not one entry per row or its groups are not all of size
    in / groups."""
    gs = n_in // groups
    if g_idx is None:
        return None
    g_idx = np.asarray(g_idx, np.int64)
    if g_idx.shape != (n_in,):
        raise ValueError(f"{name}: shape {g_idx.shape}, expected ({n_in},)")
    if np.array_equal(g_idx, np.arange(n_in) // gs):
        return None
    counts = np.bincount(g_idx.clip(0), minlength=groups)
    if g_idx.min() < 0 or len(counts) != groups or (counts != gs).any():
        raise ValueError(f"{name}: must give each of {groups} groups {gs} rows")
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def awq_weight(t: dict[str, np.ndarray], name: str) -> QuantizedWeight:
    """An AWQ GEMM module's tensors (qweight, qzeros, scales) -> QuantizedWeight."""
    codes = awq_to_codes(t["qweight"])  # [in, out]
    zeros = awq_to_codes(t["qzeros"])  # [G, out]
    scales = np.asarray(t["scales"], np.float32)
    n_in = codes.shape[0]
    gs = _group_size(n_in, scales.shape[0], name)
    if zeros.shape != scales.shape or codes.shape[1] != scales.shape[1]:
        raise ValueError(
            f"{name}: AWQ shapes disagree: qweight -> {codes.shape}, qzeros -> {zeros.shape},"
            f" scales {scales.shape}"
        )
    return QuantizedWeight(pack_nibbles(codes), scales, zero=zeros, in_features=n_in, bits=4,
                           group_size=gs, fmt="awq").check()  # fmt: skip


def gptq_weight(
    t: dict[str, np.ndarray], name: str, bits: int, zero_offset: int
) -> QuantizedWeight:
    """A GPTQ module's tensors (qweight, qzeros, scales, g_idx) -> QuantizedWeight; the
    stored zero point plus ``zero_offset`` (1 for the "gptq" format) is the true one."""
    if bits not in (4, 8):
        raise ValueError(f"{name}: GPTQ with {bits} bits is not supported (4 or 8)")
    codes = unpack_int32(t["qweight"], bits, axis=0)  # [in, out]
    scales = np.asarray(t["scales"], np.float32)  # [G, out]
    zeros = unpack_int32(t["qzeros"], bits, axis=1).astype(np.int32) + zero_offset
    n_in, n_out = codes.shape
    g = scales.shape[0]
    gs = _group_size(n_in, g, name)
    if zeros.shape != scales.shape or scales.shape[1] != n_out:
        raise ValueError(
            f"{name}: GPTQ shapes disagree: qweight -> {codes.shape}, qzeros -> "
            f"{zeros.shape}, scales {scales.shape}"
        )
    perm = act_order_perm(t.get("g_idx"), n_in, g, f"{name}.g_idx")
    if perm is not None:
        codes = codes[perm]
    zero_dtype = np.uint8 if zeros.max(initial=0) < 256 else np.int32
    data = pack_nibbles(codes) if bits == 4 else codes
    return QuantizedWeight(data, scales, zero=zeros.astype(zero_dtype), perm=perm,
                           in_features=n_in, bits=bits, group_size=gs,
                           fmt="gptq").check()  # fmt: skip


def compressed_tensors_weight(
    t: dict[str, np.ndarray], name: str, fmt: str, bits: int, act_quant: str
) -> QuantizedWeight:
    """A compressed-tensors module's tensors -> QuantizedWeight. fmt: "pack-quantized",
    "int-quantized" or "float-quantized"; act_quant: "none", "int8" or "fp8"."""
    if "weight_zero_point" in t and np.any(np.asarray(t["weight_zero_point"]) != 0):
        raise ValueError(f"{name}: asymmetric compressed-tensors weights are not supported")
    scale = np.asarray(t["weight_scale"], np.float32)
    if fmt == "pack-quantized":
        codes = unpack_int32(t["weight_packed"], bits, axis=1).T  # [in, out], offset codes
        n_in, n_out = codes.shape
        scale = scale.reshape(n_out, -1).T  # [G, out]
        gs = _group_size(n_in, scale.shape[0], name)
        # actorder "group" (llm-compressor's GPTQ): weight_packed keeps the checkpoint's
        # column order and weight_g_idx names each input's group, as GPTQ's g_idx does.
        perm = act_order_perm(t.get("weight_g_idx"), n_in, scale.shape[0],
                              f"{name}.weight_g_idx")  # fmt: skip
        if perm is not None:
            codes = codes[perm]
        data = pack_nibbles(codes) if bits <= 4 else codes
        return QuantizedWeight(data, scale, perm=perm, in_features=n_in, bits=bits,
                               group_size=gs, code_offset=1 << (bits - 1),
                               fmt=fmt).check()  # fmt: skip
    w = np.ascontiguousarray(np.asarray(t["weight"]).T)  # [in, out]
    n_in, n_out = w.shape
    scale = scale.reshape(1, 1) if scale.size == 1 else scale.reshape(n_out, -1).T
    if scale.shape[0] != 1:
        raise ValueError(f"{name}: {fmt} weights need a per-tensor or per-channel scale")
    return QuantizedWeight(w, scale, in_features=n_in, bits=8, group_size=n_in,
                           act_quant=act_quant, fmt=fmt).check()  # fmt: skip


Builder = Callable[[dict[str, np.ndarray], str], QuantizedWeight]


def collect_modules(
    tensors: dict[str, np.ndarray], marker: str, parts: tuple[str, ...], optional: tuple[str, ...]
) -> dict[str, dict[str, np.ndarray]]:
    """Pops every quantized module's tensors out of ``tensors``: modules are found by
    their ``marker`` tensor (``<module>.<marker>``); returns {module: {part: array}}.
    ValueError naming a module that lacks one of ``parts``."""
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key in [k for k in tensors if k.endswith("." + marker)]:
        base = key[: -len(marker) - 1]
        got = {}
        for part in (*parts, *optional):
            full = f"{base}.{part}"
            if full in tensors:
                got[part] = tensors.pop(full)
            elif part in parts:
                raise ValueError(f"quantized module {base!r} lacks tensor {full!r}")
        modules[base] = got
    return modules


def config_get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    return cfg[key] if cfg.get(key) is not None else default
