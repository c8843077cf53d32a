"""Stateful Hypothesis tests of the block pool and block tables against a Python model.

The same machine runs eagerly and with every function under ``jax.jit`` (jitted once at
module level with fixed array sizes, so examples do not recompile).
"""

from __future__ import annotations

import collections
import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedjax.memory import block_pool as bp
from pagedjax.memory import block_table as btm

NUM_BLOCKS = 14
BLOCK_SIZE = 4
MAX_SEQS = 4
MAX_BLOCKS = 5
MAX_NEW = 12
MAX_RAW = 4


class Ops:
    """The functions under test, eager or jitted."""

    def __init__(self, jit: bool):
        wrap = jax.jit if jit else (lambda f: f)
        self.append = wrap(
            functools.partial(btm.append_tokens, block_size=BLOCK_SIZE, max_new_tokens=MAX_NEW)
        )
        self.release = wrap(btm.release)
        self.fork = wrap(btm.fork)
        self.allocate = wrap(functools.partial(bp.allocate, max_n=MAX_RAW))
        self.free = wrap(bp.free)
        self.cow = wrap(bp.copy_on_write)
        self.unlink = wrap(bp.unlink_free)


EAGER = Ops(jit=False)
JITTED = Ops(jit=True)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PoolModel:
    """The plain-Python statement of the rules."""

    def __init__(self):
        self.free = collections.deque(range(1, NUM_BLOCKS))
        self.rc = [0] * NUM_BLOCKS
        self.tables: list[list[int]] = [[] for _ in range(MAX_SEQS)]
        self.lengths = [0] * MAX_SEQS
        self.raw: list[int] = []  # blocks held directly by the test (allocate/free rules)

    def take(self) -> int:
        b = self.free.popleft()
        self.rc[b] = 1
        return b

    def drop(self, b: int) -> None:
        self.rc[b] -= 1
        if self.rc[b] == 0:
            self.free.append(b)

    def append(self, s: int, n: int):
        length = self.lengths[s]
        held = ceil_div(length, BLOCK_SIZE)
        new_blocks = ceil_div(length + n, BLOCK_SIZE)
        need = new_blocks - held
        table = self.tables[s]
        last_shared = n > 0 and length % BLOCK_SIZE != 0 and self.rc[table[-1]] > 1
        if new_blocks > MAX_BLOCKS or need + last_shared > len(self.free):
            return False, None
        cow = None
        if last_shared:
            new = self.take()
            self.rc[table[-1]] -= 1
            cow = (table[-1], new)
            table[-1] = new
        table.extend(self.take() for _ in range(need))
        self.lengths[s] = length + n
        return True, cow


class PoolMachine(RuleBasedStateMachine):
    ops = EAGER

    def __init__(self):
        super().__init__()
        self.model = PoolModel()
        self.pool = bp.create_block_pool(NUM_BLOCKS)
        self.bt = btm.create_block_tables(MAX_SEQS, MAX_BLOCKS)

    @rule(s=st.integers(0, MAX_SEQS - 1), n=st.integers(0, MAX_NEW))
    def append(self, s, n):
        before = (self.pool, self.bt)
        self.pool, self.bt, slots, cow, ok = self.ops.append(self.pool, self.bt, s, n)
        want_ok, want_cow = self.model.append(s, n)
        assert bool(ok) == want_ok
        if not want_ok:
            assert_same(before, (self.pool, self.bt))
            assert np.all(np.asarray(slots) == btm.PAD_SLOT)
            return
        assert bool(cow.valid) == (want_cow is not None)
        if want_cow:
            assert (int(cow.src), int(cow.dst)) == want_cow
        # The slot mapping of the appended tokens.
        table, start = self.model.tables[s], self.model.lengths[s] - n
        expect = [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)
        ]
        assert list(np.asarray(slots)[:n]) == expect
        assert np.all(np.asarray(slots)[n:] == btm.PAD_SLOT)

    @rule(s=st.integers(0, MAX_SEQS - 1))
    def release(self, s):
        self.pool, self.bt = self.ops.release(self.pool, self.bt, s)
        for b in self.model.tables[s]:
            self.model.drop(b)
        self.model.tables[s] = []
        self.model.lengths[s] = 0

    @rule(p=st.integers(0, MAX_SEQS - 1), c=st.integers(0, MAX_SEQS - 1))
    def fork(self, p, c):
        before = (self.pool, self.bt)
        self.pool, self.bt, ok = self.ops.fork(self.pool, self.bt, p, c)
        want = p != c and not self.model.tables[c] and self.model.lengths[c] == 0
        assert bool(ok) == want
        if want:
            self.model.tables[c] = list(self.model.tables[p])
            self.model.lengths[c] = self.model.lengths[p]
            for b in self.model.tables[c]:
                self.model.rc[b] += 1
        else:
            assert_same(before, (self.pool, self.bt))

    @rule(n=st.integers(0, MAX_RAW), watermark=st.integers(0, 3))
    def allocate(self, n, watermark):
        before = self.pool
        self.pool, blocks, ok = self.ops.allocate(self.pool, n, min_free_after=watermark)
        want = n <= len(self.model.free) - watermark
        assert bool(ok) == want
        if want:
            got = [self.model.take() for _ in range(n)]
            assert list(np.asarray(blocks)[:n]) == got
            self.model.raw.extend(got)
        else:
            assert_same(before, self.pool)
        assert np.all(np.asarray(blocks)[n:] == bp.NULL_BLOCK) or not want

    @precondition(lambda self: self.model.raw)
    @rule(data=st.data())
    def free_raw(self, data):
        k = data.draw(st.integers(1, min(len(self.model.raw), MAX_RAW * 2)))
        chosen = self.model.raw[:k]
        self.model.raw = self.model.raw[k:]
        pad = [0] * (MAX_RAW * 2 - k) if k < MAX_RAW * 2 else []
        self.pool, ok = self.ops.free(self.pool, jnp.asarray((chosen + pad)[: MAX_RAW * 2]))
        assert bool(ok)
        for b in chosen:
            self.model.drop(b)

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def double_free_is_refused(self, b):
        # Freeing more references than a block has must be refused, changing nothing.
        if self.model.rc[b] > 0 or b == 0:
            return
        before = self.pool
        self.pool, ok = self.ops.free(self.pool, jnp.asarray([b] + [0] * (MAX_RAW * 2 - 1)))
        assert not bool(ok)
        assert_same(before, self.pool)

    @precondition(lambda self: self.model.raw)
    @rule(data=st.data())
    def copy_on_write_raw(self, data):
        # A raw block shared by a second reference is copied on write.
        b = data.draw(st.sampled_from(self.model.raw))
        shared = self.model.rc[b] > 1
        before = self.pool
        self.pool, target, copied, ok = self.ops.cow(self.pool, b)
        want_ok = not shared or len(self.model.free) > 0
        assert bool(ok) == want_ok
        if not want_ok:
            assert_same(before, self.pool)
            return
        assert bool(copied) == shared
        if shared:
            new = self.model.take()
            self.model.rc[b] -= 1
            assert int(target) == new
            self.model.raw.remove(b)
            self.model.raw.append(new)
        else:
            assert int(target) == b

    @precondition(lambda self: self.model.raw)
    @rule(data=st.data())
    def share_raw(self, data):
        b = data.draw(st.sampled_from(self.model.raw))
        self.pool, ok = bp.incref(self.pool, jnp.asarray([b, 0]))
        assert bool(ok)
        self.model.rc[b] += 1
        self.model.raw.append(b)

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def revive(self, b):
        before = self.pool
        self.pool, ok = self.ops.unlink(self.pool, b)
        want = b != 0 and self.model.rc[b] == 0
        assert bool(ok) == want
        if want:
            self.model.free.remove(b)
            self.model.rc[b] = 1
            self.model.raw.append(b)
        else:
            assert_same(before, self.pool)

    @invariant()
    def matches_model(self):
        m = self.model
        pool, bt = jax.device_get((self.pool, self.bt))  # one transfer per check
        rc = pool.refcount
        assert list(rc) == m.rc
        # A block's refcount equals the references to it (tables + raw holdings).
        refs = collections.Counter(b for t in m.tables for b in t) + collections.Counter(m.raw)
        assert all(rc[b] == refs.get(b, 0) for b in range(1, NUM_BLOCKS))
        assert bp.free_list(pool) == list(m.free)
        assert int(pool.num_free) == len(m.free)
        used = sum(1 for b in range(1, NUM_BLOCKS) if rc[b] > 0)
        assert used + int(pool.num_free) == NUM_BLOCKS - 1
        tables, lengths = bt.tables, bt.lengths
        for s in range(MAX_SEQS):
            assert lengths[s] == m.lengths[s]
            held = ceil_div(m.lengths[s], BLOCK_SIZE)
            assert len(m.tables[s]) == held
            assert list(tables[s, :held]) == m.tables[s]
            assert np.all(tables[s, held:] == bp.NULL_BLOCK)

    def teardown(self):
        # Releasing everything returns the pool to full.
        for s in range(MAX_SEQS):
            self.pool, self.bt = self.ops.release(self.pool, self.bt, s)
        raw = self.model.raw
        for i in range(0, len(raw), MAX_RAW * 2):
            chunk = raw[i : i + MAX_RAW * 2]
            self.pool, ok = self.ops.free(
                self.pool, jnp.asarray(chunk + [0] * (MAX_RAW * 2 - len(chunk)))
            )
            assert bool(ok)
        assert int(self.pool.num_free) == NUM_BLOCKS - 1
        assert np.all(np.asarray(self.pool.refcount) == 0)
        assert sorted(bp.free_list(self.pool)) == list(range(1, NUM_BLOCKS))


def assert_same(a, b):
    """Equal states; the free-list links' last entry is a documented trash slot."""

    def visible(x):
        if isinstance(x, bp.BlockPool):
            return x._replace(next_free=x.next_free[:-1], prev_free=x.prev_free[:-1])
        return x

    a = jax.tree.map(visible, a, is_leaf=lambda x: isinstance(x, bp.BlockPool))
    b = jax.tree.map(visible, b, is_leaf=lambda x: isinstance(x, bp.BlockPool))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class JittedPoolMachine(PoolMachine):
    ops = JITTED


# Eager dispatch of fori_loop / scan retraces per call (~0.5 s on CPU), so the eager run is
# a short cross-check that tracing changes nothing; the jitted machine carries the
# profile's example count (>= 200 in CI, >= 5,000 in the long profile).
TestPoolEager = PoolMachine.TestCase
TestPoolEager.settings = settings(
    settings.default, max_examples=min(settings.default.max_examples, 3), stateful_step_count=6
)
TestPoolJitted = JittedPoolMachine.TestCase
TestPoolJitted.settings = settings(settings.default, stateful_step_count=30)
