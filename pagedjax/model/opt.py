"""OPT over the paged KV cache: learned positions (offset 2), pre- or post-LayerNorm per
``do_layer_norm_before``, ReLU MLP, project_in/out when word_embed_proj_dim != hidden_size.
Decoder layers stacked under ``layers`` and run under one ``fori_loop`` (layers.LayerLoop)."""

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
    activation,
    layer_inputs,
    linear,
    loop_layers,
    paged_self_attention,
)

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2 (a fairseq legacy)


def _layer_norm(arch: ModelArch, name: str, param_dtype: Any) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=arch.norm_eps,
        use_bias=arch.layer_norm_affine,
        use_scale=arch.layer_norm_affine,
        use_fast_variance=False,
        name=name,
        param_dtype=param_dtype,
    )


class OPTAttention(nn.Module):
    arch: ModelArch
    param_dtype: Any
    attention_fn: AttentionFn

    @nn.compact
    def __call__(
        self, x: jax.Array, kv: KVPool, layer: jax.Array, batch: ModelInput
    ) -> tuple[jax.Array, KVPool]:
        a, t = self.arch, x.shape[0]
        h, d = a.num_heads, a.head_dim
        dense = lambda name: linear(
            a.hidden_size, name, bias=a.qkv_bias, param_dtype=self.param_dtype
        )
        q = dense("q_proj")(x).reshape(t, h, d)
        k = dense("k_proj")(x).reshape(t, h, d)
        v = dense("v_proj")(x).reshape(t, h, d)
        # HF scales q by head_dim**-0.5 before the product; same math via sm_scale.
        o, kv = paged_self_attention(
            q, k, v, kv, layer, batch,
            sm_scale=d**-0.5, sliding_window=None, attention_fn=self.attention_fn,
        )  # fmt: skip
        return dense("out_proj")(o.reshape(t, h * d)), kv


class OPTDecoderLayer(nn.Module):
    """One layer as the layer loop's body: ((x, k_pool, v_pool), LayerInputs, batch) ->
    (carry, None)."""

    arch: ModelArch
    param_dtype: Any
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, carry, inputs: LayerInputs, batch: ModelInput):
        x, *kv = carry
        a, pd = self.arch, self.param_dtype
        pre = a.do_layer_norm_before
        attn_norm = _layer_norm(a, "self_attn_layer_norm", pd)
        ffn_norm = _layer_norm(a, "final_layer_norm", pd)
        h, kv = OPTAttention(a, pd, self.attention_fn, name="self_attn")(
            attn_norm(x) if pre else x, tuple(kv), inputs.index, batch
        )
        x = x + h
        if not pre:
            x = attn_norm(x)
        h = ffn_norm(x) if pre else x
        h = linear(a.intermediate_size, "fc1", bias=a.mlp_bias, param_dtype=pd)(h)
        h = linear(a.hidden_size, "fc2", bias=a.mlp_bias, param_dtype=pd)(
            activation(a.hidden_act)(h)
        )
        x = x + h
        if not pre:
            x = ffn_norm(x)
        return (x, *kv), None


class OPTForCausalLM(nn.Module):
    """apply({'params': p}, kv_cache, batch) -> (kv_cache, fp32 logits [L, vocab])."""

    arch: ModelArch
    param_dtype: Any = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention
    native_matmul: bool = False  # the CPU kernel for stacked weights (native_matmul.py)
    layer_stack: Any = None  # a pipeline's layer runner (model/pipeline.py), or None

    @nn.compact
    def __call__(self, kv_cache: KVPool, batch: ModelInput):
        a, pd = self.arch, self.param_dtype
        proj_dim = a.word_embed_proj_dim or a.hidden_size
        embed = nn.Embed(a.vocab_size, proj_dim, name="embed_tokens", param_dtype=pd)
        x = embed(batch.tokens)
        if proj_dim != a.hidden_size:
            x = linear(a.hidden_size, "project_in", bias=False, param_dtype=pd)(x)
        positions = nn.Embed(
            a.max_position_embeddings + POSITION_OFFSET, a.hidden_size,
            name="embed_positions", param_dtype=pd,
        )  # fmt: skip
        x = x + positions(batch.positions + POSITION_OFFSET)
        inputs, _ = layer_inputs(a.layer_windows)
        layers = loop_layers(OPTDecoderLayer, a.num_layers, self.native_matmul,
                             self.layer_stack)(
            a, pd, self.attention_fn, name="layers"
        )
        (x, k_pool, v_pool), _ = layers((x, *kv_cache), inputs, batch)
        x = jnp.take(x, batch.logits_indices, axis=0, mode="clip")
        if a.final_layer_norm:
            x = _layer_norm(a, "final_layer_norm", pd)(x)
        if proj_dim != a.hidden_size:
            x = linear(proj_dim, "project_out", bias=False, param_dtype=pd)(x)
        if a.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = linear(a.vocab_size, "lm_head", bias=False, param_dtype=pd,
                            native=self.native_matmul)(x)
        return (k_pool, v_pool), logits.astype(jnp.float32)
