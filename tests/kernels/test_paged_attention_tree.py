"""Draft-tree masks (``tree_mask``) in the Mosaic GPU kernel, in the GPU interpreter with
race detection, on poisoned cases (pallas_kernels.cases: NaN in every slot that holds no
token), against the dense reference with the same mask (itself checked against a numpy
oracle in tests/test_tree_attention.py); a chain mask against no mask, bit for bit; and the
masked kernel cross-lowered for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cases import ALL_BITS, make_case, tree_and_chain, tree_words
from pallas_kernels.paged_attention import default_interpret, ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.kernels.test_paged_attention import _check
from tests.kernels.test_paged_attention_8bit import LAYER, LAYERS, quantize_pool

D, BS = 64, 8


def _tree_batch(rng, seqs, hq=4, hkv=2, max_blocks=10, pad_tokens=2):
    """seqs: (prefix, parents list | q_len int). A poisoned case and its words (padding
    tokens and plain rows: all bits)."""
    q_lens = [len(t) if isinstance(t, list) else t for _, t in seqs]
    kv_lens = [p + n for (p, _), n in zip(seqs, q_lens, strict=True)]
    words = []
    for (_, t), n in zip(seqs, q_lens, strict=True):
        words += list(tree_words(t)) if isinstance(t, list) else [ALL_BITS] * n
    t = sum(q_lens) + pad_tokens
    words += [ALL_BITS] * pad_tokens
    need = sum(-(-n // BS) for n in kv_lens)
    case = make_case(
        rng, q_lens=q_lens, kv_lens=kv_lens, num_tokens=t, num_q_heads=hq, num_kv_heads=hkv,
        head_dim=D, block_size=BS, max_blocks=max_blocks, num_blocks=need + 3,
    )  # fmt: skip
    return case, np.asarray(words, np.uint32)


def _args(case):
    return (
        jnp.asarray(case.q, jnp.bfloat16),
        jnp.asarray(case.k_pages, jnp.bfloat16),
        jnp.asarray(case.v_pages, jnp.bfloat16),
        jnp.asarray(case.block_tables),
        jnp.asarray(case.kv_lens),
        jnp.asarray(case.cu_q_lens),
    )


def _kernel(args, tree_mask, **kw):
    tm = None if tree_mask is None else jnp.asarray(tree_mask)
    return ragged_paged_attention(
        *args, sm_scale=D**-0.5, tree_mask=tm, interpret=default_interpret(), **kw
    )


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_tree_rows_match_the_reference(seed):
    """Two random trees (one crossing a 64-key chunk), a prefill chunk and a decode row,
    padding tokens; split 2 ways (seed 1) so the masked rows also cross splits."""
    rng = np.random.default_rng(seed)
    parents = [[-1] + [int(rng.integers(-1, j)) for j in range(1, n)] for n in (9, 6)]
    seqs = [(57, parents[0]), (3, 5), (20, parents[1]), (40, 1)]
    case, words = _tree_batch(rng, seqs, hq=4, hkv=1)  # MQA: 4 heads per row group
    args = _args(case)
    out = _kernel(args, words, num_splits=1 + seed)
    ref = ragged_paged_attention_reference(*args, sm_scale=D**-0.5, tree_mask=jnp.asarray(words))
    _check(out, ref, int(case.cu_q_lens[-1]))
    causal = ragged_paged_attention_reference(*args, sm_scale=D**-0.5)
    assert not np.allclose(np.asarray(ref, np.float32), np.asarray(causal, np.float32))


def test_tree_verification_equals_chain_verification():
    """The accepted path of a 9-node tree, verified as a tree (siblings interleaved, NaN
    in every free slot), equals the same tokens verified as a causal chain without a
    mask (pallas_kernels.cases.tree_and_chain), within bf16 rounding."""
    rng = np.random.default_rng(5)
    tree, words, chain, path = tree_and_chain(
        rng, prefix=60, parents=[-1, 0, -1, 1, 2, 4, 3, 5, 6], leaf=8, num_q_heads=2,
        num_kv_heads=1, head_dim=D, block_size=BS,
    )  # fmt: skip
    got = np.asarray(_kernel(_args(tree), words, num_splits=1), np.float32)
    want = np.asarray(_kernel(_args(chain), None, num_splits=1), np.float32)
    assert np.isfinite(got).all()
    err = np.linalg.norm(got[path] - want[: len(path)]) / np.linalg.norm(want[: len(path)])
    assert err < 1e-2, err
    np.testing.assert_array_equal(got[-1], want[-1])  # the decode row beside it


@pytest.mark.slow  # ~8 s interpreted; the test above covers tree == chain in the tiers
def test_chain_mask_equals_no_mask_bit_for_bit():
    """A 40-node chain (past the 32 bits, across a 64-key chunk) after a 30-token prefix,
    beside a decode row: the same output as no mask, exactly."""
    rng = np.random.default_rng(2)
    case, words = _tree_batch(rng, [(30, list(range(-1, 39))), (9, 1)], hq=2, hkv=1)
    args = _args(case)
    with_mask = np.asarray(_kernel(args, words, num_splits=1), np.float32)
    without = np.asarray(_kernel(args, None, num_splits=1), np.float32)
    np.testing.assert_array_equal(with_mask, without)


@pytest.mark.slow  # ~7 s interpreted; the engine-facing 8-bit + tree check is the GPU run's
def test_tree_over_int8_pages_matches_the_reference():
    """The 8-bit path reads the same row words (int8 pages, per-slot scales, layer 1 of 2)."""
    rng = np.random.default_rng(3)
    case, words = _tree_batch(rng, [(12, [-1, 0, 0, 2, -1]), (4, 3)], hq=2, hkv=1)
    k8, ks, kd = quantize_pool(case.k_pages, "int8", np.ones((LAYERS, 1)))
    v8, vs, vd = quantize_pool(case.v_pages, "int8", np.ones((LAYERS, 1)))
    q, _, _, *meta = _args(case)
    tm = jnp.asarray(words)
    out = ragged_paged_attention(
        q, k8, v8, *meta, layer=jnp.int32(LAYER), sm_scale=D**-0.5, num_splits=1,
        interpret=default_interpret(), kv_format="int8", k_scale=ks, v_scale=vs, tree_mask=tm,
    )  # fmt: skip
    kd, vd = jnp.asarray(kd, jnp.float32), jnp.asarray(vd, jnp.float32)
    ref = ragged_paged_attention_reference(q, kd, vd, *meta, sm_scale=D**-0.5, tree_mask=tm)
    _check(out, ref, int(case.cu_q_lens[-1]))


def test_tree_mask_of_the_wrong_length_is_refused():
    rng = np.random.default_rng(4)
    case, words = _tree_batch(rng, [(3, [-1, 0])])
    with pytest.raises(ValueError, match="tree_mask must be uint32"):
        _kernel(_args(case), words[:1])


def test_masked_kernel_lowers_to_mosaic_gpu():
    """Cross-lowers for CUDA on the CPU with a tree mask (the row words' TMA and SMEM load,
    the shifts): layout inference and lowering run, PTX compilation needs the GPU."""
    hq, hkv, d, bs, m, t, s = 32, 8, 128, 16, 4, 24, 3
    f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=d**-0.5))
    spec = jax.ShapeDtypeStruct
    lowered = f.trace(
        spec((t, hq, d), jnp.bfloat16), spec((16, hkv, bs, d), jnp.bfloat16),
        spec((16, hkv, bs, d), jnp.bfloat16), spec((s, m), jnp.int32), spec((s,), jnp.int32),
        spec((s + 1,), jnp.int32), tree_mask=spec((t,), jnp.uint32),
    ).lower(lowering_platforms=("cuda",))  # fmt: skip
    assert "mosaic_gpu" in lowered.as_text()
