"""fp8 KV scales from the first prompts (``kv_scales="calibrate"``, docs/kv_quantization.md).

vLLM's fp8 cache defaults to scale 1.0: values past the format's range (448 for E4M3)
saturate and small ones fall into subnormals. With ``kv_scales="calibrate"`` the engine
holds its first admission until it has run the prompts of the queued requests once
through the model over a float32 scratch pool, then sets each (layer, KV head)'s scale for
K and for V to max |x| / the format's max (1.0 where a head saw only zeros), so the largest
value seen maps to the format's largest and nothing seen saturates.

Why then and only then: the scales are static metadata of the pool (kv_quant), and a
block written under one scale cannot be read under another. Before the first admission no
KV has been written, so replacing the pool's scales is free; afterwards they never change.
The cost: one extra forward over the first prompts, and the step programs (and any
warmed-up ones) compile again for the new scales, once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.attention import QuantizedPages
from pagedjax.engine.host_arrays import upload
from pagedjax.lora.slots import split_seq_slots
from pagedjax.model import ModelArch, ModelInput, allocate_kv_cache
from pagedjax.model.forward import make_forward

log = logging.getLogger(__name__)
CALIBRATION_BLOCK = 16


def prompt_amax(
    arch: ModelArch, params: Any, prompts: Sequence[Sequence[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) max |x| per (layer, KV head), float64[L, Hkv] each, over every token of the
    prompts, run as one ragged prefill over a fresh float32 pool (zeros elsewhere, so the
    max over the whole pool is the max over the prompts)."""
    bs = CALIBRATION_BLOCK
    lens = [len(p) for p in prompts]
    blocks = [-(-n // bs) for n in lens]
    num_blocks = 1 + sum(blocks)
    kv = allocate_kv_cache(arch, num_blocks, bs, jnp.float32)
    tables = np.zeros((len(prompts), max(blocks)), np.int32)
    slots, positions, first = [], [], 1
    for s, n in enumerate(lens):
        ids = np.arange(first, first + blocks[s], dtype=np.int32)
        first += blocks[s]
        tables[s, : blocks[s]] = ids
        pos = np.arange(n, dtype=np.int32)
        positions.append(pos)
        slots.append(ids[pos // bs] * bs + pos % bs)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    batch = upload(ModelInput(  # numpy, one transfer (host_arrays.py)
        tokens=np.concatenate([np.asarray(p, np.int32) for p in prompts]),
        positions=np.concatenate(positions),
        slot_mapping=np.concatenate(slots).astype(np.int32),
        block_tables=tables,
        kv_lens=np.asarray(lens, np.int32),
        cu_q_lens=cu,
        logits_indices=cu[1:] - 1,
    ))  # fmt: skip
    (k, v), _ = make_forward(arch, donate=False)(params, kv, batch)  # no padding tokens
    amax = lambda x: np.asarray(jnp.max(jnp.abs(x), axis=(1, 3, 4)), np.float64)  # noqa: E731
    return amax(k), amax(v)


def scales_from_amax(amax: np.ndarray, max_value: float) -> tuple[tuple[float, ...], ...]:
    """Static per-(layer, head) scales: amax / max_value, 1.0 where amax is 0 or not finite."""
    ok = np.isfinite(amax) & (amax > 0)
    scale = np.where(ok, amax / max_value, 1.0)
    return tuple(tuple(float(x) for x in row) for row in scale)


def calibrate_pool(kv: Any, host_kv: Any, arch: ModelArch, params: Any,
                   prompts: Sequence[Sequence[int]]) -> tuple[Any, Any]:  # fmt: skip
    """(kv, host_kv) with the fp8 pool's scales set from ``prompts``; nothing else changes
    (same buffers, so the pool must hold no KV yet). The host swap pool gets the same
    static scales (its leaves are untouched)."""
    k, v = kv
    if not (isinstance(k, QuantizedPages) and k.token_scale is None):
        raise ValueError("kv_scales='calibrate' applies to an fp8 cache only")
    k_amax, v_amax = prompt_amax(arch, params, prompts)
    k_scale = scales_from_amax(k_amax, k.fmt.max_value)
    v_scale = scales_from_amax(v_amax, v.fmt.max_value)
    new = (
        QuantizedPages(k.values, None, k.fmt, k_scale),
        QuantizedPages(v.values, None, v.fmt, v_scale),
    )
    host = jax.tree.unflatten(jax.tree.structure(new), jax.tree.leaves(host_kv))
    log.info(
        "fp8 KV scales calibrated on %d prompts (%d tokens): K %.3g..%.3g, V %.3g..%.3g",
        len(prompts), sum(len(p) for p in prompts), np.min(k_scale), np.max(k_scale),
        np.min(v_scale), np.max(v_scale),
    )  # fmt: skip
    return new, host


def calibrate_core(core: Any, prompts: Sequence[Sequence[int]]) -> None:
    """``calibrate_pool`` on an engine core's device state (``EngineCore.kv_calibration``)."""
    core.device.transform_pools(
        # The base model's KV (LoRA on: the parameters without the rows' adapter slots).
        lambda kv, host: calibrate_pool(kv, host, core.runner.arch,
                                        split_seq_slots(core.params)[0], prompts)
    )  # fmt: skip


__all__ = ["calibrate_core", "calibrate_pool", "prompt_amax", "scales_from_amax"]
