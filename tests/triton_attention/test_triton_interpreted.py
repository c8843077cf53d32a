"""Triton paged attention in Triton's interpreter (CPU, torch tensors) against the jnp
reference, on poisoned cases: every slot that holds no token, the null block, the pages
behind garbage table tails and every other layer of the stacked pool are NaN; in the
"wild_tail" cases the tails hold block ids far outside the pool (2**30 + j, -j). Output must be
NaN-free, padding tokens exactly 0, error within fp16 / fp32 rounding. bf16 is left to the
GPU check: the interpreter's tl.dot on bf16 is not trustworthy."""

from __future__ import annotations

import numpy as np
import pytest

TOL = {"float16": 2e-3, "float32": 1e-5}


def _check(result: dict, dtype: str) -> None:
    assert result["finite"], "NaN or inf leaked from poisoned pages"
    assert result["padding_max_abs"] == 0.0, "padding tokens must be exactly 0"
    assert result["rel_err"] < TOL[dtype], result


def case(q_lens, kv_lens, num_tokens, **kw):
    return dict(q_lens=list(q_lens), kv_lens=list(kv_lens), num_tokens=num_tokens, **kw)


CASES = [
    # decode: lengths 1 / bs-1 / bs / bs+1, a padding token, GQA 4
    pytest.param(case([1, 1, 1, 1], [1, 15, 16, 17], 5, num_q_heads=8, num_kv_heads=2,
                      block_size=16, max_blocks=3, wild_tail=True), id="decode-gqa4-b16-edges"),
    # MQA, pages of 8, a padding sequence (kv_len 0), 2 splits, fp32, layer 0 of 3
    pytest.param(case([1, 1, 0, 1], [7, 9, 0, 64], 3, num_q_heads=4, num_kv_heads=1,
                      block_size=8, max_blocks=8, num_splits=2, dtype="float32",
                      num_layers=3, layer=0), id="decode-mqa-b8-pad-split2-fp32"),
    # MHA, pages of 128 (> the 64-key step)
    pytest.param(case([1, 1], [129, 127], 2, num_q_heads=2, num_kv_heads=2,
                      block_size=128, max_blocks=2), id="decode-mha-b128"),
    # long context, flash-decoding splits (planned automatically), pages of 32
    pytest.param(case([1], [2000], 1, num_q_heads=4, num_kv_heads=2, head_dim=64,
                      block_size=32, max_blocks=64), id="decode-long2000-auto-splits"),
    pytest.param(case([1, 1], [50, 3], 2, sliding_window=20, soft_cap=5.0, num_splits=3,
                      block_m=16, tile_n=16), id="decode-window-softcap-split3"),
    # ragged: prefill + decode + padding sequence + padding tokens
    pytest.param(case([5, 1, 3, 0], [40, 1, 64, 0], 12, block_size=16, max_blocks=5,
                      wild_tail=True), id="mixed-pad-tokens"),
    # chunked prefill, several query tiles (block_m 16 / GQA 4 = 4 tokens per tile)
    pytest.param(case([20], [70], 20, num_q_heads=8, num_kv_heads=2, block_size=8,
                      max_blocks=9, block_m=16, tile_n=16), id="chunked-prefill-b8-tiles"),
    pytest.param(case([33, 1], [33, 32], 40, num_q_heads=2, num_kv_heads=2, block_size=32,
                      max_blocks=2, dtype="float32"), id="prefill-mha-fp32"),
    pytest.param(case([17, 2], [90, 2], 19, num_q_heads=4, num_kv_heads=1, max_blocks=6,
                      sliding_window=24, block_m=16, tile_n=16), id="window-prefill-mqa"),
    # the window as a run-time scalar (the layer loop's per-layer windows): 24, and 0 = none
    pytest.param(case([17, 2], [90, 2], 19, num_q_heads=4, num_kv_heads=1, max_blocks=6,
                      sliding_window=24, dynamic_window=True, block_m=16, tile_n=16,
                      num_splits=2), id="runtime-window-prefill-split2"),
    pytest.param(case([3, 1], [50, 20], 4, max_blocks=4, dynamic_window=True),
                 id="runtime-window-0-is-none"),
    # head_dim 48 (padded to 64 inside), pages of 64 cut into 16-key steps, GQA 3 (pad 4)
    pytest.param(case([3, 1], [70, 64], 4, num_q_heads=6, num_kv_heads=2, head_dim=48,
                      block_size=64, max_blocks=2, tile_n=16, block_m=16),
                 id="d48-b64-step16-gqa3"),
]  # fmt: skip


@pytest.mark.parametrize("spec", CASES)
def test_matches_reference(interp_worker, spec):
    """Each case on layer 1 of a 2-layer pool unless it says otherwise."""
    _check(interp_worker.run("case", spec), spec.get("dtype", "float16"))


@pytest.mark.parametrize("seed", [0, 1])
def test_random_lengths(interp_worker, seed):
    """Random q / kv lengths on fixed shapes, random page permutations, 2 splits."""
    rng = np.random.default_rng(100 + seed)
    bs, mb, num_seqs = 16, 6, 3
    kv_lens = [int(x) for x in rng.integers(0, mb * bs + 1, num_seqs)]
    q_lens = [int(rng.integers(1, min(n, 8) + 1)) if n else 0 for n in kv_lens]
    spec = case(q_lens, kv_lens, 16, block_size=bs, max_blocks=mb, num_splits=2,
                block_m=16, tile_n=16, seed=seed, wild_tail=True)  # fmt: skip
    _check(interp_worker.run("case", spec), "float16")


SWEEP = [
    pytest.param(case([2, 1, 1], [bs - 1, bs + 1, 3 * bs], 5, num_q_heads=hq, num_kv_heads=hkv,
                      block_size=bs, max_blocks=3, dtype=dt, num_splits=splits),
                 id=f"b{bs}-h{hq}x{hkv}-{dt}-s{splits}")
    for bs in (8, 16, 32, 64, 128)
    for hq, hkv in ((8, 2), (4, 1), (4, 4))
    for dt in ("float16", "float32")
    for splits in (1, 2)
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("spec", SWEEP)
def test_sweep_block_sizes_heads_dtypes(interp_worker, spec):
    _check(interp_worker.run("case", spec), spec["dtype"])
