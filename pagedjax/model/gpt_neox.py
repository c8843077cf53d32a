"""GPT-NeoX (the Pythia family) over the paged KV cache: LayerNorm with bias, partial rotary
(``rotary_pct`` of each head), parallel residual (``x + attn(ln1(x)) + mlp(ln2(x))``) or the
sequential one, a GELU MLP with biases, and an untied output embedding ``embed_out``.

HF's fused ``query_key_value`` (rows laid out per head as [q_h, k_h, v_h]) is split into
q/k/v_proj at load (loader.py), so attention is the rotary families' ``RotaryAttention``.
Decoder layers stacked under ``layers`` and run under one ``fori_loop`` (``layers.LayerLoop``)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
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
    layer_window,
    linear,
    loop_layers,
)
from pagedjax.model.llama import RotaryAttention


def _layer_norm(arch: ModelArch, name: str, param_dtype: Any) -> nn.LayerNorm:
    # torch.nn.LayerNorm: two-pass variance (use_fast_variance=False keeps parity in fp32).
    return nn.LayerNorm(
        epsilon=arch.norm_eps, use_fast_variance=False, name=name, param_dtype=param_dtype
    )


class GPTNeoXDecoderLayer(nn.Module):
    """One layer as the layer loop's body: ((x, k_pool, v_pool), LayerInputs, batch) ->
    (carry, None)."""

    arch: ModelArch
    param_dtype: Any
    attention_fn: AttentionFn
    uniform_window: bool

    @nn.compact
    def __call__(self, carry, inputs: LayerInputs, batch: ModelInput):
        x, *kv = carry
        a, pd = self.arch, self.param_dtype
        window = layer_window(a.layer_windows, self.uniform_window, inputs.window)
        attn, kv = RotaryAttention(a, pd, self.attention_fn, name="attention")(
            _layer_norm(a, "input_layernorm", pd)(x), tuple(kv), inputs.index, window, batch
        )
        post_norm = _layer_norm(a, "post_attention_layernorm", pd)
        if a.parallel_residual:  # HF sums in this order: mlp + attn + x
            x = GPTNeoXMLP(a, pd, name="mlp")(post_norm(x)) + attn + x
        else:
            x = attn + x
            x = GPTNeoXMLP(a, pd, name="mlp")(post_norm(x)) + x
        return (x, *kv), None


class GPTNeoXMLP(nn.Module):
    """dense_4h_to_h(act(dense_h_to_4h(x))), both with bias."""

    arch: ModelArch
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        a, pd = self.arch, self.param_dtype
        h = linear(a.intermediate_size, "dense_h_to_4h", bias=True, param_dtype=pd)(x)
        return linear(a.hidden_size, "dense_4h_to_h", bias=True, param_dtype=pd)(
            activation(a.hidden_act)(h)
        )


class GPTNeoXForCausalLM(nn.Module):
    """apply({'params': p}, kv_cache, batch) -> (kv_cache, fp32 logits [L, vocab])."""

    arch: ModelArch
    param_dtype: Any = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention
    native_matmul: bool = False  # the CPU kernel for stacked weights (native_matmul.py)
    layer_stack: Any = None  # a pipeline's layer runner (model/pipeline.py), or None

    @nn.compact
    def __call__(self, kv_cache: KVPool, batch: ModelInput):
        a, pd = self.arch, self.param_dtype
        embed = nn.Embed(a.vocab_size, a.hidden_size, name="embed_in", param_dtype=pd)
        x = embed(batch.tokens)
        inputs, uniform = layer_inputs(a.layer_windows)
        layers = loop_layers(GPTNeoXDecoderLayer, a.num_layers, self.native_matmul,
                             self.layer_stack)(
            a, pd, self.attention_fn, uniform, name="layers"
        )
        (x, k_pool, v_pool), _ = layers((x, *kv_cache), inputs, batch)
        x = jnp.take(x, batch.logits_indices, axis=0, mode="clip")
        x = _layer_norm(a, "final_layer_norm", pd)(x)
        if a.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = linear(a.vocab_size, "embed_out", bias=False, param_dtype=pd,
                            native=self.native_matmul)(x)
        return (k_pool, v_pool), logits.astype(jnp.float32)
