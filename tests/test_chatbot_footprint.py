"""Fig. 17's memory arithmetic (experiments/chatbot.py footprint_ratios), by hand."""

import numpy as np
import pytest

from experiments.chatbot import footprint_ratios


def test_footprint_ratio_is_the_buddy_chunks_over_the_growing_paged_sequence():
    # One request: prompt 1024, output 100, block 16. Paged holds 1024 + t (+ 7.5 slack)
    # slots at decode step t = 1..100; every Orca variant's chunk is pow2(R) = 2048.
    got = footprint_ratios(np.array([1024]), np.array([100]), 16, 2048)
    paged = 1024 * 100 + 100 * 101 / 2 + 100 * 7.5
    assert got == pytest.approx({k: 2048 * 100 / paged for k in got})


def test_short_prompts_separate_the_variants_and_max_reserves_most():
    # Prompt 100, output 100: Max 2048, Pow2 pow2(100 + 128) = 256, Oracle pow2(200) = 256;
    # output 20: Pow2 pow2(132) = 256, Oracle pow2(120) = 128.
    got = footprint_ratios(np.array([100, 100]), np.array([100, 20]), 16, 2048)
    paged = sum(100 * o + o * (o + 1) / 2 + o * 7.5 for o in (100, 20))
    assert got["orca_max"] == pytest.approx(2048 * 120 / paged)
    assert got["orca_pow2"] == pytest.approx((256 * 100 + 256 * 20) / paged)
    assert got["orca_oracle"] == pytest.approx((256 * 100 + 128 * 20) / paged)
