"""Batched block-table appends and the paged memory policy."""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given

from pagedjax.memory import block_pool as bp
from pagedjax.memory import block_table as btm
from pagedjax.memory.paged_policy import PagedPolicy

NUM_BLOCKS, BS, SEQS, MAXB, MAXNEW = 12, 4, 6, 6, 24

batched = jax.jit(
    functools.partial(btm.append_tokens_batched, block_size=BS, max_new_tokens=MAXNEW)
)
single = jax.jit(functools.partial(btm.append_tokens, block_size=BS, max_new_tokens=MAXNEW))
fork = jax.jit(btm.fork)
release_b = jax.jit(btm.release_batched)
release_one = jax.jit(btm.release)


@given(
    order=st.permutations(range(SEQS)),
    ns=st.lists(st.integers(0, MAXNEW), min_size=SEQS, max_size=SEQS),
    mask=st.lists(st.booleans(), min_size=SEQS, max_size=SEQS),
    prefill=st.lists(st.integers(0, 9), min_size=SEQS, max_size=SEQS),
    forks=st.lists(st.tuples(st.integers(0, SEQS - 1), st.integers(0, SEQS - 1)), max_size=4),
)
def test_batched_append_serves_in_priority_order(order, ns, mask, prefill, forks):
    """The batched form equals single appends in array order, including copy-on-write of
    forked (shared) last blocks; refused entries change nothing, and later (smaller)
    requests may still be served."""
    pool = bp.create_block_pool(NUM_BLOCKS)
    bt = btm.create_block_tables(SEQS, MAXB)
    for s, n in enumerate(prefill):
        if all(s != c for _, c in forks):  # fork targets must start empty
            pool, bt, *_ = single(pool, bt, s, n)
    for p, c in forks:
        pool, bt, _ = fork(pool, bt, p, c)
    ids = jnp.asarray(order, jnp.int32)
    pool_b, bt_b, cow_b, ok_b = batched(pool, bt, ids, jnp.asarray(ns), jnp.asarray(mask))
    want_ok, want_cow = [], []
    for s, n, m in zip(order, ns, mask, strict=True):
        if not m:
            want_ok.append(True)
            want_cow.append((False, 0, 0))
            continue
        pool, bt, _, cow, ok = single(pool, bt, s, n)
        want_ok.append(bool(ok))
        want_cow.append((True, int(cow.src), int(cow.dst)) if cow.valid else (False, 0, 0))
    assert list(np.asarray(ok_b)) == want_ok
    got_cow = [
        (bool(v), int(a), int(b)) if v else (False, 0, 0)
        for v, a, b in zip(cow_b.valid, cow_b.src, cow_b.dst, strict=True)
    ]
    assert got_cow == want_cow
    assert_same_state((pool, bt), (pool_b, bt_b))
    # Batched release equals releasing one by one, in order (free-list order included).
    release_mask = jnp.asarray(mask)
    pool_r, bt_r = release_b(pool_b, bt_b, ids, release_mask)
    for s, m in zip(order, mask, strict=True):
        if m:
            pool_b, bt_b = release_one(pool_b, bt_b, s)
    assert_same_state((pool_b, bt_b), (pool_r, bt_r))


def assert_same_state(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim == 1 and x.shape[0] == NUM_BLOCKS + 2:  # free-list links: last = trash
            x, y = x[:-1], y[:-1]
        np.testing.assert_array_equal(x, y)


POLICY = PagedPolicy(num_blocks=NUM_BLOCKS, block_size=BS, max_seqs=SEQS, max_blocks_per_seq=MAXB)
grow = jax.jit(POLICY.grow)
usage = jax.jit(POLICY.usage)
release = jax.jit(POLICY.release)


@given(
    lens=st.lists(st.integers(0, 20), min_size=SEQS, max_size=SEQS),
    extra=st.lists(st.integers(0, 30), min_size=SEQS, max_size=SEQS),
)
def test_paged_usage_categories(lens, extra):
    """The four categories sum to capacity; a paged sequence wastes < 1 block."""
    state = POLICY.init_state()
    ids = jnp.arange(SEQS, dtype=jnp.int32)
    lens_a = jnp.asarray(lens, jnp.int32)
    final = lens_a + jnp.asarray(extra, jnp.int32)
    true_mask = jnp.ones(SEQS, bool)
    state, ok = grow(state, ids, lens_a, final, final, true_mask, jnp.zeros(SEQS, bool))
    live = np.asarray(ok) & (np.asarray(lens_a) > 0)
    held = np.asarray(state.tables.lengths)
    u = usage(state, jnp.asarray(held), final, jnp.asarray(live))
    parts = np.array(
        [u.token_slots, u.reserved_slots, u.internal_frag_slots, u.external_free_slots]
    )
    assert np.all(parts >= 0)
    np.testing.assert_allclose(parts.sum(), float(u.total_slots))
    assert float(u.total_slots) == (NUM_BLOCKS - 1) * BS
    waste = float(u.reserved_slots) + float(u.internal_frag_slots)
    assert waste <= (BS - 1) * live.sum()
    assert float(u.token_slots) == held[live].sum()
    # Releasing everything returns the pool to full.
    state = release(state, ids, true_mask)
    assert int(state.pool.num_free) == NUM_BLOCKS - 1


def test_watermark_applies_to_admissions_only():
    policy = PagedPolicy(
        num_blocks=11, block_size=4, max_seqs=2, max_blocks_per_seq=10, watermark_frac=0.2
    )  # 2 blocks of watermark
    state = policy.init_state()
    one = jnp.ones(1, bool)
    # 10 usable blocks free; an admission needing 9 would leave 1 < 2: refused.
    state, ok = policy.grow(
        state, jnp.array([0]), jnp.array([36]), jnp.array([36]), jnp.array([36]), one, one
    )
    assert not bool(ok[0])
    # The same growth without the watermark (a running sequence) is served.
    state, ok = policy.grow(
        state, jnp.array([0]), jnp.array([36]), jnp.array([36]), jnp.array([36]), one, ~one
    )
    assert bool(ok[0]) and int(state.pool.num_free) == 1


def test_copies_from_several_grows_in_one_step_are_all_pending():
    """The scheduler grows running sequences and admissions in separate calls; copies
    requested by both must reach the engine, and begin_step clears them."""
    policy = PagedPolicy(num_blocks=12, block_size=4, max_seqs=4, max_blocks_per_seq=4)
    state = policy.init_state()
    one = jnp.ones(1, bool)
    n = lambda v: jnp.asarray([v], jnp.int32)  # noqa: E731
    state, _ = policy.grow(state, n(0), n(5), n(9), n(9), one, ~one)
    state, _ = policy.grow(state, n(2), n(6), n(9), n(9), one, ~one)
    pool, tables, _ = fork(state.pool, state.tables, 0, 1)
    pool, tables, _ = fork(pool, tables, 2, 3)
    state = policy.begin_step(state._replace(pool=pool, tables=tables))
    shared0, shared2 = int(tables.tables[0, 1]), int(tables.tables[2, 1])
    state, ok = policy.grow(state, n(1), n(6), n(9), n(9), one, ~one)  # e.g. running
    state, ok2 = policy.grow(state, n(3), n(7), n(9), n(9), one, ~one)  # e.g. admission
    assert bool(ok[0]) and bool(ok2[0])
    cow = jax.device_get(state.last_cow)
    assert list(cow.valid) == [False, True, False, True]
    assert (cow.src[1], cow.src[3]) == (shared0, shared2)
    assert cow.dst[1] == state.tables.tables[1, 1] and cow.dst[3] == state.tables.tables[3, 1]
    assert not np.asarray(policy.begin_step(state).last_cow.valid).any()
