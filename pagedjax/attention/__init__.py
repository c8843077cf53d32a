"""Attention over the paged KV cache: ragged paged attention and the KV write.

The XLA implementation here is the reference oracle (and the fallback); ``native_cpu`` is
the engine's default on a CPU (a C++ kernel through the XLA FFI); Pallas kernels in
``pallas_kernels/`` implement the same signature.
"""

from pagedjax.attention.kv_write import PAD_SLOT, write_kv
from pagedjax.attention.reference import ragged_paged_attention

__all__ = ["PAD_SLOT", "ragged_paged_attention", "write_kv"]
