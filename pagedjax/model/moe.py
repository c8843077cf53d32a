"""Mixture-of-experts MLP (Mixtral): top-k routing and two ways to run the chosen experts.

Each token's router logits [E] (fp32) pick its top-k experts; their softmax probabilities,
renormalized to sum to 1 (= a softmax over the chosen logits), weight the experts' SwiGLU
outputs. Rows never interact: no capacity limit, no dropped tokens, so a token's output is
the same whatever else shares the batch (tests/test_moe.py checks batched == solo).

Two dispatches, equal up to fp32 summation order:
- ``dense_dispatch``: every expert on every token, combined by a [T, E] matrix that is zero
  off the chosen experts. E / k times the needed FLOPs, but three plain batched matmuls.
- ``grouped_dispatch``: the T * k (token, expert) pairs sorted by expert and run through
  ``jax.lax.ragged_dot`` (one grouped matmul per weight), then unsorted and summed. Only the
  needed FLOPs; costs a sort, two gathers and a scatter-add.
Which is faster depends on T, E and the backend; docs/model_families.md has the CPU numbers.

Expert weights are stacked: w1 (gate) and w3 (up) [E, hidden, inter], w2 (down)
[E, inter, hidden], the layout HF's per-expert w1/w2/w3 matrices are transposed and stacked
into at load (loader.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pagedjax.model.config import ModelArch
from pagedjax.model.layers import activation, linear


def route(router_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """router_logits [T, E] -> (weights float32 [T, k] summing to 1 per row, experts
    int32 [T, k]). As HF Mixtral: softmax over all E in fp32, top-k, renormalize."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, k)
    return top / jnp.sum(top, axis=-1, keepdims=True), experts.astype(jnp.int32)


def _expert_mlp(h_gate: jax.Array, h_up: jax.Array, act: Callable) -> jax.Array:
    return act(h_gate) * h_up


def dense_dispatch(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w1: jax.Array,
    w3: jax.Array,
    w2: jax.Array,
    act: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """x [T, H], weights/experts [T, k] -> [T, H] in x.dtype: all experts on all tokens."""
    num_experts = w1.shape[0]
    # [T, E]: the routing weight of each expert for each token, 0 where not chosen.
    one_hot = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)  # [T, k, E]
    combine = jnp.sum(one_hot * weights[..., None], axis=1)
    h = _expert_mlp(jnp.einsum("th,ehi->tei", x, w1), jnp.einsum("th,ehi->tei", x, w3), act)
    y = jnp.einsum("tei,eih->teh", h, w2)
    return jnp.einsum("te,teh->th", combine.astype(y.dtype), y).astype(x.dtype)


def grouped_dispatch(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w1: jax.Array,
    w3: jax.Array,
    w2: jax.Array,
    act: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """x [T, H], weights/experts [T, k] -> [T, H] in x.dtype: each token through its k
    experts only, as one grouped matmul over the pairs sorted by expert."""
    t, k = experts.shape
    num_experts = w1.shape[0]
    flat = experts.reshape(-1)  # [T * k], pair p = token p // k, choice p % k
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]  # [T * k, H], grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    h = _expert_mlp(jax.lax.ragged_dot(rows, w1, sizes), jax.lax.ragged_dot(rows, w3, sizes), act)
    y = jax.lax.ragged_dot(h, w2, sizes)  # [T * k, H]
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    out = jnp.zeros((t, x.shape[1]), y.dtype).at[order // k].add(y)
    return out.astype(x.dtype)


DISPATCH = {"dense": dense_dispatch, "grouped": grouped_dispatch}


class SparseMoE(nn.Module):
    """Mixtral's block_sparse_moe: x [T, hidden] -> [T, hidden]. Params: the router ``gate``
    (a linear layer, hidden -> E, no bias) and the stacked experts w1, w3, w2."""

    arch: ModelArch
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        a, pd = self.arch, self.param_dtype
        e, hidden, inter = a.num_experts, a.hidden_size, a.intermediate_size
        init = nn.initializers.normal(0.02)
        w1 = self.param("w1", init, (e, hidden, inter), pd)
        w3 = self.param("w3", init, (e, hidden, inter), pd)
        w2 = self.param("w2", init, (e, inter, hidden), pd)
        router_logits = linear(e, "gate", bias=False, param_dtype=pd)(x)
        weights, experts = route(router_logits, a.experts_per_token)
        dispatch = DISPATCH[a.moe_dispatch]
        return dispatch(x, weights, experts, w1, w3, w2, activation(a.hidden_act))
