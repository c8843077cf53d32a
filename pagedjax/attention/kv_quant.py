"""8-bit KV cache formats: quantize on write, dequantize on read (docs/kv_quantization.md).

Formats (``kv_cache_dtype``, vLLM's names):

- ``"fp8"`` / ``"fp8_e4m3"``: float8_e4m3fn pages (max 448, 3 mantissa bits), one scale per
  (layer, KV head) for K and one for V, 1.0 by default as in vLLM.
- ``"fp8_e5m2"``: float8_e5m2 pages (max 57344, 2 mantissa bits), same scales.
- ``"int8_per_token_head"``: int8 pages, symmetric, one float32 scale per (layer, block,
  KV head, slot) for K and for V, computed from that token-head's own max |x| when the token
  is written: a block filling over many steps never needs rescaling, and a scale belongs to
  its slot, so copy-on-write, swap and prefix reuse move it with the block.

The pool keeps its public shape ``(k, v)``: each member is a ``QuantizedPages`` pytree whose
``values`` are ``[L, NB, Hkv, bs, D]`` (``shape``/``ndim``/``dtype`` report them, so shape
checks written for plain pages keep working). fp8 values are *stored as their bytes*
(uint8; ``KVFormat.element`` is the fp8 type they are bit-cast to after a gather): XLA's CPU
backend has no fp8 scatter and lowered each layer's write of an fp8 pool to converting the
whole pool to f16 and back (seen in the optimized HLO), where a uint8 scatter updates the
written rows in place. int8 values are int8. Every *leaf* of a ``QuantizedPages`` is
indexed ``[layer, block, ...]``: the int8 scales are ``float32[L, NB, Hkv, bs, 1]`` (a
trailing unit axis, so each leaf is a 5-D page array and ``copy_blocks``, the swap gathers
and scatters and ``jax.tree.map`` over the pool apply to scales with no special case). The
fp8 per-(layer, head) scales are static pytree metadata, not leaves: they are constants of
the step program (1.0 by default), so no block operation ever sees them.

Saturation: writes clip to the format's finite range before the cast (a plain cast of an
out-of-range value gives NaN in float8_e4m3fn and inf in float8_e5m2); int8 scales are
max |x| / 127 per token-head, so |x / scale| <= 127 by construction (clipped anyway against
rounding). A token-head of zeros gets scale 1 (never 0 / 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto", "float32", "bfloat16", "float16",
    "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head",
)  # fmt: skip
ALIASES = {"fp8": "fp8_e4m3"}
SCALE_DTYPE = jnp.float32


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """One 8-bit storage format.

    name: canonical name. storage: the pages' dtype (uint8 bytes for fp8). element: the
    dtype the stored bytes mean (float8_e4m3fn / float8_e5m2 / int8). max_value: largest
    finite magnitude
    (writes saturate there). per_token: int8 (scale per token-head) vs fp8 (per layer-head).
    rel_error / abs_error: the round-trip bound of one element, in units of its scale:
    |dequant(quant(x)) - x| <= rel_error * |x| + abs_error * scale (tests rely on it).
    """

    name: str
    storage: Any
    element: Any
    max_value: float
    per_token: bool
    rel_error: float
    abs_error: float

    @property
    def scale_bytes_per_token_head(self) -> int:
        """Bytes of scale stored per token and KV head, for K or for V."""
        return np.dtype(SCALE_DTYPE).itemsize if self.per_token else 0


# Round to nearest: half an ulp. e4m3fn: 3 mantissa bits -> relative 2^-4 for normals,
# smallest subnormal 2^-9 -> absolute 2^-10. e5m2: 2 bits -> 2^-3, subnormal 2^-16 -> 2^-17.
# int8: |x / scale| <= 127 rounds to an integer -> absolute 0.5 (x scale).
FORMATS: dict[str, KVFormat] = {
    "fp8_e4m3": KVFormat(
        "fp8_e4m3", jnp.uint8, jnp.float8_e4m3fn, 448.0, False, 2.0**-4, 2.0**-10
    ),
    "fp8_e5m2": KVFormat(
        "fp8_e5m2", jnp.uint8, jnp.float8_e5m2, 57344.0, False, 2.0**-3, 2.0**-17
    ),
    "int8_per_token_head": KVFormat(
        "int8_per_token_head", jnp.int8, jnp.int8, 127.0, True, 0.0, 0.5
    ),
}


def resolve_kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The 8-bit format for a ``kv_cache_dtype`` name, or None for a plain float cache
    ("auto", "float32", "bfloat16", "float16"). Raises ValueError for an unknown name."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return FORMATS.get(ALIASES.get(kv_cache_dtype, kv_cache_dtype))


@jax.tree_util.register_pytree_node_class
class QuantizedPages:
    """The K (or V) half of an 8-bit pool.

    values: [L, NB, Hkv, bs, D] in ``fmt.storage`` (int8, or uint8 bytes of fp8).
    token_scale: float32[L, NB, Hkv, bs, 1] (int8) or None (fp8). layer_scale: static
    ((float,) * Hkv,) * L (fp8) or None (int8).
    Leaves: values, and token_scale when present; fmt and layer_scale are static.
    Only the stacked 5-D form exists (writes and backends take it with a layer index).
    """

    def __init__(
        self,
        values: Any,
        token_scale: Any,
        fmt: KVFormat,
        layer_scale: tuple[tuple[float, ...], ...] | None = None,
    ):
        self.values = values
        self.token_scale = token_scale
        self.fmt = fmt
        self.layer_scale = layer_scale

    def tree_flatten(self):
        children = (self.values,) if self.token_scale is None else (self.values, self.token_scale)
        return children, (self.fmt, self.layer_scale, self.token_scale is None)

    @classmethod
    def tree_unflatten(cls, aux, children):
        fmt, layer_scale, no_token_scale = aux
        token_scale = None if no_token_scale else children[1]
        return cls(children[0], token_scale, fmt, layer_scale)

    # The values' geometry, so code that checks a pool's shape works on both kinds.
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        leaves = jax.tree.leaves(self)
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)

    def scale_array(self) -> jax.Array:
        """float32 scales that broadcast against ``values[layer, pages]`` after indexing as
        ``scale_for(...)`` does: [L, NB, Hkv, bs, 1] (int8) or [L, Hkv] (fp8)."""
        if self.token_scale is not None:
            return self.token_scale
        return jnp.asarray(self.layer_scale, SCALE_DTYPE)

    def __repr__(self) -> str:
        return f"QuantizedPages({self.fmt.name}, values {self.shape})"


def default_layer_scale(num_layers: int, num_kv_heads: int) -> tuple[tuple[float, ...], ...]:
    """vLLM's default fp8 scales: 1.0 for every (layer, KV head)."""
    return ((1.0,) * num_kv_heads,) * num_layers


def allocate_quantized_pages(
    shape: tuple[int, ...],
    fmt: KVFormat,
    *,
    layer_scale: tuple[tuple[float, ...], ...] | None = None,
    fill_value: float = 0.0,
) -> QuantizedPages:
    """Pages of ``shape`` ([L, NB, Hkv, bs, D]) in ``fmt``. ``fill_value=nan`` (tests)
    poisons what an unowned slot would read: NaN values for fp8, NaN scales for int8 (int8
    has no NaN; its values are then 0)."""
    if fmt.per_token:
        values = jnp.zeros(shape, fmt.storage)
        scale = jnp.full((*shape[:-1], 1), 1.0 if fill_value == 0.0 else fill_value, SCALE_DTYPE)
        return QuantizedPages(values, scale, fmt, None)
    if layer_scale is None:
        layer_scale = default_layer_scale(shape[0], shape[2])
    check_layer_scale(layer_scale, shape[0], shape[2])
    fill = to_storage(jnp.full((), fill_value, fmt.element), fmt)
    return QuantizedPages(jnp.full(shape, fill, fmt.storage), None, fmt, layer_scale)


def check_layer_scale(layer_scale: Any, num_layers: int, num_kv_heads: int) -> None:
    arr = np.asarray(layer_scale, np.float64)
    if arr.shape != (num_layers, num_kv_heads) or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(
            f"fp8 KV scales must be finite positive floats of shape [{num_layers}, "
            f"{num_kv_heads}] (layer, KV head), got shape {arr.shape}"
        )


def quantize(
    x: jax.Array, fmt: KVFormat, layer_scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """(values, token_scale) of x [..., D] in ``fmt``.

    int8: token_scale float32[..., 1] = max |x| / 127 over D (1 where that is 0);
    values = round(x / scale) in [-127, 127]. fp8: ``layer_scale`` broadcasts against
    x[..., :1] (e.g. [Hkv, 1] for x [T, Hkv, D]); values = the bytes of saturate(x / scale)
    cast to the format (round to nearest even), as uint8; token_scale None. NaN stays NaN
    in fp8; never produced from a finite overflow.
    """
    xf = x.astype(jnp.float32)
    if fmt.per_token:
        amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / fmt.max_value, 1.0).astype(SCALE_DTYPE)
        q = jnp.clip(jnp.round(xf / scale), -fmt.max_value, fmt.max_value)
        return q.astype(fmt.storage), scale
    if layer_scale is None:
        raise ValueError(f"{fmt.name} needs a layer_scale")
    y = jnp.clip(xf / layer_scale.astype(jnp.float32), -fmt.max_value, fmt.max_value)
    return to_storage(y.astype(fmt.element), fmt), None


def to_storage(x: jax.Array, fmt: KVFormat) -> jax.Array:
    """Values of ``fmt.element`` as stored: fp8 bit-cast to its bytes, int8 unchanged."""
    if fmt.storage == fmt.element:
        return x
    return jax.lax.bitcast_convert_type(x, fmt.storage)


def to_float(values: jax.Array, fmt: KVFormat | None) -> jax.Array:
    """Stored values (any gathered subset) as float32: fp8 bytes bit-cast back first."""
    if fmt is not None and fmt.storage != fmt.element:
        values = jax.lax.bitcast_convert_type(values, fmt.element)
    return values.astype(jnp.float32)


def dequantize(values: jax.Array, scale: jax.Array | None, fmt: KVFormat | None) -> jax.Array:
    """float32 stored values * scale (scale broadcast; None = 1)."""
    out = to_float(values, fmt)
    return out if scale is None else out * scale.astype(jnp.float32)


def split_pages(pages: Any) -> tuple[jax.Array, jax.Array | None, KVFormat | None]:
    """(values, scale, fmt) of plain or quantized pages: scale and fmt None for a plain
    float pool; scale float32[L, NB, Hkv, bs, 1] (int8, per token-head) or float32[L, Hkv]
    (fp8, per layer-head)."""
    if isinstance(pages, QuantizedPages):
        return pages.values, pages.scale_array(), pages.fmt
    return pages, None, None


def gather_dequantized(
    values: jax.Array,
    scale: jax.Array | None,
    layer: jax.Array,
    pages: jax.Array,
    fmt: KVFormat | None = None,
) -> jax.Array:
    """float32 values[layer, pages] * its scale: [*pages.shape, Hkv, bs, D] from a stacked
    pool [L, NB, Hkv, bs, D] (``scale``, ``fmt`` as ``split_pages`` returns them). Only the
    gathered pages are converted, never the pool."""
    x = to_float(values[layer, pages], fmt)
    if scale is None:
        return x
    if scale.ndim == 2:  # per (layer, KV head): broadcast over pages, slots and D
        return x * scale[layer][:, None, None]
    return x * scale[layer, pages]


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str, model_dtype: Any
) -> int:
    """Bytes of K and V (and their scales) one token occupies across all layers."""
    fmt = resolve_kv_format(kv_cache_dtype)
    if fmt is None:
        itemsize = np.dtype(plain_dtype(kv_cache_dtype, model_dtype)).itemsize
        return 2 * num_layers * num_kv_heads * head_dim * itemsize
    per_head = head_dim * np.dtype(fmt.storage).itemsize + fmt.scale_bytes_per_token_head
    return 2 * num_layers * num_kv_heads * per_head


def plain_dtype(kv_cache_dtype: str, model_dtype: Any) -> Any:
    """The float pool dtype of a non-8-bit ``kv_cache_dtype`` ("auto": the model's)."""
    names = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    return model_dtype if kv_cache_dtype == "auto" else names[kv_cache_dtype]


__all__ = [
    "FORMATS",
    "KV_CACHE_DTYPES",
    "KVFormat",
    "QuantizedPages",
    "allocate_quantized_pages",
    "dequantize",
    "gather_dequantized",
    "kv_bytes_per_token",
    "plain_dtype",
    "quantize",
    "resolve_kv_format",
    "split_pages",
    "to_float",
    "to_storage",
]
