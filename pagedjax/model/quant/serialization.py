"""Quantized params <-> a plain tree Orbax can save, plus a JSON description of formats.

``to_plain(params)`` replaces each ``QuantizedWeight`` by a dict of its arrays
({"data", "scale", "zero"?, "offset"?, "perm"?}; fp8 data as its uint8 bytes, since not
every Orbax / TensorStore version stores float8) and returns, beside the tree, the
static format of each one by its "/"-joined path. ``from_plain`` inverts it exactly.
``save_params`` / ``restore_params`` (loader.py) write the description as quant.json
beside the arrays, so a model is quantized once and restored packed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.quant.weight import QuantizedWeight

_ARRAYS = ("data", "scale", "zero", "offset", "perm")
_STATIC = ("in_features", "bits", "group_size", "code_offset", "codebook", "act_quant", "fmt")
_FP8 = np.dtype(jnp.float8_e4m3fn)


def _is_q(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def _path(path: tuple) -> str:
    return "/".join(str(getattr(p, "key", p)) for p in path)


def to_plain(params: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """(tree with plain dicts in place of QuantizedWeights, {path: static format})."""
    formats: dict[str, dict[str, Any]] = {}

    def one(path, leaf):
        if not _is_q(leaf):
            return leaf
        spec = {k: getattr(leaf, k) for k in _STATIC}
        spec["codebook"] = None if leaf.codebook is None else list(leaf.codebook)
        spec["fp8"] = leaf.is_float
        formats[_path(path)] = spec
        out = {k: getattr(leaf, k) for k in _ARRAYS if getattr(leaf, k) is not None}
        if leaf.is_float:
            out["data"] = jax.lax.bitcast_convert_type(out["data"], jnp.uint8)
        return out

    plain = jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_q)
    return plain, formats


def from_plain(plain: Any, formats: dict[str, dict[str, Any]]) -> Any:
    """Inverse of to_plain. ValueError if a described path is missing from the tree."""
    if not formats:
        return plain
    found = set()

    def rebuild(node: Any, prefix: str) -> Any:
        if prefix in formats:
            found.add(prefix)
            spec = dict(formats[prefix])
            fp8 = spec.pop("fp8")
            spec["codebook"] = None if spec["codebook"] is None else tuple(spec["codebook"])
            arrays = {k: node.get(k) for k in _ARRAYS}
            if fp8:
                arrays["data"] = jax.lax.bitcast_convert_type(
                    jnp.asarray(arrays["data"]), jnp.float8_e4m3fn
                )
            return QuantizedWeight(**arrays, **spec)
        if isinstance(node, dict):
            return {k: rebuild(v, f"{prefix}/{k}" if prefix else str(k)) for k, v in node.items()}
        return node

    out = rebuild(dict(plain), "")
    missing = set(formats) - found
    if missing:
        raise ValueError(f"saved quantization formats name missing parameters: {sorted(missing)}")
    return out
