"""Llama family over the paged KV cache: Llama 2/3 (llama3 RoPE), Mistral (sliding window),
Qwen2 (qkv bias). Parameter names follow the HF module names, so conversion is mechanical;
the decoder layers are stacked under ``layers`` (leading axis = layer) and run under one
``lax.scan`` (layers.py says why)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pagedjax.attention import ragged_paged_attention
from pagedjax.model.config import ModelArch
from pagedjax.model.input import ModelInput
from pagedjax.model.layers import (
    AttentionFn,
    KVPool,
    LayerInputs,
    RMSNorm,
    Window,
    activation,
    layer_inputs,
    layer_window,
    paged_self_attention,
    scan_layers,
)
from pagedjax.model.rope import apply_rope, inv_frequencies


class LlamaAttention(nn.Module):
    arch: ModelArch
    param_dtype: Any
    attention_fn: AttentionFn

    @nn.compact
    def __call__(
        self, x: jax.Array, kv: KVPool, layer: jax.Array, window: Window, batch: ModelInput
    ) -> tuple[jax.Array, KVPool]:
        a, t = self.arch, x.shape[0]
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim

        def proj(name: str, features: int, bias: bool) -> nn.Dense:
            return nn.Dense(features, use_bias=bias, name=name, param_dtype=self.param_dtype)

        q = proj("q_proj", h * d, a.qkv_bias)(x).reshape(t, h, d)
        k = proj("k_proj", hkv * d, a.qkv_bias)(x).reshape(t, hkv, d)
        v = proj("v_proj", hkv * d, a.qkv_bias)(x).reshape(t, hkv, d)
        inv_freq = inv_frequencies(a)
        q = apply_rope(q, batch.positions, inv_freq)
        k = apply_rope(k, batch.positions, inv_freq)
        o, kv = paged_self_attention(
            q, k, v, kv, layer, batch,
            sm_scale=d**-0.5,
            sliding_window=window,
            attention_fn=self.attention_fn,
        )  # fmt: skip
        return proj("o_proj", a.hidden_size, a.o_bias)(o.reshape(t, h * d)), kv


class LlamaMLP(nn.Module):
    arch: ModelArch
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        a = self.arch
        dense = lambda name, f: nn.Dense(
            f, use_bias=a.mlp_bias, name=name, param_dtype=self.param_dtype
        )
        act = activation(a.hidden_act)
        up = act(dense("gate_proj", a.intermediate_size)(x)) * dense(
            "up_proj", a.intermediate_size
        )(x)
        return dense("down_proj", a.hidden_size)(up)


class LlamaDecoderLayer(nn.Module):
    """One layer as a scan body: ((x [T, H], k_pool, v_pool), LayerInputs, batch) ->
    (carry, None)."""

    arch: ModelArch
    param_dtype: Any
    attention_fn: AttentionFn
    uniform_window: bool

    @nn.compact
    def __call__(self, carry, inputs: LayerInputs, batch: ModelInput):
        x, k_pool, v_pool = carry
        eps, pd = self.arch.norm_eps, self.param_dtype
        window = layer_window(self.arch.layer_windows, self.uniform_window, inputs.window)
        h, (k_pool, v_pool) = LlamaAttention(self.arch, pd, self.attention_fn, name="self_attn")(
            RMSNorm(eps, pd, name="input_layernorm")(x), (k_pool, v_pool), inputs.index,
            window, batch,
        )  # fmt: skip
        x = x + h
        x = x + LlamaMLP(self.arch, pd, name="mlp")(
            RMSNorm(eps, pd, name="post_attention_layernorm")(x)
        )
        return (x, k_pool, v_pool), None


class LlamaForCausalLM(nn.Module):
    """apply({'params': p}, kv_cache, batch) -> (kv_cache, fp32 logits [L, vocab])."""

    arch: ModelArch
    param_dtype: Any = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention

    @nn.compact
    def __call__(self, kv_cache: KVPool, batch: ModelInput):
        a, pd = self.arch, self.param_dtype
        embed = nn.Embed(a.vocab_size, a.hidden_size, name="embed_tokens", param_dtype=pd)
        x = embed(batch.tokens)
        inputs, uniform = layer_inputs(a.layer_windows)
        layers = scan_layers(LlamaDecoderLayer, a.num_layers)(
            a, pd, self.attention_fn, uniform, name="layers"
        )
        (x, k_pool, v_pool), _ = layers((x, *kv_cache), inputs, batch)
        # Norm and head are per token: gather first, so only the requested rows pay for them.
        x = jnp.take(x, batch.logits_indices, axis=0, mode="clip")
        x = RMSNorm(a.norm_eps, pd, name="norm")(x)
        if a.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(a.vocab_size, use_bias=False, name="lm_head", param_dtype=pd)(x)
        return (k_pool, v_pool), logits.astype(jnp.float32)
