"""A block size chosen per request (pagedjax/simulator/request_blocks.py): the choice,
the accounting, all-or-nothing grants, and the simulator charging each row's blocks."""

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.scheduler import SchedulerLimits
from pagedjax.simulator import systems
from pagedjax.simulator.request_blocks import RequestBlockSizePolicy
from pagedjax.simulator.simulate import make_trace, simulate


def test_block_size_is_sqrt_2hc_rounded_to_a_power_of_two_within_bounds():
    p = RequestBlockSizePolicy(4, 4096, unit=8, max_block=256, overhead_tokens=3.68)
    # sqrt(2 * 3.68 * C): C=10 -> 8.6 -> 8; 64 -> 21.7 -> 16; 2048 -> 122.8 -> 128;
    # C=1 -> 2.7, clamped up to the unit; 1e6 -> 2713, clamped down to max_block.
    got = p.choose_block(jnp.array([10, 64, 2048, 1, 1_000_000]))
    assert got.tolist() == [8, 16, 128, 8, 256]
    free = RequestBlockSizePolicy(4, 4096, overhead_tokens=0.0)  # no kernel cost
    assert free.choose_block(jnp.array([2048])).tolist() == [8]  # smallest block


def _grow(p, st, ids, new, cap, mask=None):
    ids = jnp.array(ids, jnp.int32)
    n = len(ids)
    mask = jnp.ones(n, bool) if mask is None else jnp.array(mask)
    lens = jnp.array(new, jnp.int32)
    return p.grow(st, ids, lens, lens, jnp.array(cap, jnp.int32), mask, jnp.zeros(n, bool))


def test_each_request_holds_whole_blocks_of_its_own_size():
    p = RequestBlockSizePolicy(4, 64 * 8, unit=8, max_block=256)  # 64 units
    st = p.init_state()
    # Slot 0 declares 10 tokens (blocks of 8), slot 1 declares 2048 (blocks of 128).
    st, ok = _grow(p, st, [0, 1], [9, 9], [10, 2048])
    assert ok.tolist() == [True, True]
    assert st.block[:2].tolist() == [8, 128]
    assert st.held[:2].tolist() == [2, 16]  # ceil(9/8) * 1 unit; one 128-token block
    assert int(st.free) == 64 - 18
    # Growing within the last block takes nothing; past it, one more block.
    st, _ = _grow(p, st, [1], [128], [2048])
    assert int(st.held[1]) == 16
    st, _ = _grow(p, st, [1], [129], [2048])
    assert int(st.held[1]) == 32 and st.block[1] == 128
    use = p.usage(st, jnp.array([9, 129, 0, 0]), jnp.array([10, 2048, 0, 0]),
                  jnp.array([True, True, False, False]))  # fmt: skip
    assert float(use.token_slots) == 9 + 129
    # Reserved up to the final length within what is held; slot 0's block past its
    # final length (16 held, 10 final) is internal fragmentation.
    assert float(use.reserved_slots) == (10 - 9) + (256 - 129)
    assert float(use.internal_frag_slots) == 16 - 10
    assert float(use.total_slots) == 512
    st = p.release(st, jnp.array([0, 1, 2, 3]), jnp.array([True, True, False, False]))
    assert int(st.free) == 64 and st.held.tolist() == [0] * 4 and st.block.tolist() == [0] * 4


def test_grants_are_all_or_nothing_in_order_and_padding_touches_no_slot():
    p = RequestBlockSizePolicy(4, 32 * 8, unit=8, max_block=128)  # 32 units
    st = p.init_state()
    # Three requests of one 128-token block (16 units) each: the third does not fit and
    # changes nothing; a masked-out padding row aliasing slot 0 is ignored.
    st, ok = _grow(p, st, [0, 1, 2, 0], [5, 5, 5, 5], [2048] * 4, [True, True, True, False])
    assert ok.tolist() == [True, True, False, True]
    assert st.held.tolist() == [16, 16, 0, 0] and int(st.free) == 0
    assert st.block.tolist() == [128, 128, 0, 0]
    assert p.row_block_sizes(st, jnp.array([1, -1, 2])).tolist() == [128, 1, 1]


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="power of two"):
        RequestBlockSizePolicy(4, 1024, unit=12)
    with pytest.raises(ValueError, match="max_block"):
        RequestBlockSizePolicy(4, 1024, unit=16, max_block=8)
    with pytest.raises(ValueError, match="watermark"):
        RequestBlockSizePolicy(4, 1024, watermark_frac=1.0)


def test_one_block_size_for_all_equals_the_paged_pool_in_the_simulator():
    """unit = max_block = 16: every request gets blocks of 16, so the simulated run,
    per-row block costs included, must equal the paged pool's at block 16."""
    cost = systems.make_cost_model("A100-40GB", "opt-13b", block_cost="kernel")
    cfg = SchedulerLimits(max_seqs=16, max_num_batched_tokens=512, max_num_seqs=16,
                          max_model_len=256, mode="paper")  # fmt: skip
    rng = np.random.default_rng(0)
    arr = np.sort(rng.uniform(0, 0.5, 40))
    tr = make_trace(arr, rng.integers(4, 120, 40), rng.integers(2, 120, 40), pad_to=64)
    paged = simulate(PagedPolicy(1024 // 16 + 1, 16, 16, 16), cfg, cost, tr)
    per_req = simulate(RequestBlockSizePolicy(16, 1024, unit=16, max_block=16), cfg, cost, tr)
    np.testing.assert_allclose(np.asarray(per_req.finish_time)[:40],
                               np.asarray(paged.finish_time)[:40], rtol=1e-6)  # fmt: skip
    assert int(per_req.num_preemptions.sum()) == int(paged.num_preemptions.sum()) > 0
    # Free choice: blocks of 8-256 by each request's cap, a different run.
    free = simulate(RequestBlockSizePolicy(16, 1024, unit=8, max_block=256), cfg, cost, tr)
    assert not np.allclose(np.asarray(free.finish_time)[:40], np.asarray(paged.finish_time)[:40])


def test_the_ablation_is_a_named_system():
    assert "paged_block_per_request" in systems.ABLATIONS
    policy, _ = systems.build_system("paged_block_per_request", kv_slots=15728, watermark=0.01)
    assert isinstance(policy, RequestBlockSizePolicy)
    assert (policy.unit, policy.max_block, policy.num_units) == (8, 256, 15728 // 8)
    assert policy.overhead_tokens == systems.BLOCK_COSTS["kernel"]["block_overhead_tokens"]
