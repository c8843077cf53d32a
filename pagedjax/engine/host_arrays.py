"""Device arrays built on the host: numpy, then one ``jax.device_put``.

Why: outside ``jit`` every ``jnp`` call dispatches as an XLA program of its own, and in
this jax ``jnp.asarray(numpy_array)`` compiles a ``stage`` program per shape and dtype,
``jnp.zeros`` / ``jnp.full`` / ``jnp.zeros_like`` a ``broadcast_in_dim`` one: 17-80 ms
of CPU each on a cold cache, hundreds of them in a test run (docs/testing.md, the cold
run). ``jax.device_put`` of a numpy array compiles nothing.

Contract: the results equal what the ``jnp`` calls they replace gave. dtypes are
canonicalized the same way (float64 -> float32, int64 -> int32 without x64); numpy
arrays have no weak types. ``may_alias=False`` always: on a CPU, ``device_put`` may
share a numpy array's buffer (measured: a small int32 array did), while ``jnp.asarray``
copied; the engine mutates its host mirrors in place and donates device buffers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def upload(tree: Any) -> Any:
    """``jnp.asarray`` over a pytree of numpy arrays (or scalars), uncommitted on the
    default device like it, copied, without compiling a program."""
    return jax.device_put(tree, may_alias=False)


def filled_like(x: jax.Array, fill_value: Any) -> jax.Array:
    """``jnp.full_like(x, fill_value)``: same shape, dtype and placement (a committed
    ``x``, e.g. on a tensor-parallel mesh, gives a result committed to its sharding; an
    uncommitted one an uncommitted result, so jit's cache keys do not change), built on
    the host. A weakly typed ``x`` keeps ``jnp.full_like`` (numpy has no weak types)."""
    if x.weak_type:
        return jnp.full_like(x, fill_value)
    host = np.full(x.shape, fill_value, x.dtype)
    if x.committed:
        return jax.device_put(host, x.sharding, may_alias=False)
    return jax.device_put(host, may_alias=False)


def zeros_like_tree(tree: Any) -> Any:
    """``jax.tree.map(jnp.zeros_like, tree)`` with ``filled_like``."""
    return jax.tree.map(lambda x: filled_like(x, 0), tree)
