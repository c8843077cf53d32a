"""In-flight quantization: a 16/32-bit checkpoint's linear weights quantized at load.

Modes (``quantization=`` names; vLLM 0.32's where it has them, pagedjax's own marked):

- ``int8_per_channel_weight_only`` (W8A16): int8 values, one float32 scale per output
  column, symmetric: s = absmax / 127, q = round(w / s). Max error s / 2.
- ``fp8_per_tensor`` / ``fp8_per_channel`` (W8A8 FP8): E4M3 weights on one scale per
  tensor / per output column, s = absmax / 448; activations quantized per token at run
  time (weight.py). E4M3's rounding error is at most half a unit in the last place:
  2^-4 of |w| for normal values, 2^-10 * s below the smallest normal (2^-6 * s).
- ``int4`` (pagedjax's own, W4A16): group 128 along the input (64 or 32 where 128 does
  not divide it, e.g. SmolLM2's hidden size 576), symmetric (no zero point), all 16
  codes: s = max(max(w) / 7, -min(w) / 8) per group, q = round(w / s) in [-8, 7],
  stored as codes q + 8 in nibbles. Max error s / 2 (no value is clipped). pagedjax's
  choice: a group whose negative extreme dominates gets a step 8/7 finer than absmax /
  7 would give it (measured on SmolLM2 in docs/quantization.md).
- ``nf4`` (pagedjax's own, bitsandbytes' NF4): blocks of 64 inputs, absmax scale, each
  value the nearest of the 16 NF4 levels (the normal-quantile code book bitsandbytes
  stores). Max error: half the widest gap between adjacent levels times absmax.

What is quantized: every linear layer of the decoder stack (the ``kernel`` leaves under
``params["layers"]``: attention and MLP projections), except a MoE router (tiny, and its
top-k choice is the most sensitive to error). Embeddings and the LM head stay in the
compute dtype, as vLLM's in-flight modes keep them. Biases stay dense.

Cost: one pass over the weights on the host (numpy, float32); the result is what the
forward reads (``QuantizedWeight`` with a leading layer axis).
Refusals: an unknown mode, or an input dimension the group size does not divide
(int4: 32, nf4: 64), raise ValueError naming the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.quant.weight import QuantizedWeight, pack_nibbles

# bitsandbytes' NF4 code book (functional.get_4bit_type("nf4")): quantiles of N(0, 1)
# scaled to [-1, 1], with an exact zero.
NF4_CODEBOOK: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip

INT4_GROUP = 128
NF4_BLOCK = 64


def _safe(s: np.ndarray) -> np.ndarray:
    """A zero scale (an all-zero group) becomes 1, so q = 0 and w = 0 exactly."""
    return np.where(s > 0, s, 1.0).astype(np.float32)


def quantize_int8_per_channel(w: np.ndarray) -> QuantizedWeight:
    """w float [in, out] -> int8 values, scale [1, out]."""
    w = np.asarray(w, np.float32)
    s = _safe(np.abs(w).max(axis=0, keepdims=True) / 127.0)
    q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    return QuantizedWeight(q, s, in_features=w.shape[0], bits=8, group_size=w.shape[0],
                           fmt="int8_per_channel_weight_only").check()  # fmt: skip


def _quantize_fp8(w: np.ndarray, per_channel: bool) -> QuantizedWeight:
    w = np.asarray(w, np.float32)
    top = np.abs(w).max(axis=0, keepdims=True) if per_channel else np.abs(w).max().reshape(1, 1)
    s = _safe(top / 448.0)
    q = (w / s).astype(jnp.float8_e4m3fn)  # ml_dtypes: round to nearest even
    name = "fp8_per_channel" if per_channel else "fp8_per_tensor"
    return QuantizedWeight(q, s, in_features=w.shape[0], bits=8, group_size=w.shape[0],
                           act_quant="fp8", fmt=name).check()  # fmt: skip


def quantize_fp8_per_tensor(w: np.ndarray) -> QuantizedWeight:
    """w float [in, out] -> E4M3 values, one scale [1, 1]; fp8 activations."""
    return _quantize_fp8(w, per_channel=False)


def quantize_fp8_per_channel(w: np.ndarray) -> QuantizedWeight:
    """w float [in, out] -> E4M3 values, scale [1, out]; fp8 activations."""
    return _quantize_fp8(w, per_channel=True)


def _groups(w: np.ndarray, size: int, mode: str) -> np.ndarray:
    n_in, n_out = w.shape
    if n_in % size:
        raise ValueError(f"{mode}: input dimension {n_in} is not a multiple of {size}")
    return w.reshape(n_in // size, size, n_out)


def int4_group(n_in: int) -> int:
    """128, or where 128 does not divide the input (SmolLM2's 576) the largest power of
    two below it that does, down to 32; ValueError below that."""
    size = INT4_GROUP
    while n_in % size and size > 32:
        size //= 2
    if n_in % size:
        raise ValueError(f"int4: input dimension {n_in} is not a multiple of 32")
    return size


def quantize_int4(w: np.ndarray, group_size: int | None = None) -> QuantizedWeight:
    """w float [in, out] -> symmetric 4-bit codes (q + 8, q in [-8, 7]) per group of
    group_size inputs (default ``int4_group(in)``), scale [in / group_size, out]."""
    w = np.asarray(w, np.float32)
    group_size = group_size or int4_group(w.shape[0])
    g = _groups(w, group_size, "int4")
    # The smallest step that reaches both extremes: max on code 7, min on code -8.
    s = _safe(np.maximum(g.max(axis=1) / 7.0, -g.min(axis=1) / 8.0))  # [G, out]
    q = np.clip(np.rint(g / s[:, None, :]), -8, 7).astype(np.int32) + 8
    return QuantizedWeight(pack_nibbles(q.reshape(w.shape)), s, in_features=w.shape[0],
                           bits=4, group_size=group_size, code_offset=8,
                           fmt="int4").check()  # fmt: skip


def quantize_nf4(w: np.ndarray, block: int = NF4_BLOCK) -> QuantizedWeight:
    """w float [in, out] -> NF4 code indices per block of ``block`` inputs, absmax
    scale [in / block, out]."""
    w = np.asarray(w, np.float32)
    g = _groups(w, block, "nf4")
    s = _safe(np.abs(g).max(axis=1))  # [G, out]
    normed = g / s[:, None, :]
    book = np.asarray(NF4_CODEBOOK, np.float32)
    # Nearest level: the midpoints between sorted levels split [-1, 1] into 16 bins.
    q = np.searchsorted((book[1:] + book[:-1]) / 2, normed).astype(np.uint8)
    return QuantizedWeight(pack_nibbles(q.reshape(w.shape)), s, in_features=w.shape[0],
                           bits=4, group_size=block, codebook=NF4_CODEBOOK,
                           fmt="nf4").check()  # fmt: skip


QUANTIZERS: dict[str, Callable[[np.ndarray], QuantizedWeight]] = {
    "int8_per_channel_weight_only": quantize_int8_per_channel,
    "fp8_per_tensor": quantize_fp8_per_tensor,
    "fp8_per_channel": quantize_fp8_per_channel,
    "int4": quantize_int4,
    "nf4": quantize_nf4,
}
INFLIGHT_MODES = tuple(QUANTIZERS)


def quantized_nbytes(mode: str, n_in: int, n_out: int) -> int:
    """Bytes an [n_in, n_out] weight takes in ``mode`` (codes, float32 scales), computed
    from the shapes alone (a 7B model's tables need no quantization pass)."""
    per_value = {"int4": 0.5, "nf4": 0.5}.get(mode, 1.0)
    groups = {"int4": n_in // int4_group(n_in), "nf4": n_in // NF4_BLOCK}.get(mode, 1)
    scales = 1 if mode == "fp8_per_tensor" else groups * n_out
    if mode not in QUANTIZERS:
        raise ValueError(f"unknown quantization {mode!r}; in-flight modes: {INFLIGHT_MODES}")
    return int(n_in * n_out * per_value) + 4 * scales


def error_bound(w: np.ndarray, q: QuantizedWeight) -> np.ndarray:
    """Per-element bound [in, out] on |w - dequantize(q)| for q made from w by this
    module (module docstring), with 1e-6 relative slack for float32 rounding."""
    w = np.asarray(w, np.float32)
    s = np.broadcast_to(np.asarray(q.scale, np.float32), (q.num_groups, q.out_features))
    s = np.repeat(s, q.group_size, axis=0)  # [in, out]
    if q.is_float:
        bound = np.maximum(np.abs(w) * 2.0**-4, s * 2.0**-10)
    elif q.codebook is not None:
        gaps = np.diff(np.asarray(q.codebook, np.float32))
        bound = s * gaps.max() / 2
    else:
        bound = s / 2
    return bound * (1 + 1e-6) + 1e-12


def _is_quantized_role(path: tuple[str, ...]) -> bool:
    return (
        len(path) >= 2
        and path[0] == "layers"
        and path[-1] == "kernel"
        and not (len(path) >= 3 and path[-2] == "gate" and path[-3] == "block_sparse_moe")
    )


def quantize_params(params: Any, mode: str, group_size: int | None = None) -> Any:
    """params (dense, any float dtype) -> the same tree with every decoder linear's
    ``kernel`` [L, in, out] replaced by a stacked ``QuantizedWeight`` of ``mode``.
    ``group_size``: int4's group / nf4's block instead of the mode's default (tests,
    experiments; the engine's modes use the defaults)."""
    if mode not in QUANTIZERS:
        raise ValueError(f"unknown quantization {mode!r}; in-flight modes: {INFLIGHT_MODES}")
    quantizer = QUANTIZERS[mode]
    if group_size is not None:
        if mode not in ("int4", "nf4"):
            raise ValueError(f"{mode}: no group size to choose (int4 and nf4 have one)")
        base = quantizer

        def quantizer(w: np.ndarray) -> QuantizedWeight:
            return base(w, group_size)  # int4's group_size, nf4's block (2nd argument)

    def one(path, leaf):
        keys = tuple(getattr(p, "key", str(p)) for p in path)
        if not _is_quantized_role(keys) or isinstance(leaf, QuantizedWeight):
            return leaf
        host = np.asarray(jax.device_get(leaf), np.float32)
        try:
            layers = [quantizer(host[i]) for i in range(host.shape[0])]
        except ValueError as e:
            raise ValueError(f"{'/'.join(keys)}: {e}") from None
        return jax.tree.map(lambda *a: jnp.asarray(np.stack(a)), *layers)

    return jax.tree_util.tree_map_with_path(
        one, params, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )
