"""Draft-tree masks (``tree_mask``) in the Triton kernel, in Triton's interpreter (the
worker of conftest.py, torch CPU tensors), on poisoned cases against the dense reference
with the same mask (itself checked against a numpy oracle in tests/test_tree_attention.py),
and tree verification against chain verification of the same accepted tokens."""

from __future__ import annotations

import pytest

from tests.triton_attention.test_triton_interpreted import _check, case

# Two trees (9 and 6 nodes) beside a prefill chunk, a decode row and a padding token;
# tiles of 16 rows and 16-key steps, so the trees cross steps (key 32) and tiles.
TREE_9 = (-1, 0, -1, 1, 2, 4, 3, 5, 6)
TREE_6 = (-1, -1, 0, 1, 3, 2)
TREES = dict(trees=[TREE_9, None, TREE_6, None], block_m=16, tile_n=16, max_blocks=3,
             wild_tail=True)  # fmt: skip


def test_tree_rows_match_the_reference(interp_worker):
    spec = case([9, 4, 6, 1], [41, 20, 22, 17], 21, **TREES)
    _check(interp_worker.run("case", spec), "float16")


@pytest.mark.slow  # ~5 s interpreted; the fp16 case and the binding case stay in the tiers
def test_tree_rows_over_int8_pages_match_the_reference(interp_worker):
    spec = case([9, 4, 6, 1], [41, 20, 22, 17], 21, kv_format="int8", num_splits=2, **TREES)
    _check(interp_worker.run("case", spec), "float16")


def test_tree_verification_equals_chain_verification(interp_worker):
    """The accepted path of a 9-node tree (its other branches interleaved, NaN in every
    free slot) against the same tokens verified as a causal chain with no mask: fp32,
    GQA 2, pages of 8, 16-key steps."""
    params = dict(prefix=40, parents=list(TREE_9), leaf=8, num_q_heads=4, num_kv_heads=2,
                  head_dim=32, block_size=8, dtype="float32", block_m=16, tile_n=16)  # fmt: skip
    r = interp_worker.run("tree_chain", params)
    assert r["finite"], r
    assert r["rel_err"] < 1e-5, r
    assert r["decode_equal"], r


def test_binding_passes_the_tree_mask(interp_worker):
    """jax_binding hands jax-triton the words (int32 bits, after cu_q_lens) and USE_TREE;
    the numbers come back equal to the reference (stand-in jax-triton, interpreted)."""
    spec = case([6, 1], [26, 33], 8, trees=[TREE_6, None], block_m=16, tile_n=16,
                max_blocks=3)  # fmt: skip
    r = interp_worker.run("binding", spec)
    _check(r, "float16")
    call = r["calls"][0]
    assert call["constexprs"]["USE_TREE"] is True
    assert call["array_dtypes"][9] == "int32" and call["array_shapes"][9] == [8]
