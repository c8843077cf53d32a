"""The native CPU LoRA delta (pagedjax/model/native_lora.py, cpu_lora.cc).

It must equal the per-row definition ``x[i] @ A[layer, s] @ B[layer, s] * scale[s]``
(numpy, float64) for any mix of slots, give base rows (slot 0) exact zeros, clip slot
ids as ``lora_delta`` does, give a row the same delta whatever the batch around it,
refuse a layer outside the stack, and be what the model's Linear runs under the layer
loop (an engine-level parity with peft is in test_lora_engine.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import native_build
from pagedjax.model import native_lora as nl
from pagedjax.model.lora_delta import lora_delta

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or native_build.compiler() is None,
    reason="needs a C++ compiler and the CPU backend",
)

_delta = jax.jit(nl.stacked_lora_delta)


def _tables(rng, layers, slots, k, n, r):
    a = rng.standard_normal((layers, slots, k, r)).astype(np.float32)
    b = rng.standard_normal((layers, slots, r, n)).astype(np.float32)
    a[:, 0], b[:, 0] = 0, 0  # slot 0: the base model, as the slot table keeps it
    scale = rng.uniform(0.5, 2, size=slots).astype(np.float32)
    return a, b, scale


def test_kernel_builds_where_a_compiler_is_present():
    ok, why = nl.available()
    assert ok, f"native LoRA kernel did not build with {native_build.compiler()}: {why}"


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 70),
    slots=st.integers(1, 6),
    k=st.integers(1, 90),
    n=st.integers(1, 90),
    r=st.sampled_from([1, 3, 8, 16]),
    layers=st.integers(1, 3),
    data=st.data(),
)
def test_equals_the_per_row_definition(rows, slots, k, n, r, layers, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    a, b, scale = _tables(rng, layers, slots, k, n, r)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    ids = rng.integers(-2, slots + 2, rows).astype(np.int32)  # out of range: clipped
    layer = data.draw(st.integers(0, layers - 1))
    got = np.asarray(_delta(x, ids, a, b, scale, layer))
    s = np.clip(ids, 0, slots - 1)
    x64, a64, b64 = (np.asarray(v, np.float64) for v in (x, a[layer], b[layer]))
    want = np.stack([x64[i] @ a64[j] @ b64[j] * scale[j] for i, j in enumerate(s)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(k, 1) ** 0.5)
    assert np.all(got[s == 0] == 0.0)  # base rows: exact zeros, not small numbers


def test_equals_lora_delta_at_smollm2_decode_shapes():
    """64 rows over 16 adapters and base rows, SmolLM2's MLP widths, 17 slots of rank 8."""
    rng = np.random.default_rng(1)
    a, b, scale = _tables(rng, 2, 17, 576, 1536, 8)
    x = rng.standard_normal((64, 576)).astype(np.float32)
    ids = (np.arange(64) % 17).astype(np.int32)
    got = _delta(x, ids, a, b, scale, 1)
    want = lora_delta(x, ids, a[1], b[1], scale)
    # fp32 sums over 576 then 8 terms of unit-scale products, in different orders.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=2e-3)


def test_row_independent_of_batch():
    """A row's delta is bitwise the same alone and among rows of other adapters (the sums'
    order does not depend on the batch), so solo and batched engine runs agree exactly."""
    rng = np.random.default_rng(2)
    a, b, scale = _tables(rng, 1, 5, 64, 48, 8)
    x = rng.standard_normal((21, 64)).astype(np.float32)
    ids = rng.integers(0, 5, 21).astype(np.int32)
    full = np.asarray(_delta(x, ids, a, b, scale, 0))
    for i in (0, 7, 20):
        alone = np.asarray(_delta(x[i : i + 1], ids[i : i + 1], a, b, scale, 0))[0]
        np.testing.assert_array_equal(alone, full[i])


def test_layer_out_of_range_is_an_error():
    rng = np.random.default_rng(3)
    a, b, scale = _tables(rng, 2, 3, 8, 16, 4)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(Exception, match="layer index 2 outside"):
        jax.block_until_ready(_delta(x, np.ones(4, np.int32), a, b, scale, 2))


def test_uses_the_kernel_only_where_it_applies():
    x = jnp.zeros((4, 8), jnp.float32)
    a, b = jnp.zeros((2, 3, 8, 4)), jnp.zeros((2, 3, 4, 16))
    assert nl.uses_native_lora(x, a, b, native=True)
    assert not nl.uses_native_lora(x, a, b, native=False)  # TP / PP: the caller says no
    assert not nl.uses_native_lora(x.astype(jnp.bfloat16), a, b, native=True)
    assert not nl.uses_native_lora(x, a.astype(jnp.bfloat16), b, native=True)
    assert not nl.uses_native_lora(x, a[0], b[0], native=True)  # unstacked: XLA's forms


def _layer_step_hlo(native: bool) -> str:
    """A LoRA Linear under ``run_layers``' loop, compiled: does it call the kernel?"""
    from pagedjax.model.layers import Linear, layer_view

    def f(params, x, slots):
        def body(i, y):
            view = layer_view(params, i, native)
            return Linear(16, use_bias=False).apply({"params": view}, y, slots)

        return jax.lax.fori_loop(0, 2, body, x)

    rng = np.random.default_rng(4)
    a, b, scale = _tables(rng, 2, 3, 16, 16, 4)
    params = {"kernel": jnp.zeros((2, 16, 16)), "lora_a": a, "lora_b": b,
              "lora_scale": jnp.broadcast_to(scale, (2, 3))}  # fmt: skip
    x, slots = jnp.ones((5, 16)), jnp.arange(5, dtype=jnp.int32) % 3
    return jax.jit(f).lower(params, x, slots).compile().as_text()


def test_layer_loop_runs_the_kernel_and_the_switch_turns_it_off():
    assert nl.TARGET in _layer_step_hlo(native=True)
    assert nl.TARGET not in _layer_step_hlo(native=False)


def test_layer_loop_values_equal_the_xla_forms():
    """The same two-layer loop, kernel against the XLA forms on the sliced tables."""
    from pagedjax.model.layers import Linear, layer_view

    rng = np.random.default_rng(5)
    a, b, scale = _tables(rng, 2, 3, 16, 16, 4)
    w = rng.standard_normal((2, 16, 16)).astype(np.float32) / 4
    params = {"kernel": w, "lora_a": a, "lora_b": b,
              "lora_scale": np.broadcast_to(scale, (2, 3))}  # fmt: skip
    x = rng.standard_normal((5, 16)).astype(np.float32)
    slots = np.array([0, 1, 2, 1, 0], np.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def run(native, params, x, slots):
        def body(i, y):
            return Linear(16, use_bias=False).apply({"params": layer_view(params, i, native)},
                                                    y, slots)  # fmt: skip

        return jax.lax.fori_loop(0, 2, body, x)

    np.testing.assert_allclose(
        np.asarray(run(True, params, x, slots)),
        np.asarray(run(False, params, x, slots)),
        rtol=1e-5,
        atol=1e-5,
    )
