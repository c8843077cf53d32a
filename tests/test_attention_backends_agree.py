"""The two XLA references agree: pagedjax.attention (the engine's CPU path and oracle)
and pallas_kernels.reference (the torch/flax-free oracle the kernel tests use), on
poisoned random cases with garbage table tails."""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from pagedjax.attention import ragged_paged_attention
from pallas_kernels.cases import make_case
from pallas_kernels.reference import ragged_paged_attention_reference

BS, MB, SEQS, T, HQ, HKV, D = 8, 5, 3, 24, 4, 2, 16

ours = jax.jit(functools.partial(ragged_paged_attention, sm_scale=D**-0.5))
theirs = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=D**-0.5))


@settings(max_examples=40)
@given(data=st.data())
def test_references_agree(data):
    kv_lens = data.draw(st.lists(st.integers(0, MB * BS), min_size=SEQS, max_size=SEQS))
    q_lens = [data.draw(st.integers(1, min(n, T // SEQS))) if n else 0 for n in kv_lens]
    seed = data.draw(st.integers(0, 2**16))
    case = make_case(
        np.random.default_rng(seed),
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_tokens=T,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        block_size=BS,
        max_blocks=MB,
        num_blocks=SEQS * MB + 1,
    )
    args = [
        jnp.asarray(x)
        for x in (case.q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
    ]
    cu = jnp.asarray(case.cu_q_lens)
    a = np.asarray(ours(*args, cu))
    b = np.asarray(theirs(*args, cu))
    assert not np.isnan(a).any() and not np.isnan(b).any()
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
