"""KV write / block copy (XLA scatters) against numpy.

The backend switch moved to pagedjax.attention.backends; its test is
tests/test_attention_backends.py (this directory runs without pagedjax's dependencies).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_cache import copy_blocks, write_kv


def test_write_kv_by_slot_mapping_drops_padding():
    rng = np.random.default_rng(0)
    n, h, b, d, t = 5, 2, 4, 8, 7
    k = rng.standard_normal((n, h, b, d)).astype(np.float32)
    v = rng.standard_normal((n, h, b, d)).astype(np.float32)
    kn = rng.standard_normal((t, h, d)).astype(np.float32)
    vn = rng.standard_normal((t, h, d)).astype(np.float32)
    # distinct live slots; -1 and n*b are padding (must not wrap onto the last slot)
    slots = np.array([3, 17, 4, n * b, -1, 0, 19], np.int32)
    k2, v2 = write_kv(jnp.asarray(k), jnp.asarray(v), jnp.asarray(kn), jnp.asarray(vn),
                      jnp.asarray(slots))  # fmt: skip
    ek, ev = k.copy(), v.copy()
    for i, s in enumerate(slots):
        if 0 <= s < n * b:
            ek[s // b, :, s % b] = kn[i]
            ev[s // b, :, s % b] = vn[i]
    np.testing.assert_array_equal(np.asarray(k2), ek)
    np.testing.assert_array_equal(np.asarray(v2), ev)


def test_copy_blocks_cow_and_swap():
    rng = np.random.default_rng(1)
    dev = rng.standard_normal((6, 2, 4, 8)).astype(np.float32)
    host = rng.standard_normal((3, 2, 4, 8)).astype(np.float32)
    # copy-on-write inside one pool, reading sources before writes (chain 1->2, 2->3)
    src = np.array([1, 2, 5], np.int32)
    dst = np.array([2, 3, 99], np.int32)  # 99: padding pair, copies nothing
    out = np.asarray(copy_blocks(jnp.asarray(dev), jnp.asarray(dev), jnp.asarray(src),
                                 jnp.asarray(dst)))  # fmt: skip
    expect = dev.copy()
    expect[2], expect[3] = dev[1], dev[2]
    np.testing.assert_array_equal(out, expect)
    # swap out: device blocks 4, 0 -> host slots 0, 2
    swapped = copy_blocks(jnp.asarray(dev), jnp.asarray(host), jnp.array([4, 0], jnp.int32),
                          jnp.array([0, 2], jnp.int32))  # fmt: skip
    expect_h = host.copy()
    expect_h[0], expect_h[2] = dev[4], dev[0]
    np.testing.assert_array_equal(np.asarray(swapped), expect_h)
    with pytest.raises(ValueError):
        copy_blocks(jnp.asarray(dev), jnp.asarray(host[:, :1]), jnp.asarray(src), jnp.asarray(dst))
