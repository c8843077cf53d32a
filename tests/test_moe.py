"""Mixture of experts (Mixtral): routing, the dense and grouped dispatches agree, and a
row's output does not depend on the other rows of its batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import PagedRunner

from pagedjax.model import preset_arch, random_params
from pagedjax.model.moe import dense_dispatch, grouped_dispatch, route


def _experts(rng, e, hidden, inter):
    w = lambda *s: jnp.asarray(rng.normal(0, 0.3, s), jnp.float32)
    return w(e, hidden, inter), w(e, hidden, inter), w(e, inter, hidden)


def test_route_is_a_softmax_over_the_chosen_experts():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 2, (9, 8)), jnp.float32)
    weights, experts = route(logits, 2)
    assert weights.shape == experts.shape == (9, 2) and experts.dtype == jnp.int32
    top2 = np.argsort(-np.asarray(logits), axis=1)[:, :2]
    np.testing.assert_array_equal(np.asarray(experts), top2)
    chosen = np.take_along_axis(np.asarray(logits), top2, 1)
    want = np.exp(chosen) / np.exp(chosen).sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6)


@pytest.mark.parametrize(("tokens", "num_experts", "k"), [(13, 4, 2), (3, 8, 1)])
def test_dense_and_grouped_dispatch_agree(tokens, num_experts, k):
    """Incl. experts no token chose (8 experts, 3 tokens, top-1)."""
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.normal(0, 1, (tokens, 16)), jnp.float32)
    w1, w3, w2 = _experts(rng, num_experts, 16, 24)
    weights, experts = route(jnp.asarray(rng.normal(0, 1, (tokens, num_experts))), k)
    dense = dense_dispatch(x, weights, experts, w1, w3, w2, jax.nn.silu)
    grouped = jax.jit(grouped_dispatch, static_argnums=6)(
        x, weights, experts, w1, w3, w2, jax.nn.silu
    )
    # Reference: each token through its experts, one by one (numpy, float64).
    xn, w1n, w3n, w2n = (np.asarray(a, np.float64) for a in (x, w1, w3, w2))
    silu = lambda z: z / (1 + np.exp(-z))
    ref = np.zeros((tokens, 16))
    for t in range(tokens):
        for j in range(k):
            e = int(experts[t, j])
            h = silu(xn[t] @ w1n[e]) * (xn[t] @ w3n[e])
            ref[t] += float(weights[t, j]) * (h @ w2n[e])
    np.testing.assert_allclose(np.asarray(dense), ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grouped), ref, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_moe():
    arch = preset_arch("tiny-mixtral")
    return arch, random_params(arch, seed=3, dtype=jnp.float32, std=0.15)


def _run(arch, params, work_steps):
    runner = PagedRunner(arch, params, block_size=4, max_tokens=32, max_seqs=3, max_len=32)
    out = {}
    for work in work_steps:
        for sid, logits in runner.step(work, all_logits=True).items():
            out.setdefault(sid, []).append(logits)
    return {s: np.concatenate(v) for s, v in out.items()}


@pytest.mark.parametrize("dispatch", ["dense", "grouped"])
def test_batched_equals_solo(tiny_moe, dispatch):
    """Sequence 0's logits are the same alone and sharing every step (prefill and decode)
    with two other sequences: routing never mixes rows."""
    arch, params = tiny_moe
    arch = dataclasses.replace(arch, moe_dispatch=dispatch)
    rng = np.random.default_rng(1)
    seq = [list(map(int, rng.integers(3, 500, n))) for n in (9, 7, 12)]
    decode = [list(map(int, rng.integers(3, 500, 4))) for _ in range(3)]
    solo = _run(arch, params, [[(0, seq[0])]] + [[(0, [d])] for d in decode[0]])
    steps = [[(s, seq[s]) for s in range(3)]]
    steps += [[(s, [decode[s][i]]) for s in range(3)] for i in range(4)]
    batched = _run(arch, params, steps)
    np.testing.assert_allclose(batched[0], solo[0], atol=1e-6, rtol=0)
    assert np.isfinite(batched[1]).all() and np.isfinite(batched[2]).all()


def test_model_dense_and_grouped_dispatch_agree(tiny_moe):
    arch, params = tiny_moe
    rng = np.random.default_rng(2)
    steps = [[(s, list(map(int, rng.integers(3, 500, n)))) for s, n in enumerate((5, 11, 8))]]
    steps += [[(s, [int(rng.integers(3, 500))]) for s in range(3)] for _ in range(3)]
    got = {
        d: _run(dataclasses.replace(arch, moe_dispatch=d), params, steps)
        for d in ("dense", "grouped")
    }
    for s in range(3):
        np.testing.assert_allclose(got["grouped"][s], got["dense"][s], atol=1e-5, rtol=0)
