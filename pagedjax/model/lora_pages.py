"""LoRA adapters stored in the KV pool's pages (S-LoRA's unified paging), read per layer.

An adapter's weights for one layer are one flat float32 vector laid out *rank-major*:
component k (k < rank) is the "rank slice" ``concat over modules m of (A_m[:, k],
B_m[k, :])``, S = sum_m (in_m + out_m) floats, so an adapter of rank r needs r * S floats
per layer and its page count grows with its own rank, not with ``max_lora_rank``. The
vector is cut into KV blocks: block j of the adapter's page list holds, in every layer l,
floats [j * F, (j + 1) * F) of layer l's vector, the first half in K's page and the second
in V's page (F = 2 * num_kv_heads * block_size * head_dim * itemsize / 4 floats: the bits
of the float32 values, bitcast to the pool's dtype, so a bf16 or fp8 pool holds them
exactly). A KV block spans every layer, so one block id per page serves all layers, as
for a sequence's KV.

``PagedLoRA`` rides in the layer loop's parameters (``layers["lora_paged"]``) with each
slot's page list, rank and scale; ``run_layers`` calls ``materialize`` per layer, which
gathers the slots' pages of that layer from the K/V pools, bitcasts them back to float32
and reshapes them into the [slots, in, r_max] / [slots, r_max, out] arrays the Linear
layers' ``lora_delta`` reads (``lora_a``, ``lora_b``, ``lora_scale``, exactly the slot
table's shapes). Components k >= a slot's rank, and every component of an empty slot or
slot 0 (the base model), are zero by a ``where`` (not read as data: page-list padding
points at the null block, whose contents are arbitrary). So outputs equal the fixed slot
table's bit for bit, and shapes depend only on (max_loras, max_lora_rank): no recompile
when adapters come and go.

Cost: per layer and step, one gather of slots x r_max x S floats from the pool (the
resident adapters' bytes once per step, plus padding to r_max) into a per-layer
temporary, on top of ``lora_delta``'s per-row gather; the temporary is one layer's, not
the table's (the loop body holds it). docs/lora.md has the measured cost.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PAGED_KEY = "lora_paged"  # its key in the layer loop's parameter tree


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pages", "rank", "scale"],
                   meta_fields=["modules", "max_rank"])  # fmt: skip
@dataclasses.dataclass(frozen=True)
class PagedLoRA:
    """Each adapter slot's pages in the KV pool (module docstring).

    pages: int32 [L, slots, P] block ids (the same rows in every layer; stacked over L so
    the layer loop slices it like any layer parameter; NULL-block padding past an
    adapter's pages); rank: int32 [L, slots] (0: empty slot / slot 0); scale: float32
    [L, slots]; modules: ((group, name, in, out), ...) in layout order (static);
    max_rank: r_max (static)."""

    pages: jax.Array
    rank: jax.Array
    scale: jax.Array
    modules: tuple[tuple[str, str, int, int], ...]
    max_rank: int


def rank_slice_floats(modules: tuple[tuple[str, str, int, int], ...]) -> int:
    """S: float32 values of one rank component of one layer (sum of in + out)."""
    return sum(i + o for _, _, i, o in modules)


def block_floats(pool_shape: tuple[int, ...], itemsize: int) -> int:
    """F: float32 values one KV block holds in one layer (K and V pages together), for a
    pool [L, blocks, H, B, D] of ``itemsize``-byte elements. ValueError when a page's
    bytes are not a whole number of float32s (never for real geometries)."""
    page_bytes = int(np.prod(pool_shape[2:])) * itemsize
    if page_bytes % 4:
        raise ValueError(f"a KV page of {page_bytes} bytes does not hold whole float32s")
    return 2 * page_bytes // 4


def pages_for_rank(rank: int, slice_floats: int, per_block: int) -> int:
    """KV blocks an adapter of ``rank`` occupies: ceil(rank * S / F)."""
    return -(-rank * slice_floats // per_block)


def layout_adapter(weights: dict[str, tuple[np.ndarray, np.ndarray]], rank: int,
                   modules: tuple[tuple[str, str, int, int], ...],
                   num_layers: int) -> np.ndarray:  # fmt: skip
    """float32 [L, rank * S]: the rank-major vectors (module docstring) of an adapter whose
    ``weights`` map module -> (A [L, in, rank], B [L, rank, out]); absent modules are 0."""
    s = rank_slice_floats(modules)
    out = np.zeros((num_layers, rank, s), np.float32)
    off = 0
    for _, name, i, o in modules:
        if name in weights:
            a, b = weights[name]
            out[:, :, off : off + i] = np.swapaxes(a, 1, 2)
            out[:, :, off + i : off + i + o] = b
        off += i + o
    return out.reshape(num_layers, rank * s)


@functools.partial(jax.jit, static_argnums=(1, 2))
def to_pages(flat: jax.Array, dtype: Any, page_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """float32 [L, P * F] -> (K pages, V pages), each [L, P, *page_shape] of ``dtype``,
    holding the float32 bits (the inverse of ``materialize``'s read)."""
    n_layers = flat.shape[0]
    units = _to_units(flat, jnp.dtype(dtype)).reshape(n_layers, -1, 2, *page_shape)
    return units[:, :, 0], units[:, :, 1]


def _to_units(x: jax.Array, dtype: Any) -> jax.Array:
    """float32 [..., n] bitcast to ``dtype`` elements [..., n * 4 / itemsize]."""
    if dtype == jnp.float32:
        return x
    y = jax.lax.bitcast_convert_type(x, dtype)
    return y.reshape(*x.shape[:-1], -1)


def _from_units(u: jax.Array) -> jax.Array:
    """The inverse of ``_to_units``: [..., m] pool elements -> float32 [..., m * itemsize / 4]."""
    if u.dtype == jnp.float32:
        return u
    ratio = 4 // u.dtype.itemsize
    return jax.lax.bitcast_convert_type(u.reshape(*u.shape[:-1], -1, ratio), jnp.float32)


def materialize(view: dict, carry: Any, index: jax.Array) -> dict:
    """A layer's parameter view with ``PAGED_KEY`` replaced by ``lora_a`` [slots, in,
    r_max], ``lora_b`` [slots, r_max, out] and ``lora_scale`` [slots] beside each module's
    kernel, read from layer ``index`` of the K / V pools in ``carry`` ((x, k_pool,
    v_pool), the Llama layer loop's carry). A view without ``PAGED_KEY`` is returned as is."""
    if not isinstance(view, dict) or PAGED_KEY not in view:
        return view
    paged: PagedLoRA = view[PAGED_KEY]
    _, k_pool, v_pool = carry
    if not isinstance(k_pool, jax.Array):
        raise ValueError("paged LoRA adapters need an unquantized KV pool")
    slots, r_max = paged.pages.shape[0], paged.max_rank
    s = rank_slice_floats(paged.modules)
    pages = jnp.asarray(paged.pages, jnp.int32)
    k = k_pool[index, pages]  # [slots, P, H, B, D]: only the slots' pages are read
    v = v_pool[index, pages]
    units = jnp.stack([k.reshape(*pages.shape, -1), v.reshape(*pages.shape, -1)], axis=2)
    flat = _from_units(units.reshape(slots, -1))[:, : r_max * s].reshape(slots, r_max, s)
    live = jnp.arange(r_max)[None, :, None] < paged.rank[:, None, None]
    flat = jnp.where(live, flat, 0.0)  # past the rank, empty slots, slot 0: exact zeros
    out = {key: value for key, value in view.items() if key != PAGED_KEY}
    off = 0
    for group, name, i, o in paged.modules:
        sub = dict(out[group])
        sub[name] = {
            **sub[name],
            "lora_a": jnp.swapaxes(flat[:, :, off : off + i], 1, 2),
            "lora_b": flat[:, :, off + i : off + i + o],
            "lora_scale": paged.scale,
        }
        out[group] = sub
        off += i + o
    return out


__all__ = ["PAGED_KEY", "PagedLoRA", "block_floats", "layout_adapter", "materialize",
           "pages_for_rank", "rank_slice_floats", "to_pages"]
