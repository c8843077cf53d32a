"""Pallas kernels (Mosaic GPU, Hopper) for paged attention, beside their jnp references.

Importing this package imports only jax, and nothing from pagedjax: it is the leaf of the
import graph. Choosing among backends is pagedjax.attention.backends' job. See
docs/kernels.md.
"""

from pallas_kernels.kv_cache import copy_blocks, write_kv
from pallas_kernels.paged_attention import (
    default_interpret,
    paged_decode_attention,
    ragged_paged_attention,
)
from pallas_kernels.reference import (
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)

__all__ = [
    "copy_blocks",
    "default_interpret",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
]
