"""How many KV blocks the pool gets.

GPU (``device.memory_stats()`` reports a ``bytes_limit``): as vLLM, run one profiling
forward at the largest bucket, read the peak bytes in use, and give the pool
``bytes_limit * gpu_memory_utilization - peak``. XLA preallocates 75% of GPU memory by
default, and then ``bytes_limit`` is that preallocated arena, not the card: set
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or ``XLA_PYTHON_CLIENT_MEM_FRACTION``) so the
limit means what gpu_memory_utilization assumes.

CPU (no memory stats): ``num_gpu_blocks_override``, else ``kv_cache_memory_bytes``, else
``cpu_default_kv_bytes()``: 4 GiB, the KV space vLLM's CPU build is run with
(``VLLM_CPU_KVCACHE_SPACE=4``, the value its docs use), but never more than a quarter of
the memory available when the engine starts, so a small machine or several engines in
one process do not run out. That quarter is rounded down to a power of two: the pool's
size is part of every compiled program's shapes, and a size that followed the free
memory byte for byte changed between two starts on the same box, so the persistent
compilation cache missed and most programs recompiled at each start (measured: 23 of
30). With the rounding, only a halving of the free memory changes the pool. Why not
smaller: with 256 MiB (the old default) issue 13's 200-request run preempted 33
sequences and ran at 0.76x vLLM; with 4 GiB 0.91x (docs/benchmarks.md). Every path is
capped at the blocks that max_num_seqs sequences of max_model_len tokens could ever hold
(more would never be used), plus the null block, so a small model with short sequences
allocates far less than the budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 4 << 30  # 4 GiB, as vLLM's CPU build is run (VLLM_CPU_KVCACHE_SPACE)
CPU_DEFAULT_MEMORY_FRACTION = 0.25  # of the memory available at start-up, at most


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (then the fraction is not
    applied)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_default_kv_bytes() -> tuple[int, str]:
    """(bytes, why): the CPU pool when no size is given (module docstring)."""
    avail = available_memory_bytes()
    if avail is not None and avail * CPU_DEFAULT_MEMORY_FRACTION < CPU_DEFAULT_KV_BYTES:
        n = power_of_two_floor(int(avail * CPU_DEFAULT_MEMORY_FRACTION))
        return n, (
            f"CPU default: a quarter of the {avail / 2**30:.1f} GiB available,"
            f" rounded down to {n / 2**20:g} MiB"
        )
    return CPU_DEFAULT_KV_BYTES, f"CPU default {CPU_DEFAULT_KV_BYTES / 2**30:g} GiB"


def power_of_two_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"expected a positive byte count, got {n}")
    return 1 << (n.bit_length() - 1)


def block_bytes(kv_bytes_per_token: int, block_size: int) -> int:
    return kv_bytes_per_token * block_size


def num_kv_blocks(
    *,
    kv_bytes_per_token: int,
    block_size: int,
    max_blocks_needed: int,
    num_gpu_blocks_override: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    device: Any,
    profile: Callable[[], None] | None = None,
    reserved_bytes: int = 0,
    reserved_for: str = "",
) -> int:
    """Blocks in the pool, counting the null block (so usable = result - 1).

    profile: runs the largest forward once (GPU path only), so its peak is measured.
    reserved_bytes: other device data that shares the KV budget (LoRA's unified memory:
    the adapter slot table, ``reserved_for`` names it in the log), taken out of every
    byte budget (kv_cache_memory_bytes, the GPU's free memory, the CPU default), never
    out of num_gpu_blocks_override (a block count). Raises ValueError when the memory
    left cannot hold one block.
    """
    per_block = block_bytes(kv_bytes_per_token, block_size)
    cap = max_blocks_needed + 1
    less = f" - {reserved_bytes} bytes of {reserved_for}" if reserved_bytes else ""
    if num_gpu_blocks_override is not None:
        n, why = num_gpu_blocks_override, "num_gpu_blocks_override"
    elif kv_cache_memory_bytes is not None:
        n = min(max(kv_cache_memory_bytes - reserved_bytes, 0) // per_block, cap)
        why = f"kv_cache_memory_bytes={kv_cache_memory_bytes}{less}"
    else:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "bytes_limit" in stats:
            if profile is not None:
                profile()
                stats = device.memory_stats()
            limit = stats["bytes_limit"]
            peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
            free = int(limit * gpu_memory_utilization) - peak - reserved_bytes
            n = max(free, 0) // per_block
            why = (
                f"{device.platform}: limit {limit / 2**30:.2f} GiB x {gpu_memory_utilization}"
                f" - profiled peak {peak / 2**30:.2f} GiB{less}"
            )
        else:
            default, why = cpu_default_kv_bytes()
            n = max(default - reserved_bytes, 0) // per_block
            why += less
        n = min(n, cap)
    if n < 2:
        raise ValueError(
            f"KV cache too small: {why} gives {n} blocks of {per_block} bytes; need >= 2"
            " (block 0 is the null block). Raise gpu_memory_utilization or"
            " kv_cache_memory_bytes, or lower max_num_batched_tokens"
            + (" (or the reserved part: for LoRA slots, max_loras or max_lora_rank, or"
               " lora_memory='separate')." if reserved_bytes else ".")
        )
    log.info("KV cache: %d blocks of %d tokens (%s)", n, block_size, why)
    return n


def profile_forward(
    arch: Any, params: Any, kv_spec: Any, block_size: int, budget: int, seqs: int,
    max_blocks: int,
) -> None:  # fmt: skip
    """One forward at the largest bucket (``budget`` tokens, ``seqs`` rows) over a 2-block
    cache (``kv_spec``: a ``KVCacheSpec``, so an 8-bit pool profiles its own quantize and
    dequantize), plus the sampler's scratch: the peak a step adds to the pool (GPU sizing
    only)."""
    import jax
    import jax.numpy as jnp

    from pagedjax.model.forward import dummy_input, make_forward

    kv = kv_spec.allocate(2, block_size)
    batch = dummy_input(budget, seqs, max_blocks)._replace(
        logits_indices=jnp.zeros((seqs,), jnp.int32)
    )
    _, logits = make_forward(arch, donate=False)(params, kv, batch)
    # The sampler holds a few [S, V] float32 arrays on top of the forward's peak.
    scratch = jnp.zeros((4, seqs, arch.vocab_size), jnp.float32)
    jax.block_until_ready((logits, scratch))
