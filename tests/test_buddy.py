"""The buddy allocator against a plain-Python buddy model (free lists per order)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedjax.memory.buddy import (
    buddy_alloc,
    buddy_block_size,
    buddy_free,
    buddy_free_blocks,
    buddy_init,
    buddy_top_blocks,
)

# Jitted once at module level; each (capacity, min_block) pair below compiles once.
alloc_jit = jax.jit(buddy_alloc)
free_jit = jax.jit(buddy_free)

# (capacity, min_block): non-powers of two, a partial trailing unit, a power of two, tiny.
POOLS = [(100, 1), (98, 4), (64, 2), (13, 1)]


class BuddyModel:
    """Reference buddy allocator: per-order free sets in units, smallest order first,
    lowest address first, split keeping the left half, merge with a free buddy."""

    def __init__(self, capacity: int, min_block: int):
        self.mb = min_block
        self.free: dict[int, set[int]] = {}
        for off, size in buddy_top_blocks(capacity, min_block):
            self.free.setdefault((size // min_block).bit_length() - 1, set()).add(off // min_block)

    def order(self, size: int) -> int:
        units = max(-(-size // self.mb), 1)
        return (units - 1).bit_length()

    def alloc(self, size: int) -> int | None:
        j = self.order(size)
        orders = [o for o, s in self.free.items() if s and o >= j]
        if size < 1 or not orders:
            return None
        o = min(orders)
        off = min(self.free[o])
        self.free[o].remove(off)
        while o > j:
            o -= 1
            self.free.setdefault(o, set()).add(off + (1 << o))
        return off * self.mb

    def release(self, offset: int, size: int) -> None:
        o, off = self.order(size), offset // self.mb
        while (off ^ (1 << o)) in self.free.get(o, set()):
            self.free[o].remove(off ^ (1 << o))
            off = min(off, off ^ (1 << o))
            o += 1
        self.free.setdefault(o, set()).add(off)

    def blocks(self) -> list[tuple[int, int]]:
        return sorted((u * self.mb, (1 << o) * self.mb) for o, s in self.free.items() for u in s)


class BuddyMachine(RuleBasedStateMachine):
    alloc_fn = staticmethod(alloc_jit)
    free_fn = staticmethod(free_jit)

    @initialize(pool=st.sampled_from(POOLS))
    def setup(self, pool):
        self.capacity, self.mb = pool
        self.state = buddy_init(self.capacity, self.mb)
        self.model = BuddyModel(self.capacity, self.mb)
        self.live: dict[int, tuple[int, int]] = {}  # offset -> (requested, block) slots

    @rule(size=st.integers(1, 140))
    def alloc(self, size):
        before = self.state
        self.state, offset, ok = self.alloc_fn(self.state, size)
        offset, ok = int(offset), bool(ok)
        want = self.model.alloc(size)
        assert ok == (want is not None)
        if not ok:
            assert offset == -1
            np.testing.assert_array_equal(np.asarray(self.state.avail), np.asarray(before.avail))
            assert int(self.state.free_slots) == int(before.free_slots)
            return
        block = self.mb << self.model.order(size)
        assert block >= size and block % self.mb == 0 and (block // self.mb).bit_count() == 1
        assert offset == want
        assert offset % block == 0, "chunks are aligned to their size"
        assert 0 <= offset and offset + block <= (self.capacity // self.mb) * self.mb
        for o, (_, b) in self.live.items():
            assert offset + block <= o or o + b <= offset, "chunks overlap"
        self.live[offset] = (size, block)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data):
        offset = data.draw(st.sampled_from(sorted(self.live)))
        size = self.live[offset][0]  # the requested size: free rounds it the same way
        self.state = self.free_fn(self.state, offset, size)
        self.model.release(offset, size)
        del self.live[offset]

    @precondition(lambda self: bool(self.live))
    @rule()
    def free_all(self):
        for offset, (_, block) in list(self.live.items()):
            self.state = self.free_fn(self.state, offset, block)
            self.model.release(offset, block)
        self.live.clear()
        assert buddy_free_blocks(self.state) == buddy_top_blocks(self.capacity, self.mb)

    @invariant()
    def matches_model(self):
        if not hasattr(self, "state"):
            return
        blocks = buddy_free_blocks(self.state)
        assert blocks == self.model.blocks()
        assert int(self.state.free_slots) == sum(b for _, b in blocks)
        if not self.live:  # everything merged back into the maximal top-level blocks
            assert blocks == buddy_top_blocks(self.capacity, self.mb)


class EagerBuddyMachine(BuddyMachine):
    alloc_fn = staticmethod(buddy_alloc)
    free_fn = staticmethod(buddy_free)


TestBuddyJit = BuddyMachine.TestCase
TestBuddyJit.settings = settings(settings.default, stateful_step_count=15)
TestBuddyEager = EagerBuddyMachine.TestCase
# Eager calls dispatch op by op (~20 ms each on shared CPUs): shorter runs, same count.
TestBuddyEager.settings = settings(settings.default, stateful_step_count=3)


def test_opt13b_orca_max_fits_seven():
    """Paper invariant: 12 GiB / 800 KiB = 15,728 slots holds exactly 7 chunks of 2048."""
    capacity = (12 * 2**30) // 819200
    assert capacity == 15728
    state = buddy_init(capacity)
    offsets = []
    for _ in range(7):
        state, offset, ok = alloc_jit(state, 2048)
        assert bool(ok)
        offsets.append(int(offset))
    assert sorted(offsets) == [i * 2048 for i in range(7)]
    before = state
    state, offset, ok = alloc_jit(state, 2048)
    assert not bool(ok) and int(offset) == -1
    np.testing.assert_array_equal(np.asarray(state.avail), np.asarray(before.avail))
    free_frac = int(state.free_slots) / capacity
    assert free_frac == pytest.approx((15728 - 7 * 2048) / 15728)
    assert round(100 * free_frac, 2) == 8.85


def test_rounding_and_min_block():
    state = buddy_init(1000, min_block=16)
    assert [int(buddy_block_size(state, s)) for s in (1, 16, 17, 100, 513)] == [
        16,
        16,
        32,
        128,
        1024,
    ]
    state, offset, ok = alloc_jit(state, 1024)  # 62 units: the largest block is 32 units
    assert not bool(ok)
    state, offset, ok = alloc_jit(state, 0)
    assert not bool(ok)


@pytest.mark.parametrize(
    "kwargs", [dict(capacity=0), dict(capacity=10, min_block=3), dict(capacity=2, min_block=4)]
)
def test_init_rejects_bad_input(kwargs):
    with pytest.raises(ValueError, match="capacity|min_block"):
        buddy_init(**kwargs)


def test_alloc_rejects_nonpositive_python_size():
    with pytest.raises(ValueError, match="size"):
        buddy_alloc(buddy_init(8), 0)


def test_vmap_over_pools_matches_single_calls():
    base = buddy_init(100)
    used, _, _ = alloc_jit(base, 4)
    stacked = jax.tree.map(lambda a, b: np.stack([a, b]), used, base)
    states, offsets, oks = jax.vmap(buddy_alloc)(stacked, np.array([4, 40]))
    for i, (state, size) in enumerate([(used, 4), (base, 40)]):
        one, offset, ok = alloc_jit(state, size)
        assert int(offsets[i]) == int(offset) and bool(oks[i]) == bool(ok)
        np.testing.assert_array_equal(np.asarray(states.avail[i]), np.asarray(one.avail))
