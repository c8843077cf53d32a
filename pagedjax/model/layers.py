"""Building blocks shared by the model families: norms, activations, paged self-attention."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pagedjax.attention import write_kv
from pagedjax.model.input import ModelInput

AttentionFn = Callable[..., jax.Array]

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight; statistics in fp32, rounding as in transformers."""

    eps: float
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return weight * xf.astype(x.dtype)


def paged_self_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv: tuple[jax.Array, jax.Array],
    batch: ModelInput,
    *,
    sm_scale: float,
    sliding_window: int | None,
    attention_fn: AttentionFn,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Writes this step's k/v [T, Hkv, D] into the layer's pages, then attends q [T, Hq, D].

    Returns (out [T, Hq, D], (k_pages, v_pages)).
    """
    k_pages, v_pages = write_kv(kv[0], kv[1], k, v, batch.slot_mapping)
    out = attention_fn(
        q,
        k_pages,
        v_pages,
        batch.block_tables,
        batch.kv_lens,
        batch.cu_q_lens,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
    )
    return out, (k_pages, v_pages)
