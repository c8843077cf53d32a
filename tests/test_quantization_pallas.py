"""The Pallas W4A16 kernel on pagedjax's QuantizedWeight (pagedjax/model/quant/
pallas_w4a16.py), in the GPU interpreter: equal to the XLA ``quantized_matmul`` on the
same weight up to the kernel's bf16 / fp16 operand rounding. (The kernel-only tests,
poisoned padding included, are tests/kernels/test_w4a16.py: they import no pagedjax.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.model.quant.inflight import quantize_int4, quantize_nf4
from pagedjax.model.quant.pallas_w4a16 import pallas_w4a16_matmul
from pagedjax.model.quant.weight import QuantizedWeight, pack_nibbles, quantized_matmul
from pallas_kernels.w4a16 import default_interpret


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _asymmetric(rng, n_in: int, n_out: int, group: int) -> QuantizedWeight:
    """AWQ's form: codes 0..15, a uint8 zero point and a scale per group, plus an offset
    (GGUF's d * q + m) so every term of the representation is exercised."""
    g = n_in // group
    return QuantizedWeight(
        jnp.asarray(pack_nibbles(rng.integers(0, 16, (n_in, n_out)))),
        jnp.asarray(rng.uniform(0.01, 0.05, (g, n_out)), jnp.float32),
        zero=jnp.asarray(rng.integers(0, 16, (g, n_out)), jnp.uint8),
        offset=jnp.asarray(rng.normal(scale=0.01, size=(g, n_out)), jnp.float32),
        in_features=n_in, bits=4, group_size=group, fmt="awq-like",
    ).check()  # fmt: skip


@pytest.mark.parametrize("kind,dtype", [("int4", jnp.bfloat16), ("asymmetric", jnp.float32)])
def test_kernel_equals_quantized_matmul(kind, dtype):
    rng = np.random.default_rng(3)
    n_in, n_out, tokens = 256, 64, 5
    if kind == "int4":  # pagedjax's in-flight int4: symmetric, codes q + 8, groups of 128
        w = quantize_int4(rng.normal(size=(n_in, n_out)).astype(np.float32))
    else:
        w = _asymmetric(rng, n_in, n_out, 64)
    x = jnp.asarray(rng.normal(size=(tokens, n_in)), dtype)
    got = pallas_w4a16_matmul(x, w, interpret=default_interpret())
    # quantized_matmul in float32: the reference at full precision (the kernel's bf16
    # products are what the tolerance below allows for).
    want = quantized_matmul(x.astype(jnp.float32), w).astype(dtype)
    assert got.shape == want.shape and got.dtype == want.dtype
    # The kernel multiplies bf16 weights (and, for fp32 x, bf16 activations): relative
    # error a few x 2^-9; an unpacking or scaling mistake is O(1).
    assert _rel_err(got, want) < 1e-2


def test_refuses_what_the_kernel_does_not_take():
    rng = np.random.default_rng(0)
    nf4 = quantize_nf4(rng.normal(size=(128, 8)).astype(np.float32))
    with pytest.raises(ValueError, match="nf4 is not 4-bit integer codes"):
        pallas_w4a16_matmul(jnp.zeros((1, 128)), nf4)
    int4 = quantize_int4(rng.normal(size=(128, 8)).astype(np.float32))
    with pytest.raises(ValueError, match="65 tokens, at most 64"):
        pallas_w4a16_matmul(jnp.zeros((65, 128)), int4)
