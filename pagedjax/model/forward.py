"""The pure model step: forward(params, kv_cache, batch) -> (kv_cache, logits)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pagedjax.attention import PAD_SLOT, ragged_paged_attention
from pagedjax.model.config import ModelArch
from pagedjax.model.gpt_neox import GPTNeoXForCausalLM
from pagedjax.model.input import ModelInput
from pagedjax.model.kv_cache import KVCache
from pagedjax.model.layers import AttentionFn
from pagedjax.model.llama import LlamaForCausalLM
from pagedjax.model.opt import OPTForCausalLM
from pagedjax.model.quant.weight import QuantizedWeight, compute_dtype, embedding_rows

Params = Any  # nested dict of arrays, as Flax's "params" collection


def build_module(
    arch: ModelArch,
    param_dtype: Any = jnp.float32,
    attention_fn: AttentionFn = ragged_paged_attention,
    native_matmul: bool = False,
    layer_stack: Any = None,
) -> nn.Module:
    """The Flax module of arch's family (param_dtype only matters for init; native_matmul:
    dense layers may run the CPU kernel for stacked weights, model/native_matmul.py;
    layer_stack: a pipeline's layer runner, model/pipeline.py)."""
    cls = {
        "llama": LlamaForCausalLM,
        "opt": OPTForCausalLM,
        "gpt_neox": GPTNeoXForCausalLM,
    }[arch.family]
    return cls(
        arch, param_dtype=param_dtype, attention_fn=attention_fn, native_matmul=native_matmul,
        layer_stack=layer_stack,
    )  # fmt: skip


def _check_cache(arch: ModelArch, kv_cache: KVCache, layers: int) -> None:
    """layers: the pool's leading axis (num_layers; a pipeline's PP x slots)."""
    if not isinstance(kv_cache, tuple | list) or len(kv_cache) != 2:
        raise ValueError("kv_cache must be (k, v), each [num_layers, num_blocks, ...]")
    k, v = kv_cache
    want = (layers, arch.num_kv_heads, arch.head_dim)
    if k.ndim != 5 or k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[4]) != want:
        raise ValueError(
            f"kv_cache must be (k, v), each [{layers}, num_blocks, "
            f"{arch.num_kv_heads}, block_size, {arch.head_dim}], got k {k.shape}, v {v.shape}"
        )


def forward(
    params: Params,
    kv_cache: KVCache,
    batch: ModelInput,
    *,
    arch: ModelArch,
    attention_fn: AttentionFn = ragged_paged_attention,
    native_matmul: bool = False,
    inputs_embeds: jax.Array | None = None,
    layer_stack: Any = None,
) -> tuple[KVCache, jax.Array]:
    """One step over a ragged batch (prefill, chunked prefill and decode mixed).

    Returns the updated cache (same structure) and fp32 logits [L, vocab] at
    batch.logits_indices. Compute runs in the params' dtype; attention accumulates in fp32.

    inputs_embeds [T, hidden] (optional, Llama family only): the input rows instead of
    embedding batch.tokens, for multi-modal prompts whose image features are merged into
    the text embeddings (model/vision/llava.py). Padding rows are arbitrary.

    layer_stack (pipeline parallelism, model/pipeline.py's ``PipelineStack``): runs the
    decoder layers stage by stage; params' layer stacks and the pool then have its
    ``pool_layers`` (PP x slots) leading rows instead of num_layers.
    """
    _check_cache(arch, kv_cache, arch.num_layers if layer_stack is None
                 else layer_stack.pool_layers)  # fmt: skip
    module = build_module(arch, attention_fn=attention_fn, native_matmul=native_matmul,
                          layer_stack=layer_stack)  # fmt: skip
    if inputs_embeds is None:
        return module.apply({"params": params}, kv_cache, batch)
    if arch.family != "llama":
        raise ValueError(f"inputs_embeds is supported for the llama family, not {arch.family!r}")
    want = (batch.tokens.shape[0], arch.hidden_size)
    if tuple(inputs_embeds.shape) != want:
        raise ValueError(f"inputs_embeds must be {list(want)}, got {inputs_embeds.shape}")
    return module.apply({"params": params}, kv_cache, batch, inputs_embeds)


def text_embeddings(params: Params, arch: ModelArch, ids: jax.Array) -> jax.Array:
    """The Llama family's token embeddings of ids [T] (before Gemma's embed_scale, which
    ``forward`` applies to inputs_embeds too): what ``forward`` would embed itself, for
    callers that replace some rows (image features) and pass ``inputs_embeds``."""
    if arch.family != "llama":
        raise ValueError(f"text_embeddings is for the llama family, not {arch.family!r}")
    table = params["embed_tokens"]["embedding"]
    if isinstance(table, QuantizedWeight):
        return embedding_rows(table, ids, compute_dtype(params))
    return jnp.take(table, ids, axis=0)


@functools.cache
def make_forward(
    arch: ModelArch,
    attention_fn: AttentionFn = ragged_paged_attention,
    donate: bool = True,
) -> Callable[[Params, KVCache, ModelInput], tuple[KVCache, jax.Array]]:
    """jit(forward) for arch with the KV cache donated (updated in place).

    Cached per (arch, attention_fn, donate), so every caller shares one jit and its
    compilations."""
    fn = functools.partial(forward, arch=arch, attention_fn=attention_fn)
    return jax.jit(fn, donate_argnums=(1,) if donate else ())


def dummy_input(num_tokens: int, num_seqs: int, max_blocks: int) -> ModelInput:
    """An all-padding batch of the given static sizes, e.g. to initialize or warm up."""
    zeros = lambda *s: jnp.zeros(s, jnp.int32)
    return ModelInput(
        tokens=zeros(num_tokens),
        positions=zeros(num_tokens),
        slot_mapping=jnp.full((num_tokens,), PAD_SLOT, jnp.int32),
        block_tables=zeros(num_seqs, max_blocks),
        kv_lens=zeros(num_seqs),
        cu_q_lens=zeros(num_seqs + 1),
        logits_indices=zeros(1),
    )


def abstract_params(arch: ModelArch, dtype: Any = jnp.float32) -> Params:
    """ShapeDtypeStruct tree of arch's parameters (no memory allocated)."""
    module = build_module(arch, param_dtype=dtype)
    pool = (arch.num_layers, 2, arch.num_kv_heads, 1, arch.head_dim)
    cache = (jax.ShapeDtypeStruct(pool, dtype),) * 2
    shapes = jax.eval_shape(
        lambda c: module.init(jax.random.key(0), c, dummy_input(1, 1, 1)), cache
    )
    return shapes["params"]


_ONES = ("weight", "scale")  # norm gains (RMSNorm "weight", LayerNorm "scale")


def random_params(
    arch: ModelArch, seed: int = 0, dtype: Any = jnp.bfloat16, std: float = 0.02
) -> Params:
    """Random weights from the architecture alone (vLLM's load_format="dummy"): normal(std)
    matrices and embeddings, unit norm gains (Gemma's (1 + weight) norms: weight 0), zero
    biases. Built on device, jitted."""
    shapes = abstract_params(arch, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)

    @jax.jit
    def make(key):
        keys = jax.random.split(key, len(leaves))
        out = []
        for k, (path, s) in zip(keys, leaves, strict=True):
            name = path[-1].key
            if name in _ONES:
                gain = 0.0 if arch.norm_unit_offset else 1.0
                out.append(jnp.full(s.shape, gain, dtype))
            elif name == "bias":
                out.append(jnp.zeros(s.shape, dtype))
            else:
                out.append((std * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype))
        return jax.tree_util.tree_unflatten(treedef, out)

    return make(jax.random.key(seed))
