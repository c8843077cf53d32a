"""What the engine's KV pool stores: its dtype (plain or 8-bit), bytes per token, allocation.

``cache.cache_dtype`` (``LLM(kv_cache_dtype=...)``, the server's ``--kv-cache-dtype``) picks
the pool's storage: "auto" (the engine's ``kv_dtype`` argument, else the model's dtype), a
float dtype, or an 8-bit format of ``pagedjax.attention.kv_quant`` ("fp8" = "fp8_e4m3",
"fp8_e5m2", "int8_per_token_head"). The KV budget divides the same bytes by the smaller
per-token size, so an 8-bit pool gets about twice the blocks of a 16-bit one (four times an
fp32 one), less the int8 scales' 4 bytes per token-head; ``describe`` says so in the log at
start-up. Everything else (swap, copy-on-write, prefix caching, beams) moves the pool as a
pytree whose leaves are all indexed [layer, block, ...], so the 8-bit values and their scales
travel together with no special case.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pagedjax.attention.kv_quant import plain_dtype, resolve_kv_format
from pagedjax.engine.kv_calibration import calibrate_core
from pagedjax.model import ModelArch, allocate_kv_cache
from pagedjax.model.kv_cache import KVCache, cache_bytes_per_token


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The pool's storage for one engine.

    cache_dtype: the requested name ("auto", a float name or an 8-bit format). dtype: what
    the values are (float8_e4m3fn / float8_e5m2 stored as bytes, int8, or a float dtype).
    model_dtype: the parameters' dtype (the reference for the capacity ratio).
    bytes_per_token: K + V (+ int8 scales) of one token, all layers.
    """

    arch: ModelArch
    cache_dtype: str
    dtype: Any
    model_dtype: Any
    bytes_per_token: int
    kv_scales: str = "default"

    @classmethod
    def resolve(
        cls, arch: ModelArch, model_dtype: Any, cache_dtype: str, kv_dtype: Any = None,
        kv_scales: str = "default",
    ) -> KVCacheSpec:  # fmt: skip
        """The spec for ``cache_dtype``; "auto" uses ``kv_dtype`` when given, else
        ``model_dtype``. ``kv_scales="calibrate"`` (fp8 only): scales from the first
        prompts (kv_calibration.py). Raises ValueError for an unknown name or a
        calibration the format has no use for."""
        fmt = resolve_kv_format(cache_dtype)
        if kv_scales not in ("default", "calibrate"):
            raise ValueError(f"kv_scales must be 'default' or 'calibrate', got {kv_scales!r}")
        if kv_scales == "calibrate" and (fmt is None or fmt.per_token):
            raise ValueError(
                f"kv_scales='calibrate' sets fp8 scales; kv_cache_dtype={cache_dtype!r} has"
                " none to set (int8 scales are per token, computed at every write)"
            )
        if fmt is not None:
            dtype, name = fmt.element, fmt.name
        else:
            base = kv_dtype if (cache_dtype == "auto" and kv_dtype is not None) else model_dtype
            dtype, name = plain_dtype(cache_dtype, base), cache_dtype
        if fmt is None:
            per_token = cache_bytes_per_token(arch, "auto", dtype)
        else:
            per_token = cache_bytes_per_token(arch, name, model_dtype)
        name = name if fmt is not None else cache_dtype
        return cls(arch, name, dtype, model_dtype, per_token, kv_scales)

    def calibrator(self) -> Any:
        """What ``EngineCore.kv_calibration`` starts as: the calibration, or None."""
        return calibrate_core if self.kv_scales == "calibrate" else None

    @property
    def quantized(self) -> bool:
        return resolve_kv_format(self.cache_dtype) is not None

    def allocate(self, num_blocks: int, block_size: int, fill_value: float = 0.0) -> KVCache:
        """(k, v) of [L, num_blocks, Hkv, block_size, D]: plain arrays, or QuantizedPages."""
        if self.quantized:
            return allocate_kv_cache(
                self.arch, num_blocks, block_size, fill_value=fill_value,
                kv_cache_dtype=self.cache_dtype,
            )  # fmt: skip
        return allocate_kv_cache(self.arch, num_blocks, block_size, self.dtype, fill_value)

    def describe(self, num_blocks: int, block_size: int) -> str:
        """One log line: dtype, bytes per token, blocks, and the ratio of blocks to a pool in
        the model's dtype at the same bytes."""
        model_bytes = cache_bytes_per_token(self.arch, "auto", self.model_dtype)
        ratio = model_bytes / self.bytes_per_token
        return (
            f"KV cache dtype {self.cache_dtype} ({np.dtype(self.dtype).name}): "
            f"{self.bytes_per_token} bytes per token, {num_blocks} blocks of {block_size} "
            f"tokens = {num_blocks * block_size * self.bytes_per_token / 2**20:.1f} MiB; "
            f"{ratio:.2f}x the tokens of a {np.dtype(self.model_dtype).name} cache per byte"
        )


__all__ = ["KVCacheSpec"]
