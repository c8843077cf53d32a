"""Pipeline parallelism: the decoder layers split into stages over a ``pp`` mesh axis, each
stage's layer weights and its layers' KV pool on its own devices, the activations passed
stage to stage inside one jitted step.

Contract (docs/parallelism.md, "Pipeline parallelism"):

- **Stages** (``stage_layer_ranges``): PP contiguous layer ranges [start, end). Default:
  vLLM's ``get_pp_indices`` rule (L // PP layers each; the remainder goes one layer each
  to the stages before the last, from the second-to-last backwards, so the last stage,
  which also runs the final norm, is not the largest); or an explicit partition (vLLM's
  ``VLLM_PP_LAYER_PARTITION``, here ``PAGEDJAX_PP_LAYER_PARTITION="2,1"``), which must
  have PP entries, each >= 1, summing to L. ValueError naming the numbers otherwise.
- **Mesh**: ``Mesh(devices.reshape(PP, kv, rep), ("pp", "tp_kv", "tp_rep"))``: stage s is
  row s, a tensor-parallel group of TP devices (``sharding.py``'s layout) inside it.
- **Slots**: every stage holds S = max stage length layer *slots* (a sharded array splits
  evenly): stage s's layers fill its first (end - start) slots, the rest are zero padding
  that never runs. The stacked parameters ``params["layers"]`` ([L, ...]) become
  [PP x S, ...] (``pad_layers``; unchanged when PP divides L) and the KV pool is
  [PP x S, blocks, Hkv, block_size, D]; both are sharded on their leading axis over
  ``pp`` (and by the TP rules inside a stage), so a device holds S layers' weights and
  pool: 1 / PP of one device's when PP divides L.
- **Embedding and LM head**: split by vocabulary over every device of the pipeline
  (``pp`` x TP), not kept on the first / last stage as vLLM does: each device then holds
  1 / (PP x TP) of them and XLA inserts one gather of the logits. Norms: replicated.
- **The step** (``PipelineStack``, called by ``layers.LayerLoop`` in place of its loop):
  a ``shard_map`` manual over ``pp`` (TP axes stay automatic: GSPMD's all-reduces inside
  a stage). Every stage holds the activations x [T, hidden]; for hop i = 0 .. PP-1,
  stage i runs its layers (a loop of ``end - start`` iterations; the other stages run
  zero iterations, so they neither compute nor write KV), then every stage sends x to
  the next (``ppermute``, a ring). After PP hops the last stage's output is on stage 0,
  and one ``psum`` of it (zeros elsewhere) hands it to every device for the norm and
  the head. One batch in flight: at any time one stage works and PP - 1 wait, so the
  step takes as long as on one device plus PP transfers of [T, hidden] (the bubble is
  (PP - 1) / PP of device time); what PP buys here is memory (weights and KV per device),
  not speed.
- **Micro-batches** (``pipeline_microbatches`` = M > 1, pagedjax's own option): GPipe
  inside the step. ``microbatch_ranges`` cuts the step's tokens into M consecutive
  ranges of ceil(T / M) slots (inside the step, where the engine builds the batch from
  the on-device scheduler state) and says which sequence rows each holds; each gets its
  own attention metadata at static shapes (``microbatch_input``); ``_micro_ring`` runs
  M + PP - 1 ticks, stage s running micro-batch t - s at tick t, so with M = PP every
  stage works in the middle ticks; the bubble is (PP - 1) / (M + PP - 1) (the pipeline
  drains every step: the next step's tokens are this step's samples). A sequence's
  chunk may be cut between consecutive micro-batches: the later part reads the earlier
  part's KV, written at every layer one tick before (chunked prefill inside the step),
  so every step splits, prefill chunks included. Every micro-batch reads the stage's
  weights again, so a weight-bound decode step gets slower, a compute-bound prefill
  step faster (simulator/pipeline.py; docs/parallelism.md). vLLM's scheme, PP scheduler
  batches in flight across steps, is not built.

Refusals (``engine/unbuilt.py``, ``engine/parallel.py``): speculative decoding, LoRA,
multi-modal models, an 8-bit KV cache, data parallelism and the GPU attention kernels
under PP > 1 raise ValueError naming the combination. Several processes work as under TP
(the mesh spans them; tests/test_multihost.py runs PP 2 x TP 2, one stage per process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pagedjax.attention import PAD_SLOT
from pagedjax.model.config import ModelArch
from pagedjax.model.layers import LayerInputs
from pagedjax.model.sharding import KV_AXIS, TP, TPLayout, check_tp, param_specs

PP_AXIS = "pp"
PARTITION_ENV = "PAGEDJAX_PP_LAYER_PARTITION"


def stage_layer_ranges(
    num_layers: int, pp: int, partition: Sequence[int] | None = None
) -> tuple[tuple[int, int], ...]:
    """The [start, end) layer range of each of ``pp`` stages (module docstring). Default:
    vLLM's even split, the remainder one layer each on stages -2, -3, ...; partition: the
    number of layers of each stage. ValueError for pp < 1, fewer layers than stages, or
    a partition that does not have pp entries >= 1 summing to num_layers."""
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    if num_layers < pp:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers:"
                         " every stage needs at least one layer")  # fmt: skip
    if partition is not None:
        sizes = [int(n) for n in partition]
        if len(sizes) != pp:
            raise ValueError(f"layer partition {sizes} has {len(sizes)} stages, not"
                             f" pipeline_parallel_size={pp}")  # fmt: skip
        if sum(sizes) != num_layers:
            raise ValueError(f"layer partition {sizes} sums to {sum(sizes)}, not the model's"
                             f" {num_layers} layers")  # fmt: skip
        if min(sizes) < 1:
            raise ValueError(f"layer partition {sizes}: every stage needs at least one layer")
    else:
        sizes = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):  # vLLM: stages -2, -3, ... get one more
            sizes[-i] += 1
    starts = np.cumsum([0, *sizes])
    return tuple((int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True))


def parse_partition(text: str | None) -> tuple[int, ...] | None:
    """``"2,1"`` -> (2, 1); None or "" -> None. ValueError naming the text otherwise."""
    if text is None or not text.strip():
        return None
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"{PARTITION_ENV}={text!r}: expected comma-separated layer counts"
                         ", e.g. '2,1'") from None  # fmt: skip


@dataclass(frozen=True)
class PipelineLayout:
    """PP stages of ``ranges`` on ``tp.mesh`` (axes pp, tp_kv, tp_rep); ``tp``: the
    tensor-parallel layout inside a stage (its ``size`` is TP, its mesh the whole one)."""

    ranges: tuple[tuple[int, int], ...]
    tp: TPLayout
    microbatches: int = 1

    @property
    def size(self) -> int:
        return len(self.ranges)

    @property
    def slots(self) -> int:
        """Layer slots per stage: the largest stage's layer count."""
        return max(b - a for a, b in self.ranges)

    @property
    def pool_layers(self) -> int:
        """Leading axis of the padded layer stacks and of the KV pool: PP x slots."""
        return self.size * self.slots

    @property
    def padded(self) -> bool:
        return any(b - a != self.slots for a, b in self.ranges)

    @property
    def slot_layers(self) -> np.ndarray:
        """int32[PP x slots]: the model layer in each slot, -1 for padding."""
        out = np.full(self.pool_layers, -1, np.int32)
        for s, (a, b) in enumerate(self.ranges):
            out[s * self.slots : s * self.slots + b - a] = np.arange(a, b)
        return out

    @property
    def kv_sharding(self) -> NamedSharding:
        """The pool [PP x slots, blocks, Hkv, block_size, D]: slots over pp, heads over tp_kv."""
        return NamedSharding(self.tp.mesh, PartitionSpec(PP_AXIS, None, KV_AXIS, None, None))

    def stack(self) -> PipelineStack:
        return PipelineStack(self.ranges, self.tp.mesh, self.tp.size, self.microbatches)


def make_pipeline(
    arch: ModelArch,
    pp: int,
    tp: int = 1,
    partition: Sequence[int] | None = None,
    devices: Sequence[Any] | None = None,
    microbatches: int = 1,
) -> PipelineLayout:
    """The layout of PP stages of TP devices each (default devices: the first PP x TP of
    ``jax.devices()``). ValueError for a bad partition, heads TP does not divide, or too
    few devices."""
    ranges = stage_layer_ranges(arch.num_layers, pp, partition)
    check_tp(arch, tp)
    need = pp * tp
    devices = list(devices) if devices is not None else jax.devices()[:need]
    if len(devices) != need:
        raise ValueError(f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} needs"
                         f" {need} devices, got {len(devices)}")  # fmt: skip
    kv = min(tp, arch.num_kv_heads)
    grid = np.array(devices, dtype=object).reshape(pp, kv, tp // kv)
    mesh = Mesh(grid, (PP_AXIS, *TP))
    layout = TPLayout(size=tp, kv_shards=kv, kv_replicas=tp // kv, mesh=mesh)
    return PipelineLayout(ranges, layout, microbatches)


def pad_layers(params: Any, layout: PipelineLayout) -> Any:
    """``params`` with every leaf of ``params["layers"]`` ([L, ...]) laid out in slots
    ([PP x slots, ...], padding slots zero); unchanged when every stage is full."""
    if not layout.padded:
        return params
    slot = layout.slot_layers
    take, pad = np.maximum(slot, 0), slot < 0

    def one(x: Any) -> Any:
        rows = jnp.take(x, take, axis=0)
        mask = jnp.asarray(pad).reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(mask, jnp.zeros((), x.dtype), rows)

    return dict(params, layers=jax.tree.map(one, params["layers"]))


def _with_axis0(spec: PartitionSpec, ndim: int, axis: Any) -> PartitionSpec:
    full = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return PartitionSpec(axis, *full[1:])


def pipeline_specs(params: Any, layout: PipelineLayout) -> Any:
    """PartitionSpecs of (padded) ``params`` on the pipeline mesh: the TP rules
    (``sharding.param_specs``), plus the layer-slot axis of ``params["layers"]`` over
    ``pp``, and a vocabulary axis split over TP also split over ``pp`` when PP x TP
    divides it (else left as TP splits it, replicated over the stages)."""
    specs = param_specs(params, layout.tp)
    ways = layout.size * layout.tp.size
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731

    def layer(spec: PartitionSpec, x: Any) -> PartitionSpec:
        return _with_axis0(spec, x.ndim, PP_AXIS)

    def top(spec: PartitionSpec, x: Any) -> PartitionSpec:
        axes = list(spec)
        for i, a in enumerate(axes):
            if a == TP and x.shape[i] % ways == 0:  # vocab-parallel: over pp x TP
                axes[i] = (PP_AXIS, *TP)
        return PartitionSpec(*axes)

    out = {}
    for name, sub in specs.items():
        fn = layer if name == "layers" else top
        out[name] = jax.tree.map(fn, sub, params[name], is_leaf=is_spec)
    return out


def place_params(params: Any, layout: PipelineLayout) -> Any:
    """``params`` padded into slots and placed on the pipeline mesh (``pipeline_specs``)."""
    params = pad_layers(params, layout)
    specs = pipeline_specs(params, layout)
    mesh = layout.tp.mesh
    return jax.tree.map(lambda s, p: jax.device_put(p, NamedSharding(mesh, s)), specs, params,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))  # fmt: skip


# run(params, carry, inputs, count, batch) -> carry: ``count`` layers of the stacked
# ``params`` (leading axis = slot) over carry (x, k_pool, v_pool) (layers.run_layers).
RunLayers = Callable[[Any, Any, LayerInputs, Any, Any], Any]


@dataclass(frozen=True, repr=False)
class PipelineStack:
    """The layer loop of a pipelined model (``layers.LayerLoop``'s ``stack``): called with
    the loop's ``run``, the padded stacked parameters, the carry (x [T, H], k, v pools of
    [PP x slots, ...]), the model's LayerInputs ([L] each) and the batch; returns the
    carry after every stage ran its layers (module docstring). Hashable (a Flax module
    attribute, part of the runner's description)."""

    ranges: tuple[tuple[int, int], ...]
    mesh: Mesh
    tp: int
    microbatches: int = 1

    @property
    def pool_layers(self) -> int:
        return len(self.ranges) * max(b - a for a, b in self.ranges)

    def __repr__(self) -> str:
        # The runner's program key: unchanged from before micro-batches when there are none.
        extra = f", microbatches={self.microbatches}" if self.microbatches > 1 else ""
        return f"PipelineStack(ranges={self.ranges!r}, mesh={self.mesh!r}, tp={self.tp!r}{extra})"

    def __call__(self, run: RunLayers, params: Any, carry: Any, inputs: LayerInputs,
                 batch: Any) -> Any:  # fmt: skip
        pp, groups = len(self.ranges), self.microbatches
        slots = max(b - a for a, b in self.ranges)
        slot_layer = np.full(pp * slots, -1, np.int32)
        for s, (a, b) in enumerate(self.ranges):
            slot_layer[s * slots : s * slots + b - a] = np.arange(a, b)
        # Per slot: its index into the stage's local pool, and its model layer's window.
        slot_inputs = LayerInputs(
            index=jnp.asarray(np.tile(np.arange(slots, dtype=np.int32), pp)),
            window=jnp.where(jnp.asarray(slot_layer >= 0),
                             inputs.window[np.maximum(slot_layer, 0)], 0),
        )  # fmt: skip
        counts = jnp.asarray([b - a for a, b in self.ranges], jnp.int32)
        ring = [(j, (j + 1) % pp) for j in range(pp)]

        def body(params, x, k, v, slot_inputs, counts, batch):
            stage = jax.lax.axis_index(PP_AXIS)

            def one_batch(x, k, v):
                def hop(i, c):
                    x, k, v = c
                    # Stage i runs its layers; the others loop zero times (no compute, no
                    # writes).
                    x, k, v = run(params, (x, k, v), slot_inputs,
                                  jnp.where(i == stage, counts[0], 0), batch)  # fmt: skip
                    return jax.lax.ppermute(x, PP_AXIS, ring), k, v

                # After PP hops the last stage's output sits on stage 0.
                return jax.lax.fori_loop(0, pp, hop, (x, k, v))

            if groups == 1:
                x, k, v = one_batch(x, k, v)
            else:
                x, k, v = _micro_ring(run, params, (x, k, v), slot_inputs, counts[0], batch,
                                      stage, pp, groups, ring)  # fmt: skip
            # Stage 0 holds the output: hand it to every stage (zeros elsewhere).
            x = jax.lax.psum(jnp.where(stage == 0, x, jnp.zeros_like(x)), PP_AXIS)
            return x, k, v

        lay, rep = PartitionSpec(PP_AXIS), PartitionSpec()
        x, k, v = carry
        specs = (jax.tree.map(lambda _: lay, params), rep, lay, lay,
                 LayerInputs(lay, lay), lay, jax.tree.map(lambda _: rep, batch))  # fmt: skip
        # TP 1: every axis manual (no GSPMD inside). TP > 1: only pp is manual; the TP
        # axes stay automatic, so the layers' Megatron shardings and the attention's own
        # shard_map (sharding.shard_attention) work inside a stage as without PP.
        manual = frozenset({PP_AXIS}) if self.tp > 1 else frozenset(self.mesh.axis_names)
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=(rep, lay, lay),
                           axis_names=manual, check_vma=False)  # fmt: skip
        return fn(params, x, k, v, slot_inputs, counts, batch)


# ------------------------------------------------------------------ micro-batches


def token_slots(num_tokens: int, groups: int) -> int:
    """Token slots of one micro-batch: ceil(T / groups) (the step's T split evenly)."""
    return -(-num_tokens // groups)


def microbatch_ranges(
    cu_q_lens: Any, groups: int, slots: int, xp: Any = np
) -> tuple[Any, Any, Any, Any]:
    """Which micro-batch each scheduled token and sequence is in: ``(start, end, first,
    last)``, each int[groups].

    cu_q_lens int[S + 1] (``ModelInput.cu_q_lens``: padding rows repeat the last value);
    ``groups`` micro-batches of ``slots`` token slots each (groups x slots >= the step's
    token count). Micro-batch g holds the step's tokens [start[g], end[g]) = [g x slots,
    (g + 1) x slots) clipped to the total: consecutive, every token in exactly one, each
    within its slots, so a step never fails to split (no fallback). Its sequence rows are
    [first[g], last[g]): the rows with a token in its range. A row's chunk may be cut
    between consecutive micro-batches: the later part attends to the earlier part's KV,
    which the ring wrote at every layer one tick earlier (``_micro_ring``), as chunked
    prefill does across steps. Balance: every micro-batch but the last is full.

    Pure and array-API generic: ``xp=np`` on the host (tests), ``xp=jax.numpy`` inside
    the step, where the engine builds the batch (``model_runner.build_model_input``: the
    scheduler's batch lives on the devices). Cost O(S x groups)."""
    cu = xp.asarray(cu_q_lens)
    total = cu[-1]
    g = xp.arange(groups, dtype=cu.dtype)
    start = xp.minimum(g * slots, total)
    end = xp.minimum(start + slots, total)
    first = xp.sum(cu[None, 1:] <= start[:, None], axis=1).astype(cu.dtype)
    last = xp.sum(cu[None, :-1] < end[:, None], axis=1).astype(cu.dtype)
    return start, end, first, last


def microbatch_input(batch: Any, start: jax.Array, end: jax.Array, first: jax.Array,
                     last: jax.Array, slots: int) -> Any:  # fmt: skip
    """The micro-batch of ``batch`` (a ModelInput) holding its tokens [start, end) and rows
    [first, last) (``microbatch_ranges``) at static shapes: ``slots`` tokens (then
    padding: PAD_SLOT writes, position 0) and the step's S rows (its rows first, then
    empty ones: kv_len 0, no pages, cu_q_lens repeating its token count). A row cut at
    ``end`` sees kv_len minus its tokens after ``end`` (its context so far); all S rows
    are kept, as a micro-batch may hold many short sequences."""
    cu = batch.cu_q_lens
    num_seqs = batch.kv_lens.shape[0]
    t = jnp.arange(slots, dtype=jnp.int32)
    tok_ok = t < end - start
    tok = jnp.minimum(start + t, batch.positions.shape[-1] - 1)
    r = jnp.arange(num_seqs, dtype=jnp.int32)
    row_ok = r < last - first
    row = jnp.minimum(first + r, num_seqs - 1)
    q_end = jnp.minimum(cu[row + 1], end)  # where the row's tokens in this group stop
    cu_g = jnp.where(row_ok, q_end - start, end - start)
    take = lambda a: jnp.where(tok_ok, a[..., tok], 0)  # noqa: E731
    return batch._replace(
        tokens=take(batch.tokens),
        positions=take(batch.positions),
        slot_mapping=jnp.where(tok_ok, batch.slot_mapping[tok], PAD_SLOT),
        block_tables=jnp.where(row_ok[:, None], batch.block_tables[row], 0),
        kv_lens=jnp.where(row_ok, batch.kv_lens[row] - (cu[row + 1] - q_end), 0),
        cu_q_lens=jnp.concatenate([jnp.zeros((1,), cu.dtype), cu_g.astype(cu.dtype)]),
        logits_indices=jnp.zeros_like(batch.logits_indices),  # not read by the layers
        lora_slots=None if batch.lora_slots is None else take(batch.lora_slots),
        rope_positions=None if batch.rope_positions is None else take(batch.rope_positions),
    )


def _micro_ring(run: RunLayers, params: Any, carry: Any, slot_inputs: LayerInputs,
                count: jax.Array, batch: Any, stage: jax.Array, pp: int, groups: int,
                ring: list[tuple[int, int]]) -> Any:  # fmt: skip
    """GPipe inside the ring (called per stage, inside ``shard_map``): ``groups``
    micro-batches, ``groups + pp - 1`` ticks; at tick t stage s runs micro-batch t - s
    (when 0 <= t - s < groups) on a [slots, hidden] buffer, then every stage sends its
    buffer to the next. Stage 0 loads micro-batch t from x at tick t and stores the one
    the last stage finished (micro-batch t - pp, arriving over the ring) into its output.
    Returns (x [T, hidden]: the layers' output on stage 0, rows of padding tokens zero;
    k, v). Micro-batch m reaches each stage one tick after m - 1, so at every layer the
    KV that m - 1 wrote (the first part of a chunk cut between them) is in the pool
    before m attends; each micro-batch writes only its own tokens' slots."""
    x, k, v = carry
    n = x.shape[0]
    slots = token_slots(n, groups)
    start, end, first, last = microbatch_ranges(batch.cu_q_lens, groups, slots, xp=jnp)
    t_ar = jnp.arange(slots, dtype=jnp.int32)

    def rows_of(g: jax.Array) -> jax.Array:
        """x's row of each of micro-batch g's token slots; n (dropped) for padding."""
        return jnp.where(t_ar < end[g] - start[g], start[g] + t_ar, n)

    def store(out: jax.Array, buf: jax.Array, done: jax.Array) -> jax.Array:
        put = out.at[rows_of(jnp.clip(done, 0, groups - 1))].set(buf, mode="drop")
        return jnp.where((stage == 0) & (done >= 0) & (done < groups), put, out)

    def tick(t, c):
        buf, out, k, v = c
        out = store(out, buf, t - pp)  # the micro-batch that left the last stage last tick
        load = jnp.take(x, jnp.minimum(rows_of(jnp.minimum(t, groups - 1)), n - 1), axis=0)
        buf = jnp.where((stage == 0) & (t < groups), load, buf)
        m = t - stage
        g = jnp.clip(m, 0, groups - 1)
        sub = microbatch_input(batch, start[g], end[g], first[g], last[g], slots)
        active = (m >= 0) & (m < groups)
        buf, k, v = run(params, (buf, k, v), slot_inputs, jnp.where(active, count, 0), sub)
        return jax.lax.ppermute(buf, PP_AXIS, ring), out, k, v

    init = (jnp.zeros((slots, *x.shape[1:]), x.dtype), jnp.zeros_like(x), k, v)
    buf, out, k, v = jax.lax.fori_loop(0, groups + pp - 1, tick, init)
    return store(out, buf, jnp.asarray(groups - 1)), k, v


__all__ = [
    "PARTITION_ENV",
    "PP_AXIS",
    "PipelineLayout",
    "PipelineStack",
    "make_pipeline",
    "microbatch_ranges",
    "microbatch_input",
    "pad_layers",
    "parse_partition",
    "pipeline_specs",
    "place_params",
    "stage_layer_ranges",
    "token_slots",
]
