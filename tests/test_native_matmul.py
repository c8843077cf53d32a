"""The CPU matmul over stacked layer weights (pagedjax/model/native_matmul.py).

It must equal ``x @ w[layer]`` (fp32 rounding), give a row the same result whatever the
batch around it, refuse a layer outside the stack, and, in a compiled step, leave no copy
of a layer's dense kernel behind (the reason it exists); a control shows the check catches
the copies the XLA path makes.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import native_build
from pagedjax.attention import native_cpu
from pagedjax.model import allocate_kv_cache, dummy_input, preset_arch, random_params
from pagedjax.model import native_matmul as nm
from pagedjax.model.forward import forward

# Skipped only where the kernel cannot exist (no C++ compiler, not a CPU): where a compiler
# is present a failed build fails every test below (and the one right after), instead of
# skipping them while the engine silently falls back to XLA's matmul.
pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or native_build.compiler() is None,
    reason="needs a C++ compiler and the CPU backend",
)


def test_kernel_builds_where_a_compiler_is_present():
    ok, why = nm.available()
    assert ok, f"native matmul did not build with {native_build.compiler()}: {why}"


def _data(rows: int, k: int, n: int, layers: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k), np.float32)
    w = rng.standard_normal((layers, k, n), np.float32) / np.sqrt(k)
    return jnp.asarray(x), jnp.asarray(w)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, nm.MAX_ROWS),
    k=st.integers(1, 300),
    n_vectors=st.integers(1, 13),  # N = 16 .. 208: whole 64-column tiles and 16/32/48 tails
    layers=st.integers(1, 4),
    data=st.data(),
)
def test_equals_xla_dot(rows, k, n_vectors, layers, data):
    layer = data.draw(st.integers(0, layers - 1))
    x, w = _data(rows, k, 16 * n_vectors, layers)
    assert nm.uses_native(x, w, native=True)
    got = jax.jit(functools.partial(nm.stacked_matmul, native=True))(x, w, layer)
    want = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
    # fp32 sums of k products of unit-scale terms: a few ulps of sqrt(k) in the worst case.
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * max(k, 1) ** 0.5)


def test_row_independent_of_batch():
    """A row's result is bitwise the same alone and among others (the sum's order over K
    does not depend on T), so batched and solo runs of the engine agree exactly."""
    x, w = _data(37, 256, 176, 3)  # two whole tiles and a 48-column tail
    f = jax.jit(functools.partial(nm.stacked_matmul, native=True))
    full = np.asarray(f(x, w, 2))
    for r in (0, 5, 36):
        np.testing.assert_array_equal(np.asarray(f(x[r : r + 1], w, 2))[0], full[r])


def test_falls_back_outside_its_shapes():
    """Too many rows, N not a multiple of 16, bf16: XLA's dot, same values."""
    for rows, n, dtype in ((nm.MAX_ROWS + 1, 64, jnp.float32), (4, 40, jnp.float32),
                           (4, 64, jnp.bfloat16)):  # fmt: skip
        x, w = _data(rows, 32, n, 2)
        x, w = x.astype(dtype), w.astype(dtype)
        assert not nm.uses_native(x, w, native=True)
        got = nm.stacked_matmul(x, w, 1, native=True)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(x @ w[1], np.float32), rtol=2e-2, atol=2e-2
        )


def test_layer_out_of_range_is_an_error():
    x, w = _data(4, 32, 64, 2)
    with pytest.raises(Exception, match="layer index 2 outside"):
        jax.block_until_ready(jax.jit(functools.partial(nm.stacked_matmul, native=True))(x, w, 2))


def _step_hlo(native: bool, num_tokens: int) -> str:
    arch = preset_arch("tiny-llama")
    params = jax.eval_shape(lambda: random_params(arch, dtype=jnp.float32))
    kv = jax.eval_shape(lambda: allocate_kv_cache(arch, 64, 16, jnp.float32))
    fn = functools.partial(forward, arch=arch, attention_fn=native_cpu.ragged_paged_attention,
                           native_matmul=native)  # fmt: skip
    batch = dummy_input(num_tokens, 4, 8)
    return jax.jit(fn, donate_argnums=1).lower(params, kv, batch).compile().as_text()


def kernel_copies(hlo: str) -> list[str]:
    """Lines materializing one layer of a dense kernel the native path handles (tiny-llama:
    q/o_proj [64, 64], k/v_proj [64, 32] (a 32-column tail tile), gate/up_proj [64, 128],
    down_proj [128, 64])."""
    shapes = r"f32\[(64,64|64,32|64,128|128,64)\]"
    return [ln.strip()[:140] for ln in hlo.splitlines()
            if re.search(rf"= {shapes}\{{[^}}]*\}} (fusion|dynamic-slice|copy)\(", ln)]  # fmt: skip


def test_compiled_step_copies_no_layer_kernel():
    assert kernel_copies(_step_hlo(native=True, num_tokens=16)) == []


def test_control_xla_path_copies_each_layer_kernel():
    """The check catches the copies: without the kernel (or past MAX_ROWS) they are there."""
    assert len(kernel_copies(_step_hlo(native=False, num_tokens=16))) >= 7
    assert len(kernel_copies(_step_hlo(native=True, num_tokens=nm.MAX_ROWS * 2))) >= 5


def test_unstacked_head_runs_the_kernel():
    """``Linear(native=True)`` (the LM head) multiplies through the kernel as a one-layer
    stack, with nn.Dense's values; without ``native`` the program holds no kernel call."""
    from pagedjax.model.layers import Linear

    x, w = _data(5, 96, 8192 + 48, 1)
    params = {"params": {"kernel": w[0]}}
    for native in (True, False):
        head = Linear(w.shape[2], use_bias=False, native=native)
        lowered = jax.jit(head.apply).lower(params, x).as_text()
        assert (nm.TARGET in lowered) == native
        np.testing.assert_allclose(
            np.asarray(head.apply(params, x)), np.asarray(x) @ np.asarray(w[0]), atol=1e-4
        )


def test_one_row_tied_head_runs_as_two_rows():
    """The tied LM head (x @ E.T) takes one row as two on a CPU (layers.dot_transposed:
    XLA's one-row path against a transposed weight is ~3x slower); values as x @ E.T."""
    from pagedjax.model.layers import dot_transposed

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((1000, 64), np.float32))
    for rows in (1, 2, 5):
        x = jnp.asarray(rng.standard_normal((rows, 64), np.float32))
        hlo = jax.jit(dot_transposed).lower(x, w).as_text()
        dots = re.findall(r"dot_general .*-> tensor<(\d+)x1000xf32>", hlo)
        assert [int(d) for d in dots] == [max(rows, 2)], (rows, dots)
        np.testing.assert_allclose(np.asarray(dot_transposed(x, w)),
                                   np.asarray(x) @ np.asarray(w).T, rtol=1e-5, atol=1e-4)
