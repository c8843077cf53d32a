"""KV write / block copy (XLA scatters) against numpy, and the backend switch."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import parity
from pallas_kernels.dispatch import select_attention_backend
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


def test_dispatch(monkeypatch):
    assert select_attention_backend("reference").name == "reference"
    assert select_attention_backend("pallas").name == "pallas"
    assert select_attention_backend("native_cpu").name == "native_cpu"
    # These tests run on CPU: auto is the native CPU kernel where it builds, else the
    # reference, with or without a parity run; never the Pallas kernels.
    auto = select_attention_backend("auto")
    assert auto.name in ("native_cpu", "reference") and auto.reason.startswith("auto: CPU")
    monkeypatch.setattr(parity, "H200_PARITY_VERIFIED", True)
    assert select_attention_backend("auto").name != "pallas"
    a100 = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
    assert "not a Hopper" in select_attention_backend("auto", device=a100).reason
    monkeypatch.setattr(parity, "H200_PARITY_VERIFIED", False)
    h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    assert select_attention_backend("auto", device=h200).name == "reference"
    sentinel = lambda *a, **k: None
    assert select_attention_backend("reference", reference=sentinel).ragged_paged_attention is (
        sentinel
    )
    with pytest.raises(ValueError):
        select_attention_backend("triton")
