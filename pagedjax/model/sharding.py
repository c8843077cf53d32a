"""Tensor parallelism: the mesh, Megatron-style parameter shardings, the KV pool's sharding
and attention run per shard under ``shard_map``.

One model over N devices (docs/parallelism.md gives the reasons):

- **Mesh.** ``Mesh(devices.reshape(kv, rep), ("tp_kv", "tp_rep"))`` with ``kv = min(N,
  num_kv_heads)`` and ``rep = N // kv``: the tensor-parallel group is both axes together
  (``TP = ("tp_kv", "tp_rep")``, size N). Query heads, MLP columns and the vocabulary split
  N ways over ``TP``; KV heads split ``kv`` ways over ``tp_kv`` and are replicated over
  ``tp_rep``. When N <= num_kv_heads, ``rep`` is 1 and the mesh is one ``tp_kv`` axis in
  effect; when N > num_kv_heads, each KV head lives on N / num_kv_heads devices, as vLLM
  replicates them, with no copy of any head written by the model: device (a, b) holds
  query-head block a * rep + b, whose KV head is block a.
- **Parameters** (``param_specs``): by the parameter's name in the tree (the stacked
  ``params["layers"]`` tree keeps a leading layer axis, never sharded): q/k/v projections
  and gate/up (fc1, dense_h_to_4h) by output columns, o_proj / out_proj / down_proj (fc2,
  dense_4h_to_h) by input rows, so each layer needs one all-reduce after attention and one
  after the MLP (GSPMD inserts them from these annotations); the embedding and the LM head
  by vocabulary (vocab-parallel). Norms, biases of row-parallel layers, position
  embeddings, MoE experts and any name not listed are replicated (correct, not split). A
  dimension that N does not divide is replicated for that tensor (logged), except query
  and KV heads, which are a start-up error.
- **Quantized weights** (``QuantizedWeight``, docs/quantization.md) split on the dense
  kernel's axis. Column-parallel: codes, scales, zero points and offsets by output
  column (the representation packs along the input axis only, so no word is split).
  Row-parallel: by input rows at group boundaries, so each device dequantizes its own
  groups with no communication: ``data`` (two codes per byte for 4 bits) and the
  per-group ``scale`` / ``zero`` / ``offset`` rows split N ways together. One group
  over the whole input (per channel, per tensor) keeps its scales replicated and splits
  only the codes. A row split that N would make inside a group (groups not a multiple
  of N) or inside a packed byte is a start-up error naming the layer, the sizes and the
  group. A GPTQ act-order ``perm`` is replicated (its gather reads the whole input).
- **KV pool**: ``[L, num_blocks, num_kv_heads, block_size, head_dim]`` sharded on the head
  axis over ``tp_kv``: one block pool, one block table and one scheduler for all shards
  (the paper's section 4.6); each device holds its heads of every block.
- **Attention** (``shard_attention``): every backend runs inside ``shard_map`` on its shard
  (q's heads of this device, the pool's heads of this device, tables and lengths
  replicated). The native CPU kernel and the Pallas kernels are custom calls XLA has no
  sharding rule for; without the wrapper XLA would gather the whole pool onto every device.

Cost: two all-reduces of [T, hidden] per layer plus the logits' all-gather; nothing else
crosses devices (the scheduler's arrays are replicated and every device runs the same
schedule).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pagedjax.model.config import ModelArch
from pagedjax.model.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)

KV_AXIS = "tp_kv"
REP_AXIS = "tp_rep"
TP = (KV_AXIS, REP_AXIS)  # the whole tensor-parallel group (size N)

# Column-parallel (output features split): kernel [in, out] -> P(None, TP), bias -> P(TP).
_COLUMN_Q = ("q_proj", "gate_proj", "up_proj", "fc1", "dense_h_to_4h")
_COLUMN_KV = ("k_proj", "v_proj")  # split over tp_kv only: KV heads replicate over tp_rep
# Row-parallel (input features split): kernel [in, out] -> P(TP, None), bias replicated.
_ROW = ("o_proj", "out_proj", "down_proj", "fc2", "dense_4h_to_h")
_VOCAB_EMBED = ("embed_tokens", "embed_in")  # embedding [vocab, hidden] -> P(TP, None)
_VOCAB_HEAD = ("lm_head", "embed_out")  # kernel [hidden, vocab] -> P(None, TP)


@dataclass(frozen=True)
class TPLayout:
    """How N devices split one model: ``kv_shards`` = min(N, num_kv_heads) ways for KV
    heads, ``kv_replicas`` = N / kv_shards copies of each KV head."""

    size: int
    kv_shards: int
    kv_replicas: int
    mesh: Mesh

    @property
    def devices(self) -> list[Any]:
        return list(self.mesh.devices.flat)

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def kv_sharding(self) -> NamedSharding:
        """The pool [L, blocks, Hkv, block_size, D]: KV heads over ``tp_kv``."""
        return NamedSharding(self.mesh, PartitionSpec(None, None, KV_AXIS, None, None))


def check_tp(arch: ModelArch, size: int) -> None:
    """ValueError unless ``size`` devices can split arch's heads: N must divide the query
    heads, and either divide the KV heads (N <= Hkv) or be a multiple of them (N > Hkv,
    each KV head then replicated N / Hkv times)."""
    h, hkv = arch.num_heads, arch.num_kv_heads
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if h % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {h} query heads"
            f" (num_attention_heads={h}); use a divisor of {h}"
        )
    if size <= hkv and hkv % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {hkv} KV heads"
            f" (num_key_value_heads={hkv})"
        )
    if size > hkv and size % hkv:
        raise ValueError(
            f"tensor_parallel_size={size} exceeds the model's {hkv} KV heads and is not a"
            f" multiple of them, so KV heads cannot be replicated evenly"
        )


def make_layout(arch: ModelArch, size: int, devices: Sequence[Any] | None = None) -> TPLayout:
    """The mesh for ``size`` devices (default: the first ``size`` of ``jax.devices()``)."""
    check_tp(arch, size)
    devices = list(devices) if devices is not None else jax.devices()[:size]
    if len(devices) != size:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} devices, got {len(devices)}"
            f" (jax sees {len(jax.devices())}: {jax.devices()[0].platform})"
        )
    kv = min(size, arch.num_kv_heads)
    grid = np.array(devices, dtype=object).reshape(kv, size // kv)
    return TPLayout(size=size, kv_shards=kv, kv_replicas=size // kv, mesh=Mesh(grid, TP))


def _spec_for(path: tuple[str, ...], shape: tuple[int, ...], layout: TPLayout) -> PartitionSpec:
    """The PartitionSpec of one parameter from its path (names) and shape."""
    stacked = 1 if path and path[0] == "layers" else 0  # leading layer axis, never split
    names = set(path[:-1])
    leaf = path[-1]
    nd = len(shape)

    def on(axis: int, mesh_axes: Any, ways: int) -> PartitionSpec:
        if shape[axis] % ways:
            log.info("tp: %s dim %d (%d) not divisible by %d: replicated", "/".join(path),
                     axis, shape[axis], ways)  # fmt: skip
            return PartitionSpec()
        spec = [None] * nd
        spec[axis] = mesh_axes
        return PartitionSpec(*spec)

    if "experts" in names or "block_sparse_moe" in names:
        return PartitionSpec()  # MoE experts: replicated (expert parallelism not built)
    if names & set(_COLUMN_Q):
        return on(nd - 1, TP, layout.size)  # kernel [.., in, out] or bias [.., out]
    if names & set(_COLUMN_KV):
        return on(nd - 1, KV_AXIS, layout.kv_shards)
    if names & set(_ROW):
        return on(stacked, TP, layout.size) if leaf == "kernel" else PartitionSpec()
    if names & set(_VOCAB_EMBED) and leaf == "embedding":
        return on(0, TP, layout.size)
    if names & set(_VOCAB_HEAD) and leaf == "kernel":
        return on(nd - 1, TP, layout.size)
    return PartitionSpec()


def _on_axis(arr: Any, from_end: int, mesh_axes: Any) -> PartitionSpec:
    """arr split on axis ``-from_end`` over ``mesh_axes``, every other axis whole."""
    spec: list[Any] = [None] * arr.ndim
    spec[arr.ndim - from_end] = mesh_axes
    return PartitionSpec(*spec)


def quantized_spec(path: tuple[str, ...], w: QuantizedWeight, layout: TPLayout) -> Any:
    """The PartitionSpecs of a quantized weight's arrays, as a ``QuantizedWeight`` of
    PartitionSpec (same static format, so it maps leaf for leaf onto ``w``): split on the
    axis the dense kernel [.., in, out] at ``path`` would be (module docstring). Raises
    ValueError when a row split would cut a group or a packed byte."""
    lead = tuple(w.data.shape[:-2])
    shape = (*lead, w.in_features, w.out_features)
    if path[-1] == "embedding" and set(path) & set(_VOCAB_EMBED):
        # A quantized token embedding is held as [hidden, vocab]: vocab is its last axis.
        ok = w.out_features % layout.size == 0
        dense = PartitionSpec(*[None] * (len(shape) - 1), TP if ok else None)
    else:
        dense = _spec_for(path, shape, layout)
    axes = tuple(dense) + (None,) * (len(lead) + 2 - len(tuple(dense)))
    replicated = dataclasses.replace(
        w, **{f: (None if getattr(w, f) is None else PartitionSpec()) for f in _ARRAYS}
    )
    if axes[-1] is not None:  # column-parallel: every [.., out]-shaped array by column
        mesh_axes = axes[-1]

        def col(field: str) -> Any:
            a = getattr(w, field)
            if a is None:
                return None
            if field != "perm" and a.shape[-1] == w.out_features:
                return _on_axis(a, 1, mesh_axes)
            return PartitionSpec()  # a per-tensor scale, perm: replicated

        return dataclasses.replace(w, **{f: col(f) for f in _ARRAYS})
    if axes[-2] is None:
        return replicated
    # Row-parallel: groups are the unit.
    mesh_axes, ways, name = axes[-2], layout.size, "/".join(path)
    rows = w.data.shape[-2]  # in, or in / 2 for two codes per byte
    if rows % ways:
        raise ValueError(
            f"{name}: tensor_parallel_size={ways} would split a packed byte: {w.fmt} packs"
            f" {w.in_features} inputs into {rows} rows of two codes, not a multiple of {ways}"
        )
    g = w.num_groups
    if g > 1 and g % ways:
        raise ValueError(
            f"{name}: tensor_parallel_size={ways} would split a quantization group:"
            f" {w.in_features} inputs in {g} groups of {w.group_size} ({w.fmt}), and"
            f" {ways} does not divide {g}; use a tensor_parallel_size dividing {g}"
        )

    def row(field: str) -> Any:
        a = getattr(w, field)
        if a is None:
            return None
        if field == "data" or (field != "perm" and g > 1 and a.shape[-2] == g):
            return _on_axis(a, 2, mesh_axes)
        return PartitionSpec()  # one group's scales (every shard needs them), perm

    return dataclasses.replace(w, **{f: row(f) for f in _ARRAYS})


_ARRAYS = ("data", "scale", "zero", "offset", "perm")  # QuantizedWeight's array fields


def param_specs(params: Any, layout: TPLayout) -> Any:
    """A tree of PartitionSpec like ``params`` (Megatron layout; see the module
    docstring); a ``QuantizedWeight`` maps to a QuantizedWeight of PartitionSpecs
    (``quantized_spec``). Raises ValueError for a quantized weight N cannot split at
    group boundaries."""

    def spec(path: Any, leaf: Any) -> Any:
        names = tuple(str(getattr(p, "key", p)) for p in path)
        if isinstance(leaf, QuantizedWeight):
            return quantized_spec(names, leaf, layout)
        return _spec_for(names, tuple(leaf.shape), layout)

    return jax.tree_util.tree_map_with_path(
        spec, params, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )


def shard_params(params: Any, layout: TPLayout) -> Any:
    """``params`` placed on the mesh by ``param_specs`` (each device gets its slices)."""
    specs = param_specs(params, layout)
    return jax.tree.map(lambda p, s: jax.device_put(p, layout.sharding(s)), params, specs)


def shard_kv(kv: Any, layout: TPLayout) -> Any:
    """The pool (k, v) placed on the mesh, KV heads over ``tp_kv``."""
    return tuple(jax.device_put(p, layout.kv_sharding) for p in kv)


def replicate(tree: Any, layout: TPLayout) -> Any:
    """Every array of ``tree`` replicated on the mesh (scheduler state, token buffer)."""
    return jax.tree.map(lambda x: jax.device_put(x, layout.replicated), tree)


def per_device_bytes(tree: Any) -> dict[Any, int]:
    """Bytes each device holds of ``tree``'s arrays (from their shardings' shard shapes;
    works on ShapeDtypeStructs carrying a sharding too)."""
    out: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        sharding = x.sharding
        shard = sharding.shard_shape(x.shape)
        nbytes = int(np.prod(shard)) * jnp.dtype(x.dtype).itemsize
        for d in sharding.device_set:
            out[d] = out.get(d, 0) + nbytes
    return out


def shard_attention(attention_fn: Callable[..., jax.Array], layout: TPLayout) -> Callable:
    """``attention_fn`` (the backends' calling convention: q [T, Hq, D], the stacked pools
    [L, N, Hkv, B, D], block tables, kv_lens, cu_q_lens; keywords layer, sm_scale,
    sliding_window, soft_cap...) run per shard under ``shard_map``: q's heads over TP, the
    pool's heads over ``tp_kv``, everything else replicated; out [T, Hq, D] split like q.
    Each device attends its query heads over its KV heads, so grouped-query attention
    keeps its grouping on every shard (Hq/N query heads per Hkv/kv_shards KV heads)."""
    q_spec = PartitionSpec(None, TP, None)
    pool_spec = PartitionSpec(None, None, KV_AXIS, None, None)
    rep = PartitionSpec()

    def sharded(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, layer=None,
                sliding_window=None, **static: Any):  # fmt: skip
        # Traced keywords travel as operands (replicated); static ones are closed over.
        traced = {}
        if layer is not None:
            traced["layer"] = jnp.asarray(layer, jnp.int32)
        if isinstance(sliding_window, jax.Array):
            traced["sliding_window"] = sliding_window
        else:
            static["sliding_window"] = sliding_window
        names = tuple(traced)

        def body(q, kp, vp, bt, kl, cu, *extra):
            kw = dict(zip(names, extra, strict=True))
            return attention_fn(q, kp, vp, bt, kl, cu, **kw, **static)

        # Inside a pipeline stage (model/pipeline.py) the context mesh has "pp" manual
        # already; shard_map must then be given that (abstract) mesh, not the concrete one.
        ctx = jax.sharding.get_abstract_mesh()
        mesh = ctx if not ctx.empty and ctx.manual_axes else layout.mesh
        fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(q_spec, pool_spec, pool_spec, rep, rep, rep, *([rep] * len(names))),
            out_specs=q_spec,
            # Manual over the TP axes only: every axis of a TP mesh; inside a pipeline
            # stage (model/pipeline.py, its "pp" axis already manual) the stage's group.
            axis_names=frozenset(TP),
            check_vma=False,  # custom calls carry no replication rule
        )
        return fn(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *traced.values())

    return sharded


__all__ = [
    "KV_AXIS",
    "REP_AXIS",
    "TP",
    "TPLayout",
    "check_tp",
    "make_layout",
    "param_specs",
    "per_device_bytes",
    "quantized_spec",
    "replicate",
    "shard_attention",
    "shard_kv",
    "shard_params",
]
