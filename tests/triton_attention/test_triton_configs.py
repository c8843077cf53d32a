"""Launch plans of the Triton kernels (pure Python): tables, grid, splits, refusals."""

from __future__ import annotations

import pytest

from pallas_kernels.triton import configs


def test_arch_table_lookup():
    assert configs.arch_config(80).name.startswith("sm_80")
    assert configs.arch_config(87).name.startswith("sm_86")  # nearest generation below
    assert configs.arch_config(89).name.startswith("sm_89")
    assert configs.arch_config(120).name.startswith("sm_90")
    with pytest.raises(ValueError, match="sm_80 or newer"):
        configs.arch_config(75)


def _plan(**kw):
    base = dict(num_tokens=1, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                num_seqs=1, max_blocks=2048, dtype="bfloat16", sm_scale=0.1, capability=90)
    return configs.plan_launch(**{**base, **kw})  # fmt: skip


def test_long_context_decode_is_split_to_fill_the_gpu():
    p = _plan()  # batch 1, 32k context, 8 KV heads on 132 SMs
    assert p.num_splits == 32 and p.merge_grid == (1, 32)  # capped at MAX_SPLITS
    assert p.grid == (1 // 4 + 1, 8, 32)
    short = _plan(max_blocks=16)  # 256 keys = 4 steps of 64: one split
    assert short.num_splits == 1 and short.merge_grid is None
    big_batch = _plan(num_tokens=256, num_seqs=256, max_blocks=64)  # 2048 programs
    assert big_batch.num_splits == 1


def test_prefill_tiles_stack_the_gqa_group():
    p = _plan(num_tokens=4096, num_seqs=1)
    c = p.attention_constexprs
    assert (c["GROUP"], c["GROUP_PAD"], c["BLOCK_Q"]) == (4, 4, 32)  # 128 rows on sm_90
    assert p.grid == (4096 // 32 + 1, 8, 1) and p.num_warps == 8
    odd = _plan(num_tokens=64, num_seqs=1, num_q_heads=24, capability=80)  # group 3 -> 4
    assert odd.attention_constexprs["GROUP_PAD"] == 4 and odd.attention_constexprs["BLOCK_Q"] == 16
    wide = _plan(num_tokens=1, num_q_heads=64, num_kv_heads=1)  # group 64 > 16 decode rows
    assert wide.attention_constexprs["BLOCK_Q"] == 1


def test_fp32_halves_the_key_step_and_uses_ieee_dots():
    p = _plan(dtype="float32", capability=80)
    assert p.attention_constexprs["TILE_N"] == 32 and p.num_stages == 2
    assert p.attention_constexprs["DOT_PRECISION"] == "ieee"
    assert _plan().attention_constexprs["DOT_PRECISION"] == "tf32"


def test_window_bounds_the_split_count():
    assert _plan(sliding_window=512).num_splits == 2  # ~8 steps of 64: >= 4 per split


def test_refusals():
    with pytest.raises(ValueError, match="sliding_window"):
        _plan(sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        _plan(soft_cap=0.0)
    with pytest.raises(ValueError, match="num_splits"):
        _plan(num_splits=0)
    with pytest.raises(ValueError, match="tile_n"):
        _plan(tile=configs.TileConfig(16, 24, 4, 2))
    with pytest.raises(ValueError, match="contiguous"):
        configs.attention_scalars((8, 1, 2), (1, 1, 1, 1, 1), (4, 1), (0, 8, 1), (0, 0), 1, 4)
