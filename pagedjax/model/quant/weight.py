"""One representation for every quantized linear weight, and the matmul that reads it.

Contract. A ``QuantizedWeight`` stands where a dense layer's ``kernel`` [in, out] would be
(same parameter name, so the families, the layer loop and the loaders see one tree). It is
a JAX pytree: its arrays are leaves (stacked on a leading layer axis under the layer
loop's ``layers``, sliced per layer by it like any parameter); its format is static
(part of the tree structure, so jit specializes on it and a format change is a new
program, never a silent retrace). The value of weight element (i, o) is

    w[i, o] = scale[g, o] * (value(q[i, o]) - zero[g, o]) + offset[g, o],  g = i // group_size

where ``value(q)`` is ``q - code_offset`` for integer codes or ``codebook[q]`` (NF4), and
``zero`` / ``offset`` are present only for the formats that store them:

- ``data``: the codes. bits <= 4: two codes per uint8 along the input axis ([in/2, out];
  row 2j in the low nibble, 2j+1 in the high one); 5..8 bits: one per byte (uint8 codes,
  or int8 signed values with code_offset 0); fp8: float8_e4m3fn values [in, out].
- ``scale``: float32 [G, out] (G = in / group_size), [1, out] per channel or [1, 1] per
  tensor; broadcast over the groups.
- ``zero``: optional uint8 [G, out] integer zero point (AWQ, asymmetric GPTQ): subtracted
  from the integer value before scaling, so the dequantized value is exact ((q - z) * s,
  one rounding), as those formats define it.
- ``offset``: optional float32 [G, out] additive term (GGUF Q4_1 and K-quants: d*q + m).
- ``perm``: optional int32 [in] input permutation (GPTQ act order): rows were sorted by
  group at load, so the matmul reads ``x[..., perm]`` and the groups are contiguous.

Activations: ``act_quant`` "none" (W-only: the weight is dequantized to the activations'
dtype) or "fp8" (W8A8 FP8: each token's activations are rounded to E4M3 with a dynamic
per-token scale absmax / 448, then multiplied in the compute dtype, the pattern XLA's
GPU gemm rewriter turns into an FP8 cuBLASLt call on Hopper; on a CPU it is an emulation
with ml_dtypes' float8: same rounding, no speed-up) or "int8" (W8A8 int8, dynamic
per-token scale absmax / 127, emulated the same way).

Cost. ``quantized_matmul`` picks, from static shapes, the form with the smaller
intermediate: for few tokens (T <= group_size; decode), or a single group (per channel
or per tensor) at any T, a grouped dot (x's groups times the integer values, scales
applied to the [T, G, out] partial sums, zero points as scale * zero * sum(x_g)), so the
multiply by the scale is not paid per weight; for many tokens (prefill) with several
groups the weight is dequantized to the compute dtype ([in, out] transient, one
matrix at a time) and one dot runs. Both are plain XLA, jittable on every backend. The
bytes read per step are the packed ones; the dequantize-then-dot form trades compute
for that, and a fused kernel (Pallas W4A16, not built yet) would remove the transient.

Refusals: ``QuantizedWeight.check()`` raises ValueError for inconsistent shapes (a group
size not dividing the input, nibble-packed rows not matching in/2, a zero point on a
float format, ...); loaders call it on every weight they build.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ACT_QUANT = ("none", "fp8", "int8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [in, out] linear weight (module docstring: layout and value)."""

    data: Any
    scale: Any
    zero: Any = None
    offset: Any = None
    perm: Any = None
    in_features: int = dataclasses.field(default=0, metadata=dict(static=True))
    bits: int = dataclasses.field(default=8, metadata=dict(static=True))
    group_size: int = dataclasses.field(default=0, metadata=dict(static=True))
    code_offset: int = dataclasses.field(default=0, metadata=dict(static=True))
    codebook: tuple[float, ...] | None = dataclasses.field(
        default=None, metadata=dict(static=True)
    )
    act_quant: str = dataclasses.field(default="none", metadata=dict(static=True))
    fmt: str = dataclasses.field(default="", metadata=dict(static=True))  # for messages

    @property
    def is_float(self) -> bool:
        return np.dtype(self.data.dtype) == np.dtype(jnp.float8_e4m3fn)

    @property
    def out_features(self) -> int:
        return int(self.data.shape[-1])

    @property
    def num_groups(self) -> int:
        return self.in_features // self.group_size

    def check(self) -> QuantizedWeight:
        """ValueError unless the arrays agree with the static format; returns self.
        Works on one layer's weight or a stack (leading axes allowed)."""
        what = f"quantized weight ({self.fmt or 'format ?'})"
        n_in, n_out = self.in_features, self.out_features
        if self.act_quant not in ACT_QUANT:
            raise ValueError(f"{what}: act_quant must be one of {ACT_QUANT}")
        if n_in < 1 or self.group_size < 1 or n_in % self.group_size:
            raise ValueError(
                f"{what}: group_size {self.group_size} must divide in_features {n_in}"
            )
        rows = n_in // 2 if self.bits <= 4 and not self.is_float else n_in
        if self.data.shape[-2] != rows:
            raise ValueError(f"{what}: data has {self.data.shape[-2]} rows, expected {rows}")
        g = self.num_groups
        if self.scale.shape[-2:] not in ((g, n_out), (1, n_out), (1, 1)):
            raise ValueError(
                f"{what}: scale shape {self.scale.shape[-2:]} is not [{g}, {n_out}], "
                f"[1, {n_out}] or [1, 1]"
            )
        for name in ("zero", "offset"):
            arr = getattr(self, name)
            if arr is not None and arr.shape[-2:] != (g, n_out):
                raise ValueError(f"{what}: {name} shape {arr.shape[-2:]} != ({g}, {n_out})")
        if self.is_float and (self.zero is not None or self.codebook is not None):
            raise ValueError(f"{what}: an fp8 weight has no zero point or code book")
        if self.codebook is not None and len(self.codebook) != 1 << self.bits:
            raise ValueError(f"{what}: code book needs {1 << self.bits} entries")
        if self.perm is not None and self.perm.shape[-1] != n_in:
            raise ValueError(f"{what}: perm has {self.perm.shape[-1]} entries, not {n_in}")
        return self

    def nbytes(self) -> int:
        """Bytes of every array held (data, scales, zeros, offsets, perm)."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(self))  # fmt: skip


def unpack_nibbles(data: jax.Array) -> jax.Array:
    """uint8 [..., in/2, out] -> uint8 [..., in, out] (row 2j: low nibble, 2j+1: high)."""
    lo = data & 0xF
    hi = data >> 4
    stacked = jnp.stack([lo, hi], axis=-2)  # [..., in/2, 2, out]
    return stacked.reshape(*data.shape[:-2], data.shape[-2] * 2, data.shape[-1])


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Inverse of unpack_nibbles, on the host: uint8 codes < 16 [..., in, out] ->
    [..., in/2, out]."""
    codes = np.asarray(codes, np.uint8)
    if codes.shape[-2] % 2:
        raise ValueError(f"nibble packing needs an even number of rows, got {codes.shape}")
    if codes.size and codes.max() > 15:
        raise ValueError("nibble packing needs codes < 16")
    return (codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)).astype(np.uint8)


def code_values(w: QuantizedWeight, dtype: Any) -> jax.Array:
    """The integer (or code-book) values of w's codes, [in, out] in dtype; fp8 weights
    give their float values."""
    if w.is_float:
        return w.data.astype(dtype)
    q = unpack_nibbles(w.data) if w.bits <= 4 else w.data
    if w.codebook is not None:
        return jnp.asarray(w.codebook, dtype)[q.astype(jnp.int32)]
    # Integer arithmetic first (exact), one conversion after.
    return (q.astype(jnp.int32) - w.code_offset).astype(dtype)


def _per_group(a: jax.Array, w: QuantizedWeight) -> jax.Array:
    """scale / zero / offset [g, out] -> [G, out] (broadcast, no copy until used)."""
    return jnp.broadcast_to(a, (w.num_groups, w.out_features))


def dequantize(w: QuantizedWeight, dtype: Any = jnp.float32) -> jax.Array:
    """The dense [in, out] weight in dtype, computed in float32 (exact for the integer
    formats up to one rounding of (q - z) * s), rows in the checkpoint's order (perm
    undone)."""
    v = code_values(w, jnp.float32)
    g, gs, n_out = w.num_groups, w.group_size, w.out_features
    v = v.reshape(g, gs, n_out)
    if w.zero is not None:
        v = v - _per_group(w.zero, w).astype(jnp.float32)[:, None, :]
    v = v * _per_group(w.scale.astype(jnp.float32), w)[:, None, :]
    if w.offset is not None:
        v = v + _per_group(w.offset.astype(jnp.float32), w)[:, None, :]
    dense = v.reshape(w.in_features, n_out)
    if w.perm is not None:  # row r of dense is checkpoint row perm[r]
        dense = jnp.zeros_like(dense).at[w.perm].set(dense)
    return dense.astype(dtype)


def _quantize_activations(x: jax.Array, mode: str) -> jax.Array:
    """Dynamic per-token fake quantization: x rounded to E4M3 (or int8) on its row's
    absmax scale, returned in x's dtype (the product the hardware path would compute)."""
    xf = x.astype(jnp.float32)
    top = FP8_MAX if mode == "fp8" else INT8_MAX
    s = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / top
    s = jnp.where(s > 0, s, 1.0)
    if mode == "fp8":
        xq = (xf / s).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        xq = jnp.clip(jnp.round(xf / s), -INT8_MAX, INT8_MAX)
    return (xq * s).astype(x.dtype)


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [..., in] @ w -> [..., out] in x's dtype (module docstring: the two forms)."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {w.in_features}")
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    if w.act_quant != "none":
        x = _quantize_activations(x, w.act_quant)
    dtype = x.dtype
    lead, n_in, n_out = x.shape[:-1], w.in_features, w.out_features
    tokens = int(np.prod(lead)) if lead else 1
    x2 = x.reshape(tokens, n_in)
    if w.perm is not None:
        # Dequantize in the permuted (grouped) order: the rows of v follow x2's columns.
        w_sorted = dataclasses.replace(w, perm=None)
    else:
        w_sorted = w
    # One group (per channel / per tensor): the scale multiplies the output, any T.
    grouped = w.num_groups == 1 or tokens <= w.group_size
    if not grouped:
        y = jnp.dot(x2, dequantize(w_sorted, dtype), preferred_element_type=jnp.float32)
        return y.astype(dtype).reshape(*lead, n_out)
    g, gs = w.num_groups, w.group_size
    xg = x2.reshape(tokens, g, gs)
    v = code_values(w, dtype).reshape(g, gs, n_out)
    if jax.default_backend() == "cpu" and dtype != jnp.float32:
        # XLA's CPU batched dot has no bf16/f16 x bf16/f16 -> f32 form ("Unsupported
        # element type for DotThunk"); widening first is the same arithmetic (products of
        # 16-bit floats are exact in f32, summed in f32 as preferred_element_type asks).
        xg, v = xg.astype(jnp.float32), v.astype(jnp.float32)
    part = jnp.einsum("tgk,gko->tgo", xg, v, preferred_element_type=jnp.float32)
    if w.zero is not None:
        xsum = jnp.sum(xg.astype(jnp.float32), axis=-1)  # [T, G]
        part = part - xsum[..., None] * _per_group(w.zero, w).astype(jnp.float32)
    y = jnp.sum(part * _per_group(w.scale.astype(jnp.float32), w), axis=1)
    if w.offset is not None:
        xsum = jnp.sum(xg.astype(jnp.float32), axis=-1)
        y = y + xsum @ _per_group(w.offset.astype(jnp.float32), w)
    return y.astype(dtype).reshape(*lead, n_out)


def embedding_rows(w: QuantizedWeight, ids: jax.Array, dtype: Any) -> jax.Array:
    """Rows ``ids`` [T] of the [out, in] matrix whose transpose w holds (a quantized
    token embedding in the LM head's layout [hidden, vocab]): only the T looked-up
    columns are dequantized. Returns [T, in] in dtype."""

    def cols(a: Any) -> Any:
        if a is None or a.ndim < 2 or a.shape[-1] != w.out_features:
            return a  # per-tensor scales, perm: shared by every column
        return jnp.take(a, ids, axis=-1)

    picked = dataclasses.replace(
        w, data=cols(w.data), scale=cols(w.scale), zero=cols(w.zero), offset=cols(w.offset)
    )
    return dequantize(picked, dtype).T


def compute_dtype(params: Any) -> Any:
    """The dtype a model computes in: that of its first floating parameter outside the
    quantized weights (whose codes are ints or fp8 and whose scales are float32)."""
    plain = jax.tree.map(
        lambda x: None if isinstance(x, QuantizedWeight) else x, params,
        is_leaf=lambda x: isinstance(x, QuantizedWeight),
    )  # fmt: skip
    for leaf in jax.tree.leaves(plain):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.dtype
    raise ValueError("params hold no floating-point array outside quantized weights")


def stack_layers(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Per-layer weights of one role -> one weight with a leading layer axis (the layer
    loop's layout). ValueError if their formats differ (they could not share a layer-loop body)."""
    formats = {jax.tree.structure(w) for w in weights}
    if len(formats) != 1:
        raise ValueError(
            f"layers of one linear role must share a format to be stacked, got "
            f"{sorted({w.fmt for w in weights})}"
        )
    return jax.tree.map(lambda *a: np.stack(a), *weights)
