"""The Pallas W4A16 kernel (``pallas_kernels/w4a16.py``) on a ``QuantizedWeight``.

Contract. ``pallas_w4a16_matmul(x, w)`` computes what ``quantized_matmul(x, w)`` does for a
4-bit integer weight, with the kernel: x [T, in] (T <= 64, decode), one layer's weight
(no leading layer axis), codes two per byte along the input (the representation's own
packing, handed over as is). The kernel's weight is ``scale * code + bias``, so the
representation's terms are folded on the host side of the call:

    bias[g, o] = offset[g, o] - scale[g, o] * (code_offset + zero[g, o])

which is the same value as ``scale * (code - code_offset - zero) + offset`` (one more
float32 rounding of a product; the kernel then rounds the weight to bf16 / fp16 for the
tensor cores, which dominates). A GPTQ act-order ``perm`` is applied to x first.

Refusals (ValueError naming the format): code books (NF4: not affine in the code), fp8,
5-8 bit codes, activation quantization, more than 64 tokens, a stacked weight.

Status: kernel-only. Nothing selects it: ``layers.Linear`` always runs the XLA
``quantized_matmul``, because the kernel has no GPU parity or timing run (the attention
kernels are auto-selected only with one). It is tested in the GPU interpreter against
``quantized_matmul`` (tests/test_quantization_pallas.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.model.quant.weight import QuantizedWeight
from pallas_kernels.w4a16 import ROWS, w4a16_matmul


def w4a16_operands(w: QuantizedWeight) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(data uint8 [in/2, out], scale f32 [G, out], bias f32 [G, out]) in the kernel's
    form (module docstring); ValueError for a format the kernel does not take."""
    what = f"Pallas W4A16 kernel: {w.fmt or 'quantized weight'}"
    if w.is_float or w.bits != 4 or w.codebook is not None:
        raise ValueError(f"{what} is not 4-bit integer codes (bits={w.bits}, code book="
                         f"{w.codebook is not None}, fp8={w.is_float})")  # fmt: skip
    if w.act_quant != "none":
        raise ValueError(f"{what}: activation quantization {w.act_quant!r} (W4A16 only)")
    if w.data.ndim != 2:
        raise ValueError(f"{what}: one layer's weight, got data {w.data.shape} (stacked?)")
    shape = (w.num_groups, w.out_features)
    scale = jnp.broadcast_to(w.scale.astype(jnp.float32), shape)
    zero = 0.0 if w.zero is None else w.zero.astype(jnp.float32)
    offset = 0.0 if w.offset is None else w.offset.astype(jnp.float32)
    bias = jnp.broadcast_to(offset - scale * (w.code_offset + zero), shape)
    return w.data, scale, bias


def pallas_w4a16_matmul(x: jax.Array, w: QuantizedWeight, *, interpret: Any = None) -> jax.Array:
    """x [..., in] (at most 64 tokens) @ w -> [..., out] in x's dtype, by the kernel.
    ``interpret``: None on a GPU, ``pallas_kernels.w4a16.default_interpret()`` on CPU."""
    data, scale, bias = w4a16_operands(w)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > ROWS:
        raise ValueError(f"Pallas W4A16 kernel: {x2.shape[0]} tokens, at most {ROWS} (decode)")
    if w.perm is not None:
        x2 = jnp.take(x2, w.perm, axis=-1)
    y = w4a16_matmul(x2, data, scale, bias, in_features=w.in_features,
                     out_features=w.out_features, group_size=w.group_size,
                     interpret=interpret)  # fmt: skip
    return y.reshape(*lead, w.out_features)


__all__ = ["pallas_w4a16_matmul", "w4a16_operands"]
