"""Ragged paged attention and the KV write against dense causal attention (numpy, fp64)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.attention import PAD_SLOT, ragged_paged_attention, write_kv

# Fixed padded sizes: one compilation per variant, Hypothesis only draws lengths.
T, S, BS, M, D = 24, 4, 4, 6, 8
NB = S * M + 1  # block 0 is the null block
VARIANTS = {
    # name: (num_q_heads, num_kv_heads, sliding_window, soft_cap)
    "gqa": (4, 2, None, None),
    "mqa_window": (4, 1, 5, None),
    "mha_softcap": (2, 2, None, 1.5),
    "gqa_window_softcap": (6, 2, 3, 2.0),
}


@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap", "tiling"))
def _rpa(q, k_pages, v_pages, bt, kv_lens, cu, sliding_window, soft_cap, tiling=None):
    kw = {} if tiling is None else dict(zip(("chunk_keys", "chunk_bytes"), tiling, strict=True))
    return ragged_paged_attention(
        q, k_pages, v_pages, bt, kv_lens, cu,
        sm_scale=D**-0.5, sliding_window=sliding_window, soft_cap=soft_cap, **kw,
    )  # fmt: skip


# The test shapes fit one chunk and one batch under the CPU tiling; the first two tilings
# make every item walk 1- or 2-page chunks (online softmax across chunks) in batches of 1-3
# items (several batches, items of different lengths sharing one); the third is the
# tiling used off CPU.
SMALL_TILINGS = {
    "1page_1item": (BS, 1),
    "2page_3items": (2 * BS, 3 * 2 * 2 * 2 * BS * D * 4),
    "whole_table_1batch": (M * BS, 1 << 40),  # the non-CPU default: one wide pass
}


def dense_attention(q, k, v, q_pos, sm_scale, window=None, soft_cap=None):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D], q_pos [Lq]; causal over key positions 0..Lk-1."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    kpos = np.arange(k.shape[0])
    mask = kpos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= kpos[None, :] > q_pos[:, None] - window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def make_case(rng, q_lens, kv_lens, hq, hkv, perm):
    """Random q/K/V for each sequence, written into a NaN-filled pool along permuted pages."""
    q = rng.standard_normal((T, hq, D))
    k_pages = np.full((NB, hkv, BS, D), np.nan)
    v_pages = np.full((NB, hkv, BS, D), np.nan)
    bt = np.zeros((S, M), np.int32)  # tails point at the (NaN) null block
    seqs, free = [], list(perm)
    for s in range(S):
        k = rng.standard_normal((kv_lens[s], hkv, D))
        v = rng.standard_normal((kv_lens[s], hkv, D))
        n_blocks = -(-kv_lens[s] // BS)
        bt[s, :n_blocks] = [free.pop() for _ in range(n_blocks)]
        for j in range(kv_lens[s]):
            k_pages[bt[s, j // BS], :, j % BS] = k[j]
            v_pages[bt[s, j // BS], :, j % BS] = v[j]
        seqs.append((k, v))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, k_pages, v_pages, bt, np.asarray(kv_lens, np.int32), cu, seqs


def expected_output(q, cu, kv_lens, seqs, hq, window, cap):
    out = np.zeros((T, hq, D))
    for s, (k, v) in enumerate(seqs):
        q_len = cu[s + 1] - cu[s]
        if q_len == 0:
            continue
        q_pos = kv_lens[s] - q_len + np.arange(q_len)
        out[cu[s] : cu[s + 1]] = dense_attention(
            q[cu[s] : cu[s + 1]], k, v, q_pos, D**-0.5, window, cap
        )
    return out


@st.composite
def ragged_lengths(draw):
    """q_len/kv_len per sequence with sum(q_len) <= T, q_len <= kv_len <= M * BS."""
    q_lens, kv_lens, budget = [], [], T
    for _ in range(S):
        q_len = draw(st.integers(0, min(budget, M * BS)))
        budget -= q_len
        kv_len = q_len if q_len == 0 else draw(st.integers(q_len, M * BS))
        q_lens.append(q_len)
        kv_lens.append(kv_len)
    perm = draw(st.permutations(range(1, NB)))
    seed = draw(st.integers(0, 2**31 - 1))
    return q_lens, kv_lens, perm, seed


@pytest.mark.parametrize("variant", list(VARIANTS))
@settings(max_examples=25, deadline=None)  # first example compiles
@given(case=ragged_lengths())
def test_matches_dense_attention_fp32(variant, case):
    hq, hkv, window, cap = VARIANTS[variant]
    q_lens, kv_lens, perm, seed = case
    rng = np.random.default_rng(seed)
    q, kp, vp, bt, kvl, cu, seqs = make_case(rng, q_lens, kv_lens, hq, hkv, perm)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got = _rpa(f32(q), f32(kp), f32(vp), jnp.asarray(bt), jnp.asarray(kvl), jnp.asarray(cu),
               sliding_window=window, soft_cap=cap)  # fmt: skip
    got = np.asarray(got)
    want = expected_output(q, cu, kvl, seqs, hq, window, cap)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert (got[cu[-1] :] == 0).all(), "padding tokens must give exactly 0"


@pytest.mark.parametrize("tiling", list(SMALL_TILINGS))
@settings(max_examples=20, deadline=None)
@given(case=ragged_lengths())
def test_small_tiles_match_dense_attention(tiling, case):
    hq, hkv, window, cap = VARIANTS["gqa_window_softcap"]
    q_lens, kv_lens, perm, seed = case
    rng = np.random.default_rng(seed)
    q, kp, vp, bt, kvl, cu, seqs = make_case(rng, q_lens, kv_lens, hq, hkv, perm)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got = _rpa(f32(q), f32(kp), f32(vp), jnp.asarray(bt), jnp.asarray(kvl), jnp.asarray(cu),
               sliding_window=window, soft_cap=cap, tiling=SMALL_TILINGS[tiling])  # fmt: skip
    got = np.asarray(got)
    np.testing.assert_allclose(got, expected_output(q, cu, kvl, seqs, hq, window, cap),
                               atol=2e-5, rtol=1e-5)  # fmt: skip
    assert (got[cu[-1] :] == 0).all(), "padding tokens must give exactly 0"


@settings(max_examples=15, deadline=None)
@given(case=ragged_lengths(), other_kv=st.lists(st.integers(1, M * BS), min_size=S, max_size=S))
def test_result_of_a_sequence_does_not_depend_on_its_neighbours(case, other_kv):
    """Sequence 0's rows are bitwise equal whatever the other sequences' lengths: a batch
    walks its longest item's chunks, and a fully masked chunk must leave the others exact."""
    q_lens, kv_lens, perm, seed = case
    if q_lens[0] == 0:
        q_lens, kv_lens = [1, *q_lens[1:]], [max(1, kv_lens[0]), *kv_lens[1:]]
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    outs = []
    pairs = zip(q_lens[1:], other_kv[1:], strict=True)
    for others in (kv_lens[1:], [0 if q == 0 else max(q, k) for q, k in pairs]):
        rng = np.random.default_rng(seed)
        q, kp, vp, bt, kvl, cu, _ = make_case(rng, q_lens, [kv_lens[0], *others], 4, 2, perm)
        got = _rpa(f32(q), f32(kp), f32(vp), jnp.asarray(bt), jnp.asarray(kvl),
                   jnp.asarray(cu), sliding_window=None, soft_cap=None,
                   tiling=SMALL_TILINGS["2page_3items"])  # fmt: skip
        outs.append(np.asarray(got)[: cu[1]])
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("variant", ["mha_softcap", "gqa_window_softcap"])
@settings(max_examples=15, deadline=None)
@given(case=ragged_lengths())
def test_decode_only_batch_matches_dense_attention(variant, case):
    """T = S, one query per sequence (an engine decode step): tiles of qb = 1 query."""
    hq, hkv, window, cap = VARIANTS[variant]
    _, kv_lens, perm, seed = case
    q_lens = [1 if k else 0 for k in kv_lens]
    rng = np.random.default_rng(seed)
    q, kp, vp, bt, kvl, cu, seqs = make_case(rng, q_lens, kv_lens, hq, hkv, perm)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got = _rpa(f32(q[:S]), f32(kp), f32(vp), jnp.asarray(bt), jnp.asarray(kvl),
               jnp.asarray(cu), sliding_window=window, soft_cap=cap,
               tiling=SMALL_TILINGS["2page_3items"])  # fmt: skip
    want = expected_output(q, cu, kvl, seqs, hq, window, cap)[:S]
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)


def test_bf16_inputs_accumulate_in_fp32():
    """bf16 pool and queries: error stays at bf16 rounding of inputs/output (<= 2e-2)."""
    rng = np.random.default_rng(0)
    q_lens, kv_lens = [9, 1, 1, 6], [20, 24, 5, 6]
    perm = list(rng.permutation(np.arange(1, NB)))
    q, kp, vp, bt, kvl, cu, seqs = make_case(rng, q_lens, kv_lens, 4, 2, perm)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    got = _rpa(bf(q), bf(kp), bf(vp), jnp.asarray(bt), jnp.asarray(kvl), jnp.asarray(cu),
               sliding_window=None, soft_cap=None)  # fmt: skip
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got.astype(jnp.float32))
    # Reference from the bf16-rounded inputs, so only accumulation/output rounding remains.
    r = lambda x: np.asarray(bf(x).astype(jnp.float32), np.float64)
    seqs = [(r(k), r(v)) for k, v in seqs]
    want = expected_output(r(q), cu, kvl, seqs, 4, None, None)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "q_lens,kv_lens",
    [([24, 0, 0, 0], [24, 0, 0, 0]), ([1, 1, 1, 1], [24, 1, 13, 4]), ([7, 0, 1, 0], [7, 0, 23, 0])],
    ids=["one_prefill", "all_decode", "mixed_with_padding_seqs"],
)
def test_extreme_batches(q_lens, kv_lens):
    rng = np.random.default_rng(1)
    perm = list(rng.permutation(np.arange(1, NB)))
    q, kp, vp, bt, kvl, cu, seqs = make_case(rng, q_lens, kv_lens, 4, 2, perm)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got = _rpa(f32(q), f32(kp), f32(vp), jnp.asarray(bt), jnp.asarray(kvl), jnp.asarray(cu),
               sliding_window=None, soft_cap=None)  # fmt: skip
    want = expected_output(q, cu, kvl, seqs, 4, None, None)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)


def test_write_kv_drops_pad_slots_and_leaves_null_block():
    nb, hkv, bs, d = 5, 2, 4, 3
    k_pages = jnp.zeros((nb, hkv, bs, d))
    v_pages = jnp.zeros((nb, hkv, bs, d))
    k = jnp.arange(4 * hkv * d, dtype=jnp.float32).reshape(4, hkv, d) + 1
    v = -k
    slots = jnp.array([2 * bs + 1, PAD_SLOT, 4 * bs + 3, nb * bs], jnp.int32)
    kp, vp = jax.jit(write_kv)(k_pages, v_pages, k, v, slots)
    expect = np.zeros((nb, hkv, bs, d))
    expect[2, :, 1] = k[0]
    expect[4, :, 3] = k[2]
    np.testing.assert_array_equal(np.asarray(kp), expect)
    np.testing.assert_array_equal(np.asarray(vp), -expect)
    assert not np.asarray(kp[0]).any(), "null block must stay untouched"


def test_bad_shapes_raise():
    q = jnp.zeros((4, 3, 8))
    pages = jnp.zeros((5, 2, 4, 8))
    bt, kvl, cu = jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention(q, pages, pages, bt, kvl, cu, sm_scale=1.0)
    with pytest.raises(ValueError, match="chunk_keys must be >= 1"):
        ragged_paged_attention(q[:, :2], pages, pages, bt, kvl, cu, sm_scale=1.0, chunk_keys=0)
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1"):
        ragged_paged_attention(q[:, :2], pages, pages, bt, kvl, cu, sm_scale=1.0, chunk_bytes=-1)
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention(jnp.zeros((4, 4, 8)), pages, pages, bt, kvl, cu[:2], sm_scale=1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(pages, pages, jnp.zeros((4, 2, 8)), jnp.zeros((4, 2, 8)), jnp.zeros(3, jnp.int32))
