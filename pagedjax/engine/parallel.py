"""The engine's devices: one, a tensor-parallel mesh (``pagedjax/model/sharding.py``), or
pipeline stages of tensor-parallel groups (``pagedjax/model/pipeline.py``).

``DevicePlacement`` is what ``LLMEngine`` asks where things go: the parameters (Megatron
shardings), the attention backend (wrapped in ``shard_map``), the KV pool (allocated
sharded by KV head, never whole on one device), the scheduler state and token buffer
(replicated: every device runs the same schedule), and the bytes of KV per token that
one device holds (the KV budget is per device, as vLLM's ``gpu_memory_utilization``).

With one device and no explicit device list it changes nothing: the engine runs exactly
as before (arrays uncommitted on the default device). An explicit list (a data-parallel
replica on its own devices, ``data_parallel.py``) or N > 1 builds a mesh and commits
every array to it. PP > 1 builds the pipeline's mesh (stages x TP): the parameters'
layer stacks and the pool are laid out in layer slots and split over the stages, the
model's layer loop becomes the pipeline's (``layer_stack``), and the KV budget counts
the layers one device holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.model import ModelArch
from pagedjax.model.kv_cache import kv_cache_shape
from pagedjax.model.pipeline import PipelineLayout, PipelineStack, make_pipeline, place_params
from pagedjax.model.sharding import (
    TPLayout,
    make_layout,
    per_device_bytes,
    replicate,
    shard_attention,
    shard_params,
)


class DevicePlacement:
    """Where one engine's arrays live. ``size``: tensor_parallel_size; ``devices``: the
    devices to use (default: the first ``size`` x ``pp`` of ``jax.devices()``); ``pp``:
    pipeline_parallel_size, ``partition``: layers per stage (None: vLLM's even split);
    ``microbatches``: pipeline_microbatches (model/pipeline.py).
    Raises ValueError (naming the numbers) when ``size`` does not divide the model's
    heads, the partition does not fit the layers, or the devices are too few."""

    def __init__(self, arch: ModelArch, size: int, devices: Sequence[Any] | None = None,
                 pp: int = 1, partition: Sequence[int] | None = None,
                 microbatches: int = 1):  # fmt: skip
        self.arch = arch
        self.size = size
        self.layout: TPLayout | None = None
        self.pipeline: PipelineLayout | None = None
        if pp > 1:
            self.pipeline = make_pipeline(arch, pp, size, partition, devices, microbatches)
            self.layout = self.pipeline.tp  # the whole mesh; TP rules inside a stage
        elif size > 1 or devices is not None:
            self.layout = make_layout(arch, size, devices)

    @property
    def num_devices(self) -> int:
        """Devices the engine spans (TP x PP)."""
        return len(self.layout.devices) if self.layout else 1

    @property
    def layer_stack(self) -> PipelineStack | None:
        """The model's layer loop under PP (``forward``'s ``layer_stack``), else None."""
        return self.pipeline.stack() if self.pipeline else None

    @property
    def device(self) -> Any:
        """The first device (its memory stats size the per-device KV budget)."""
        return self.layout.devices[0] if self.layout else jax.devices()[0]

    @property
    def kv_shards(self) -> int:
        """Ways the KV heads are split: 1 / kv_shards of the pool lives on each device."""
        return self.layout.kv_shards if self.layout else 1

    def kv_share(self, kv_bytes_per_token: int) -> int:
        """Of ``kv_bytes_per_token`` (all layers, K and V), the bytes one device holds:
        its KV heads' share, and under PP its stage's layer slots (slots / num_layers)."""
        per = kv_bytes_per_token // self.kv_shards
        if self.pipeline is None:
            return per
        return per // self.arch.num_layers * self.pipeline.slots  # bytes per layer x slots

    def kv_bytes_per_token(self, dtype: Any) -> int:
        """KV bytes (all layers, K and V) one device holds per token."""
        return self.kv_share(self.arch.kv_bytes_per_token(dtype))

    def params(self, params: Any, kv_spec: Any = None) -> Any:
        """``params`` placed on the mesh (quantized weights split at group boundaries,
        ``sharding.quantized_spec``). Raises ValueError for a quantized layer whose groups
        the TP size does not divide, and for what is not sharded yet: an 8-bit KV cache
        (``kv_spec``, a KVCacheSpec: its scales)."""
        if self.layout is None:
            return params
        if kv_spec is not None and kv_spec.quantized:
            what = (f"pipeline_parallel_size={self.pipeline.size}" if self.pipeline
                    else f"tensor_parallel_size={self.size}")  # fmt: skip
            raise ValueError(f"kv_cache_dtype={kv_spec.cache_dtype!r} with {what}: an 8-bit KV"
                             " cache is not sharded yet")  # fmt: skip
        if self.pipeline is not None:
            return place_params(params, self.pipeline)
        return shard_params(params, self.layout)

    def backend_request(self, name: str) -> str:
        """The attention backend to ask for: under pipeline parallelism "auto" may pick
        only a tested backend, so on a GPU (where it would pick the Mosaic kernels) it
        becomes "reference"; on a CPU "auto" stays (native_cpu or reference)."""
        if self.pipeline is not None and name == "auto" and jax.devices()[0].platform != "cpu":
            return "reference"
        return name

    def check_attention_backend(self, name: str) -> None:
        """ValueError for a backend not run under pipeline parallelism yet: the GPU kernels
        (Pallas, Triton) inside the stage ring are untested (no multi-GPU run), so they are
        refused rather than trusted; "native_cpu" and "reference" are tested."""
        if self.pipeline is not None and name not in ("native_cpu", "reference"):
            raise ValueError(f"attention_backend={name!r} with pipeline_parallel_size="
                             f"{self.pipeline.size}: not tested yet; use"
                             " attention_backend='reference' (docs/parallelism.md)")  # fmt: skip

    def attention(self, fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        # A single device needs no shard_map: keep the backend's own function (and its
        # identity: forward caches by it).
        return shard_attention(fn, self.layout) if self.layout and self.size > 1 else fn

    def allocate_kv(
        self, kv_spec: Any, num_blocks: int, block_size: int, fill_value: float
    ) -> Any:
        """(k, v) [L, num_blocks, Hkv, block_size, D] as ``kv_spec`` (a KVCacheSpec) stores
        them; under TP each device holds its KV heads, built in place on the mesh (the
        whole pool never sits on one device)."""
        if self.layout is None:
            return kv_spec.allocate(num_blocks, block_size, fill_value)
        dtype = kv_spec.dtype
        if num_blocks < 2 or block_size < 1:  # allocate_kv_cache's checks, same words
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block) and"
                             f" block_size >= 1, got {num_blocks} and {block_size}")  # fmt: skip
        shape = kv_cache_shape(self.arch, num_blocks, block_size)
        sharding = self.layout.kv_sharding
        if self.pipeline is not None:  # layer slots over the stages (pipeline.py)
            shape, sharding = (self.pipeline.pool_layers, *shape[1:]), self.pipeline.kv_sharding
        make = jax.jit(
            lambda: tuple(jnp.full(shape, fill_value, dtype) for _ in range(2)),
            out_shardings=(sharding,) * 2,
        )
        return make()

    def place_state(self, device_state: Any) -> None:
        """Commit the scheduler state and token buffer to the mesh, replicated, so every
        jitted function sees one device set (and compiles once)."""
        if self.layout is not None:
            device_state.state = replicate(device_state.state, self.layout)
            device_state.tokens = replicate(device_state.tokens, self.layout)

    def describe(self) -> str:
        if self.layout is None:
            return "one device"
        lay = self.layout
        if self.pipeline is not None:
            return (f"pipeline_parallel_size={self.pipeline.size} x tensor_parallel_size="
                    f"{lay.size} on {[str(d) for d in lay.devices]}: layers per stage"
                    f" {[b - a for a, b in self.pipeline.ranges]}")  # fmt: skip
        return (
            f"tensor_parallel_size={lay.size} on {[str(d) for d in lay.devices]}: KV heads"
            f" {self.arch.num_kv_heads} split {lay.kv_shards} ways, each replicated"
            f" {lay.kv_replicas}x"
        )


def check_device_count(tensor_parallel_size: int, data_parallel_size: int = 1,
                       pipeline_parallel_size: int = 1) -> None:  # fmt: skip
    """ValueError, before any weights are loaded, when JAX sees fewer devices than
    tensor_parallel_size x data_parallel_size (x pipeline_parallel_size) (the heads are
    checked once the model's shape is known, ``sharding.check_tp``)."""
    need = tensor_parallel_size * data_parallel_size * pipeline_parallel_size
    have = len(jax.devices())
    if need > have:
        pp = (f" x pipeline_parallel_size={pipeline_parallel_size}"
              if pipeline_parallel_size > 1 else "")  # fmt: skip
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size="
            f"{data_parallel_size}{pp} needs {need} devices; jax sees {have}"
            f" ({jax.devices()[0].platform}; on a CPU, XLA_FLAGS="
            f"--xla_force_host_platform_device_count={need} simulates them)"
        )


def memory_report(params: Any, kv: Any) -> dict[str, dict[Any, int]]:
    """Bytes per device of the parameters and of the KV pool, from their shardings."""
    return {"params": per_device_bytes(params), "kv": per_device_bytes(kv)}


__all__ = ["DevicePlacement", "check_device_count", "memory_report"]
