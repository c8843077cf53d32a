"""Attention over the paged KV cache: the one place the engine and the model reach it.

What lives here: ragged paged attention (the XLA version, the reference oracle and
fallback), the native CPU kernel (``native_cpu``: the engine's default on a CPU, a C++
kernel through the XLA FFI), the choice among backends (``select_attention_backend``, in
``backends``), the KV write by slot mapping (``write_kv``) and the block copy behind
copy-on-write and swap (``copy_blocks``). The Pallas kernels in ``pallas_kernels/``
implement the same signature; that package is a leaf and is reached only from here.
"""

from pagedjax.attention.backends import AttentionBackend, is_hopper, select_attention_backend
from pagedjax.attention.kv_quant import (
    KV_CACHE_DTYPES,
    KVFormat,
    QuantizedPages,
    resolve_kv_format,
)
from pagedjax.attention.kv_write import PAD_SLOT, write_kv
from pagedjax.attention.reference import ragged_paged_attention

# The block copy is one XLA gather + scatter of whole pages; its single implementation sits
# beside the kernels it would be fused into (pallas_kernels.kv_cache, tested there under
# the kernel CI's jax version). Callers above this package take it from here.
from pallas_kernels.kv_cache import copy_blocks

__all__ = [
    "KV_CACHE_DTYPES",
    "PAD_SLOT",
    "KVFormat",
    "QuantizedPages",
    "AttentionBackend",
    "copy_blocks",
    "is_hopper",
    "ragged_paged_attention",
    "resolve_kv_format",
    "select_attention_backend",
    "write_kv",
]
