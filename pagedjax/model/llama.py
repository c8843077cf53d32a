"""Llama family over the paged KV cache: Llama 2/3 (llama3 RoPE), Mistral (sliding window),
Qwen2 (qkv bias). Parameter names follow the HF module names, so conversion is mechanical."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pagedjax.attention import ragged_paged_attention
from pagedjax.model.config import ModelArch
from pagedjax.model.input import ModelInput
from pagedjax.model.layers import AttentionFn, RMSNorm, activation, paged_self_attention
from pagedjax.model.rope import apply_rope, inv_frequencies

KV = tuple[jax.Array, jax.Array]


class LlamaAttention(nn.Module):
    arch: ModelArch
    layer: int
    param_dtype: Any
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, x: jax.Array, kv: KV, batch: ModelInput) -> tuple[jax.Array, KV]:
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
            q, k, v, kv, batch,
            sm_scale=d**-0.5,
            sliding_window=a.layer_windows[self.layer],
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
    arch: ModelArch
    layer: int
    param_dtype: Any
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, x: jax.Array, kv: KV, batch: ModelInput) -> tuple[jax.Array, KV]:
        eps, pd = self.arch.norm_eps, self.param_dtype
        h, kv = LlamaAttention(self.arch, self.layer, pd, self.attention_fn, name="self_attn")(
            RMSNorm(eps, pd, name="input_layernorm")(x), kv, batch
        )
        x = x + h
        x = x + LlamaMLP(self.arch, pd, name="mlp")(
            RMSNorm(eps, pd, name="post_attention_layernorm")(x)
        )
        return x, kv


class LlamaForCausalLM(nn.Module):
    """apply({'params': p}, kv_cache, batch) -> (kv_cache, fp32 logits [L, vocab])."""

    arch: ModelArch
    param_dtype: Any = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention

    @nn.compact
    def __call__(self, kv_cache, batch: ModelInput):
        a, pd = self.arch, self.param_dtype
        embed = nn.Embed(a.vocab_size, a.hidden_size, name="embed_tokens", param_dtype=pd)
        x = embed(batch.tokens)
        new_cache = []
        for i in range(a.num_layers):
            layer = LlamaDecoderLayer(a, i, pd, self.attention_fn, name=f"layers_{i}")
            x, kv = layer(x, kv_cache[i], batch)
            new_cache.append(kv)
        # Norm and head are per token: gather first, so only the requested rows pay for them.
        x = jnp.take(x, batch.logits_indices, axis=0, mode="clip")
        x = RMSNorm(a.norm_eps, pd, name="norm")(x)
        if a.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(a.vocab_size, use_bias=False, name="lm_head", param_dtype=pd)(x)
        return tuple(new_cache), logits.astype(jnp.float32)
