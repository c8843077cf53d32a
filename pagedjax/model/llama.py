"""The rotary pre-norm decoder over the paged KV cache, and the families built on it:
Llama 2/3 (llama3 RoPE), Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k RMSNorm per
head), Phi-3 (its fused qkv_proj / gate_up_proj are split at load), Gemma 2 (soft caps,
(1 + weight) norms around both blocks, scaled embeddings, alternating windows) and Mixtral
(a sparse MoE in place of the MLP). Which features a model uses is read off its ModelArch.

Parameter names follow the HF module names, so conversion is mechanical; the decoder layers
are stacked under ``layers`` (leading axis = layer) and run under one ``fori_loop``
(``layers.LayerLoop``; layers.py says why)."""

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
    Embedding,
    KVPool,
    LayerInputs,
    RMSNorm,
    Window,
    activation,
    layer_inputs,
    layer_window,
    linear,
    loop_layers,
    paged_self_attention,
    soft_cap,
)
from pagedjax.model.moe import SparseMoE
from pagedjax.model.rope import apply_rope, inv_frequencies


class RotaryAttention(nn.Module):
    """Self-attention with RoPE over the paged pool (the Llama family and GPT-NeoX):
    q/k/v_proj, optional per-head q/k RMSNorm (Qwen3), (partial) RoPE, o_proj."""

    arch: ModelArch
    param_dtype: Any
    attention_fn: AttentionFn

    @nn.compact
    def __call__(
        self, x: jax.Array, kv: KVPool, layer: jax.Array, window: Window, batch: ModelInput
    ) -> tuple[jax.Array, KVPool]:
        a, t, pd = self.arch, x.shape[0], self.param_dtype
        ls = batch.lora_slots  # per-token LoRA slots, or None (base model)
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        q = linear(h * d, "q_proj", bias=a.qkv_bias, param_dtype=pd)(x, ls).reshape(t, h, d)
        k = linear(hkv * d, "k_proj", bias=a.qkv_bias, param_dtype=pd)(x, ls).reshape(t, hkv, d)
        v = linear(hkv * d, "v_proj", bias=a.qkv_bias, param_dtype=pd)(x, ls).reshape(t, hkv, d)
        if a.qk_norm:
            q = RMSNorm(a.norm_eps, pd, name="q_norm")(q)
            k = RMSNorm(a.norm_eps, pd, name="k_norm")(k)
        inv_freq = inv_frequencies(a)
        # Qwen2-VL's M-RoPE positions when the step has them (ModelInput.rope_positions).
        pos = batch.positions if batch.rope_positions is None else batch.rope_positions
        q = apply_rope(q, pos, inv_freq, a.mrope_section)
        k = apply_rope(k, pos, inv_freq, a.mrope_section)
        scale = a.query_pre_attn_scalar if a.query_pre_attn_scalar is not None else d
        o, kv = paged_self_attention(
            q, k, v, kv, layer, batch,
            sm_scale=scale**-0.5,
            sliding_window=window,
            attention_fn=self.attention_fn,
            logit_soft_cap=a.attn_soft_cap,
        )  # fmt: skip
        return linear(a.hidden_size, "o_proj", bias=a.o_bias, param_dtype=pd)(
            o.reshape(t, h * d), ls
        ), kv


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): SwiGLU (Llama), GeGLU-tanh (Gemma 2)."""

    arch: ModelArch
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, lora_slots: jax.Array | None = None) -> jax.Array:
        a, pd, ls = self.arch, self.param_dtype, lora_slots  # ls: per-token LoRA slots
        dense = lambda name, f: linear(f, name, bias=a.mlp_bias, param_dtype=pd)
        act = activation(a.hidden_act)
        up = act(dense("gate_proj", a.intermediate_size)(x, ls)) * dense(
            "up_proj", a.intermediate_size
        )(x, ls)
        return dense("down_proj", a.hidden_size)(up, ls)


class LlamaDecoderLayer(nn.Module):
    """One layer as the layer loop's body: ((x [T, H], k_pool, v_pool), LayerInputs, batch) ->
    (carry, None). Pre-norm residual blocks; Gemma 2 also norms each block's output."""

    arch: ModelArch
    param_dtype: Any
    attention_fn: AttentionFn
    uniform_window: bool

    @nn.compact
    def __call__(self, carry, inputs: LayerInputs, batch: ModelInput):
        x, k_pool, v_pool = carry
        a, pd = self.arch, self.param_dtype
        norm = lambda name: RMSNorm(a.norm_eps, pd, a.norm_unit_offset, name=name)
        window = layer_window(a.layer_windows, self.uniform_window, inputs.window)
        h, (k_pool, v_pool) = RotaryAttention(a, pd, self.attention_fn, name="self_attn")(
            norm("input_layernorm")(x), (k_pool, v_pool), inputs.index, window, batch,
        )  # fmt: skip
        if a.sandwich_norms:  # Gemma 2: post_attention_layernorm normalizes the block's output
            x = x + norm("post_attention_layernorm")(h)
            h = norm("pre_feedforward_layernorm")(x)
        else:
            x = x + h
            h = norm("post_attention_layernorm")(x)
        if a.num_experts:
            h = SparseMoE(a, pd, name="block_sparse_moe")(h)
        else:
            h = GatedMLP(a, pd, name="mlp")(h, batch.lora_slots)
        if a.sandwich_norms:
            h = norm("post_feedforward_layernorm")(h)
        return (x + h, k_pool, v_pool), None


class LlamaForCausalLM(nn.Module):
    """apply({'params': p}, kv_cache, batch) -> (kv_cache, fp32 logits [L, vocab])."""

    arch: ModelArch
    param_dtype: Any = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention
    native_matmul: bool = False  # the CPU kernel for stacked weights (native_matmul.py)
    layer_stack: Any = None  # a pipeline's layer runner (model/pipeline.py), or None

    @nn.compact
    def __call__(self, kv_cache: KVPool, batch: ModelInput, inputs_embeds: jax.Array | None = None):
        a, pd = self.arch, self.param_dtype
        embed = Embedding(a.vocab_size, a.hidden_size, name="embed_tokens", param_dtype=pd)
        # inputs_embeds [T, hidden]: rows to use instead of looking up batch.tokens (LLaVA's
        # image features merged into the text embeddings); scaled below as HF scales them.
        x = embed(batch.tokens) if inputs_embeds is None else inputs_embeds.astype(pd)
        if a.embed_scale:  # Gemma: sqrt(hidden) rounded to the compute dtype first, as HF
            x = x * jnp.asarray(a.hidden_size**0.5, x.dtype)
        inputs, uniform = layer_inputs(a.layer_windows)
        layers = loop_layers(LlamaDecoderLayer, a.num_layers, self.native_matmul,
                             self.layer_stack)(
            a, pd, self.attention_fn, uniform, name="layers"
        )
        (x, k_pool, v_pool), _ = layers((x, *kv_cache), inputs, batch)
        # Norm and head are per token: gather first, so only the requested rows pay for them.
        x = jnp.take(x, batch.logits_indices, axis=0, mode="clip")
        x = RMSNorm(a.norm_eps, pd, a.norm_unit_offset, name="norm")(x)
        if a.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = linear(a.vocab_size, "lm_head", bias=False, param_dtype=pd,
                            native=self.native_matmul)(x)
        return (k_pool, v_pool), soft_cap(logits.astype(jnp.float32), a.final_soft_cap)
