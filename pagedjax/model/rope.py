"""Rotary position embeddings (HF's rotate-half layout), incl. linear and llama3 scaling and
partial rotary (GPT-NeoX's rotary_pct: only the leading ``arch.rotary_dim`` of each head turn)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.config import ModelArch


def inv_frequencies(arch: ModelArch) -> np.ndarray:
    """float32[rotary_dim // 2] inverse frequencies, computed in fp32 as transformers does."""
    dim = arch.rotary_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / np.float32(arch.rope_theta) ** exponent).astype(np.float32)
    params = dict(arch.rope_scaling or ())
    kind = params.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths divided by `factor`, short ones kept, smooth in between.
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               mrope_section: tuple[int, ...] | None = None) -> jax.Array:  # fmt: skip
    """Rotates x [T, heads, head_dim] by positions int32[T]; math in fp32, result in x.dtype.
    Only the leading 2 * len(inv_freq) dimensions turn; the rest pass through (partial rotary).

    M-RoPE (Qwen2-VL, ``mrope_section`` = (s_t, s_h, s_w) summing to len(inv_freq)):
    positions may be int32[3, T] (temporal, height, width rows); frequency j turns by the
    row of the section it falls in, as transformers' ``Qwen2VLRotaryEmbedding``. With the
    three rows equal this is plain RoPE, so a [T] positions array stays valid."""
    rot = 2 * len(inv_freq)
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], positions, inv_freq, mrope_section),
                                x[..., rot:]], -1)  # fmt: skip
    if positions.ndim == 2:
        if mrope_section is None or positions.shape[0] != len(mrope_section):
            raise ValueError(f"positions {positions.shape} need an mrope_section of as many rows")
        row = np.repeat(np.arange(len(mrope_section)), mrope_section)  # frequency -> row
        angles = positions.astype(jnp.float32)[row].T * jnp.asarray(inv_freq)[None, :]
    else:
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
