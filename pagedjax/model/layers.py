"""Building blocks shared by the model families: norms, activations, paged self-attention,
and the layer loop.

The decoder layers run under one loop (``LayerLoop``, a ``fori_loop``) with their parameters
stacked on a leading layer axis: the step program holds one layer body whatever the depth,
so its compile time does not grow with the number of layers (docs/layer_loop.md). Dense
kernels reach each layer as ``StackedWeight`` views, so the CPU matmul can read them in
place instead of XLA copying each layer's slice first (native_matmul.py). The KV pool, stacked
the same way (``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` per K and V),
is part of the loop's carry: each layer writes its new rows into it at its own layer index
and attention reads it there, so XLA keeps one buffer, updated in place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from pagedjax.attention import write_kv
from pagedjax.model import lora_pages
from pagedjax.model.input import ModelInput
from pagedjax.model.lora_delta import lora_delta
from pagedjax.model.native_lora import stacked_lora_delta, uses_native_lora
from pagedjax.model.native_matmul import stacked_matmul, uses_native
from pagedjax.model.quant.weight import QuantizedWeight, embedding_rows, quantized_matmul

AttentionFn = Callable[..., jax.Array]
KVPool = tuple[jax.Array, jax.Array]  # (k, v), each [L, num_blocks, Hkv, block_size, D]
# A layer's sliding window: a static int / None when every layer shares it, else a traced
# int32 scalar from the loop's per-layer inputs (<= 0: full attention).
Window = int | None | jax.Array


class LayerInputs(NamedTuple):
    """Per-layer values the layer loop indexes by layer: int32[L] each."""

    index: jax.Array  # the layer's index into the stacked pool
    window: jax.Array  # the layer's sliding window, 0 for none


def layer_inputs(layer_windows: tuple[int | None, ...]) -> tuple[LayerInputs, bool]:
    """(per-layer inputs, uniform): uniform when every layer has the same window, which the
    layers then use as a static value (no traced masking)."""
    n = len(layer_windows)
    inputs = LayerInputs(
        index=jnp.arange(n, dtype=jnp.int32),
        window=jnp.asarray([w or 0 for w in layer_windows], jnp.int32),
    )
    return inputs, len(set(layer_windows)) <= 1


def layer_window(layer_windows: tuple[int | None, ...], uniform: bool, traced: jax.Array) -> Window:
    """The window a layer body passes to attention: static if uniform, else traced."""
    return layer_windows[0] if uniform else traced


# A Linear's LoRA tables, stacked [L, slots, in, r] / [L, slots, r, out] under the layer
# loop: handed over in place like kernels, so the native LoRA kernel reads the layer
# where it lies (native_lora.py).
LORA_TABLES = ("lora_a", "lora_b")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stacked", "index"],
                   meta_fields=["native"])  # fmt: skip
@dataclasses.dataclass(frozen=True)
class StackedWeight:
    """Layer ``index`` of a dense kernel stacked over layers, not sliced out: what the layer
    loop hands a ``Linear`` in place of its [in, out] kernel, so the matmul can read the
    layer where it lies (native_matmul.py says why). stacked: [L, in, out] (or a LoRA
    table, [L, slots, in, r] / [L, slots, r, out]); index: int32
    scalar; native: whether the CPU kernel may run (static)."""

    stacked: jax.Array
    index: jax.Array
    native: bool = False


def layer_view(tree: Any, index: jax.Array, native: bool) -> Any:
    """Layer ``index`` of a stacked parameter tree: dense kernels ([L, in, out] arrays named
    "kernel") and LoRA tables ([L, slots, ., .] ``LORA_TABLES``) as ``StackedWeight``
    views, every other leaf (norms, biases, quantized
    weights' fields, MoE experts) sliced at the layer index."""
    out = {}
    for name, value in tree.items():
        if isinstance(value, Mapping):
            out[name] = layer_view(value, index, native)
        elif name == "kernel" and isinstance(value, jax.Array) and value.ndim == 3:
            out[name] = StackedWeight(value, index, native)
        elif name in LORA_TABLES and isinstance(value, jax.Array) and value.ndim == 4:
            out[name] = StackedWeight(value, index, native)
        else:
            out[name] = jax.tree.map(
                lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False), value
            )
    return out


class LayerLoop(nn.Module):
    """``layer_cls(*layer_args)`` applied ``num_layers`` times under one loop, its
    parameters stacked on a leading axis (the tree ``nn.scan`` builds: collection "params",
    each leaf [L, ...]); call ``(carry, LayerInputs [L] each, batch) -> (carry, None)``.

    Not ``nn.scan``: the loop hands each layer its dense kernels as ``StackedWeight`` views
    (the stacked array and the layer index) instead of slices, so a matmul may read them in
    place (``native_matmul``: the CPU kernel when ``native``); everything else is sliced
    per layer as before. Init builds the stacked parameters with one key per layer (vmap).

    ``stack`` (pipeline parallelism, ``model/pipeline.py``'s ``PipelineStack``): when set,
    the loop is handed to it as ``run_layers`` (a pure function) with the stacked
    parameters, the carry, the inputs and the batch, and it decides which device runs
    which layers; None (default): all layers here, in order.
    """

    layer_cls: type[nn.Module]
    num_layers: int
    layer_args: tuple[Any, ...]
    native: bool = False
    stack: Any = None

    def _layer(self) -> nn.Module:
        return self.layer_cls(*self.layer_args, parent=None)

    @nn.compact
    def __call__(self, carry: Any, inputs: LayerInputs, batch: ModelInput) -> tuple[Any, None]:
        if self.is_initializing() and not self.variables.get("params"):
            keys = jax.random.split(self.make_rng("params"), self.num_layers)
            init = lambda key, inp: self._layer().init(key, carry, inp, batch)["params"]
            stacked = jax.vmap(init)(keys, inputs)
            for name, value in stacked.items():
                self.param(name, lambda _rng, v=value: v)
        params = self.variables["params"]
        run = functools.partial(run_layers, self.layer_cls, self.layer_args, self.native)
        if self.stack is not None and not self.is_initializing():
            return self.stack(run, params, carry, inputs, batch), None
        return run(params, carry, inputs, self.num_layers, batch), None


def run_layers(
    layer_cls: type[nn.Module],
    layer_args: tuple[Any, ...],
    native: bool,
    params: Any,
    carry: Any,
    inputs: LayerInputs,
    count: int | jax.Array,
    batch: ModelInput,
) -> Any:
    """The first ``count`` layers of the stacked ``params`` (leading axis = layer) over
    ``carry``, layer i with ``inputs[i]``: LayerLoop's loop as a pure function (no module
    state), so a pipeline can run it inside ``shard_map`` on a stage's own layers. A
    Python int count is a static trip count (a scan, as before); a traced one a while loop."""

    def body(i: jax.Array, c: Any) -> Any:
        # LoRA adapters paged in the KV pool (lora_pages.py): this layer's, read from the
        # pools in the carry; a tree without them is unchanged.
        view = lora_pages.materialize(layer_view(params, i, native), c, i)
        inp = jax.tree.map(lambda a: a[i], inputs)
        c, _ = layer_cls(*layer_args, parent=None).apply({"params": view}, c, inp, batch)
        return c

    return jax.lax.fori_loop(0, count, body, carry)


def loop_layers(
    layer_cls: type[nn.Module], num_layers: int, native: bool = False, stack: Any = None
) -> Callable[..., LayerLoop]:
    """A constructor ``(*layer_args, name=...) -> LayerLoop``: ``layer_cls`` applied
    num_layers times under one loop (``LayerLoop``; native: the CPU matmul may run;
    stack: a pipeline's layer runner, or None)."""
    return lambda *args, name: LayerLoop(layer_cls, num_layers, tuple(args), native, stack,
                                         name=name)  # fmt: skip


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


def linear(
    features: int, name: str, *, bias: bool, param_dtype: Any, native: bool = False
) -> Linear:
    """The one place the families build a dense layer ([..., in] -> [..., features], params
    "kernel" [in, features] and "bias"): a ``Linear``, which also runs a quantized kernel.
    ``native``: an unstacked fp32 kernel (the LM head) may run the CPU matmul kernel."""
    return Linear(features, use_bias=bias, name=name, param_dtype=param_dtype, native=native)


class Linear(nn.Module):
    """nn.Dense's parameters and numerics ("kernel" [in, features], "bias" [features]),
    except that a ``kernel`` given as a ``QuantizedWeight`` (pagedjax/model/quant) runs
    through ``quantized_matmul``. The format lives in the parameters, not in the module,
    so every family and the layer loop serve quantized checkpoints unchanged; init builds
    the dense kernel (what the loaders' shape checks and random weights read).

    LoRA: when the parameters also hold ``lora_a`` [slots, in, r], ``lora_b`` [slots, r,
    out] and ``lora_scale`` [slots] (``LoRASlotTable.attach``) and the call passes
    ``lora_slots`` int32 [rows], each row adds its adapter's x @ A @ B * scale
    (``lora_delta``) to the base output (skipped when no row has an adapter); without
    either the layer is the base one."""

    features: int
    use_bias: bool = True
    param_dtype: Any = jnp.float32
    # A plain (unstacked) kernel through the CPU matmul kernel as a one-layer stack: XLA's
    # dot streams a large weight slowly at decode's few rows (native_matmul.py's table);
    # used for the LM head, the largest single matrix of a small model.
    native: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, lora_slots: jax.Array | None = None) -> jax.Array:
        stored = self.get_variable("params", "kernel")
        if isinstance(stored, QuantizedWeight):
            y = quantized_matmul(x, stored)
        elif isinstance(stored, StackedWeight):  # under the layer loop: read in place
            y = stacked_matmul(x, stored.stacked, stored.index, native=stored.native)
        else:
            kernel = self.param(
                "kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                self.param_dtype,
            )  # fmt: skip
            x, kernel = promote_dtype(x, kernel, dtype=None)
            if uses_native(x, kernel[None], self.native):  # [None]: a bitcast, no copy
                y = stacked_matmul(x, kernel[None], 0, native=True)
            else:
                y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
            y, bias = promote_dtype(y, bias, dtype=None)
            y = y + bias
        if lora_slots is not None and self.has_variable("params", "lora_a"):
            a, b = self.get_variable("params", "lora_a"), self.get_variable("params", "lora_b")
            scale = self.get_variable("params", "lora_scale")
            # Stacked tables (the layer loop's views) are read in place; a layer's own
            # tables (paged adapters, lora_pages.py) as a one-layer stack. The kernel's
            # switch is the layer's: its base kernel's (one device, CPU).
            if isinstance(a, StackedWeight):
                a_st, b_st, layer, native = a.stacked, b.stacked, a.index, a.native
            else:
                a_st, b_st, layer = a[None], b[None], 0
                native = isinstance(stored, StackedWeight) and stored.native
            if uses_native_lora(x, a_st, b_st, native):
                # Grouped by adapter; base rows cost nothing there, so no cond
                # (native_lora.py).
                delta = stacked_lora_delta(x, lora_slots, a_st, b_st, scale, layer)
                return y + delta.astype(y.dtype)
            if isinstance(a, StackedWeight):
                a = jax.lax.dynamic_index_in_dim(a_st, layer, 0, keepdims=False)
                b = jax.lax.dynamic_index_in_dim(b_st, layer, 0, keepdims=False)
            # A batch without adapter rows (slot 0 everywhere: base requests on a LoRA
            # engine) skips the gathers and matmuls instead of adding exact zeros.
            y = jax.lax.cond(
                jnp.any(lora_slots > 0),
                lambda y: y + lora_delta(x, lora_slots, a, b, scale).astype(y.dtype),
                lambda y: y,
                y,
            )
        return y


class Embedding(nn.Module):
    """nn.Embed's parameter ("embedding" [num_embeddings, features]) and methods (call:
    ids -> rows; attend: x -> x @ embedding.T, the tied LM head), except that an
    "embedding" given as a ``QuantizedWeight`` in the LM head's orientation ([features,
    num_embeddings]: groups along the features, as GGUF's Q8_0 token embedding) serves
    both: a lookup dequantizes the looked-up columns only, attend is a quantized matmul."""

    num_embeddings: int
    features: int
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        if not isinstance(self.get_variable("params", "embedding"), QuantizedWeight):
            init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
            self.embedding = self.param(
                "embedding", init, (self.num_embeddings, self.features), self.param_dtype
            )

    def _quantized(self) -> QuantizedWeight | None:
        stored = self.get_variable("params", "embedding")
        return stored if isinstance(stored, QuantizedWeight) else None

    def __call__(self, ids: jax.Array) -> jax.Array:
        q = self._quantized()
        if q is not None:
            return embedding_rows(q, ids, jnp.dtype(self.param_dtype))
        return jnp.take(self.embedding, ids, axis=0)

    def attend(self, query: jax.Array) -> jax.Array:
        q = self._quantized()
        if q is not None:
            return quantized_matmul(query, q)
        query, embedding = promote_dtype(query, self.embedding, dtype=None)
        return dot_transposed(query, embedding)


def dot_transposed(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., H] @ w.T for w [V, H] (the tied LM head). One row on a CPU goes in as two
    (a zero row, sliced off): XLA's CPU dot against a transposed weight takes a slow
    matrix-vector path at exactly one row, 22-24 ms against 6-8 ms at two rows for
    SmolLM2's [49152, 576] head (measured, 2-core box), which made a batch-1 decode
    step a third slower than a 3-row speculative verification. Values agree to fp32
    rounding (another accumulation order)."""
    if x.ndim == 2 and x.shape[0] == 1 and jax.default_backend() == "cpu":
        return jnp.dot(jnp.concatenate([x, jnp.zeros_like(x)]), w.T)[:1]
    return jnp.dot(x, w.T)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * gain over the last axis; statistics in fp32, rounding as
    in transformers. Llama: gain = weight, applied after casting back to x's dtype. Gemma
    (unit_offset): gain = 1 + weight, applied in fp32 before the cast (HF Gemma2RMSNorm)."""

    eps: float
    param_dtype: Any = jnp.float32
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        return weight * xf.astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft cap); x unchanged when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def paged_self_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv: KVPool,
    layer: jax.Array,
    batch: ModelInput,
    *,
    sm_scale: float,
    sliding_window: Window,
    attention_fn: AttentionFn,
    logit_soft_cap: float | None = None,
) -> tuple[jax.Array, KVPool]:
    """Writes this step's k/v [T, Hkv, D] into layer ``layer`` of the stacked pool, then
    attends q [T, Hq, D] over it. The whole pool and the layer index go to the backend;
    ``logit_soft_cap`` goes as the backends' ``soft_cap`` keyword, only when set.

    Returns (out [T, Hq, D], (k_pool, v_pool)).
    """
    k_pool, v_pool = write_kv(kv[0], kv[1], k, v, batch.slot_mapping, layer)
    extra = {} if logit_soft_cap is None else {"soft_cap": logit_soft_cap}
    if batch.tree_mask is not None:  # only then, so backends without trees see no new key
        extra["tree_mask"] = batch.tree_mask
    out = attention_fn(
        q,
        k_pool,
        v_pool,
        batch.block_tables,
        batch.kv_lens,
        batch.cu_q_lens,
        layer=layer,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        **extra,
    )
    return out, (k_pool, v_pool)
