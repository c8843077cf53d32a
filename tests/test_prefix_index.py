"""The swappable prefix index (hash chain, radix tree) and the eviction policies.

Every property runs against both indexes and a brute-force reference (a dict from the
whole token prefix to its block), so a bug in one index cannot hide behind the other.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pagedjax.memory import block_pool as bp
from pagedjax.memory.block_pool import NULL_BLOCK
from pagedjax.memory.eviction import POLICIES, get_policy, recompute_cost
from pagedjax.memory.prefix_cache import chain_hashes
from pagedjax.memory.prefix_index import HashChainIndex, PrefixIndex, chain_hash
from pagedjax.memory.radix_index import RadixIndex

BS = 2
INDEXES = {"hash": HashChainIndex, "radix": RadixIndex}


class Reference:
    """Brute force: whole prefix (tuple of tokens) -> block, and back."""

    def __init__(self) -> None:
        self.block_of: dict[tuple[int, ...], int] = {}
        self.prefix_of: dict[int, tuple[int, ...]] = {}

    def match(self, tokens) -> list[int]:
        out = []
        for k in range(1, len(tokens) // BS + 1):
            b = self.block_of.get(tuple(tokens[: k * BS]))
            if b is None:
                break
            out.append(b)
        return out

    def insert(self, parent: int, tokens, block: int) -> int:
        key = (self.prefix_of[parent] if parent != NULL_BLOCK else ()) + tuple(tokens)
        if key in self.block_of:
            return self.block_of[key]
        self.block_of[key], self.prefix_of[block] = block, key
        return block

    def has_child(self, block: int) -> bool:
        p = self.prefix_of[block]
        return any(len(k) > len(p) and k[: len(p)] == p for k in self.block_of)

    def remove(self, block: int) -> None:
        del self.block_of[self.prefix_of.pop(block)]

    def evictable(self) -> set[int]:
        return {b for b in self.prefix_of if not self.has_child(b)}

    def depth(self, block: int) -> int:
        return len(self.prefix_of[block]) // BS - 1


tokens_st = st.lists(st.integers(0, 1), max_size=9)
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), tokens_st),
        st.tuples(st.just("match"), tokens_st),
        st.tuples(st.just("evict"), st.integers(0, 50)),
        st.tuples(st.just("remove_inner"), st.integers(0, 50)),
    ),
    max_size=40,
)


def test_both_satisfy_protocol_and_hash_is_the_engines():
    for cls in INDEXES.values():
        assert isinstance(cls(BS), PrefixIndex)
    toks = [5, 7, 1, 2, 9, 9]
    h, out = None, []
    for i in range(3):
        h = chain_hash(h, toks[i * BS : (i + 1) * BS])
        out.append(h)
    assert out == chain_hashes(toks, BS)


@pytest.mark.parametrize("cls", INDEXES.values(), ids=INDEXES.keys())
def test_refusals(cls):
    idx = cls(BS)
    with pytest.raises(ValueError, match="exactly 2 tokens"):
        idx.insert(NULL_BLOCK, [1], 3)
    with pytest.raises(ValueError, match="not cached"):
        idx.insert(4, [1, 1], 3)
    with pytest.raises(ValueError, match="null block"):
        idx.insert(NULL_BLOCK, [1, 1], NULL_BLOCK)
    assert idx.insert(NULL_BLOCK, [1, 1], 3) == 3
    assert idx.insert(NULL_BLOCK, [1, 1], 4) == 3  # already cached: keeps block 3
    with pytest.raises(ValueError, match="already cached"):
        idx.insert(NULL_BLOCK, [2, 2], 3)
    assert idx.insert(3, [2, 2], 4) == 4
    with pytest.raises(ValueError, match="child"):
        idx.remove(3)
    with pytest.raises(ValueError, match="not cached"):
        idx.remove(9)
    assert idx.match([1, 1, 2, 2, 7]) == [3, 4] and idx.evictable() == {4}


@given(ops_st)
def test_indexes_agree_with_brute_force(ops):
    drive(ops)


@pytest.mark.parametrize("seed", range(2))
def test_indexes_agree_on_long_random_workloads(seed):
    """Hypothesis keeps examples small; long workloads build multi-block edges with
    children, so splits inside an edge and merges after an eviction really happen."""
    r = random.Random(seed)
    # Shared "system prompts" and their mutations give long edges that branch mid-way.
    roots = [[r.randint(0, 3) for _ in range(r.randint(2, 12))] for _ in range(3)]

    def prompt() -> list[int]:
        base = list(r.choice(roots))
        if base and r.random() < 0.5:
            base[r.randrange(len(base))] = r.randint(0, 3)
        return base + [r.randint(0, 3) for _ in range(r.randint(0, 6))]

    ops = []
    for _ in range(200):
        kind = r.choice(["insert", "insert", "match", "match", "evict", "remove_inner"])
        ops.append((kind, prompt() if kind in ("insert", "match") else r.randint(0, 50)))
    drive(ops)


def drive(ops) -> None:
    """Apply ``ops`` to the reference and both indexes, checking agreement after each."""
    ref, idxs = Reference(), {k: c(BS) for k, c in INDEXES.items()}
    fresh = 1
    for op, arg in ops:
        if op == "insert":
            parent = NULL_BLOCK
            for i in range(len(arg) // BS):
                fresh += 1
                blk = arg[i * BS : (i + 1) * BS]
                want = ref.insert(parent, blk, fresh)
                for idx in idxs.values():
                    assert idx.insert(parent, blk, fresh) == want
                parent = want
        elif op == "match":
            want = ref.match(arg)
            for idx in idxs.values():
                assert idx.match(arg) == want  # exactly the longest cached prefix
        else:
            leaves = sorted(ref.evictable())
            inner = sorted(set(ref.prefix_of) - set(leaves))
            if op == "evict" and leaves:
                victim = leaves[arg % len(leaves)]
                ref.remove(victim)
                for idx in idxs.values():
                    idx.remove(victim)
            elif op == "remove_inner" and inner:
                for idx in idxs.values():  # a block with a cached child is never evicted
                    with pytest.raises(ValueError):
                        idx.remove(inner[arg % len(inner)])
        for idx in idxs.values():
            assert len(idx) == len(ref.prefix_of)
            assert idx.evictable() == ref.evictable()
            for b in ref.prefix_of:
                assert b in idx and idx.depth(b) == ref.depth(b)
        idxs["radix"].validate()
        assert idxs["radix"].num_nodes() <= len(ref.prefix_of)
    for seq in ref.block_of:  # every cached prefix is a full hit in both
        for idx in idxs.values():
            assert idx.match(list(seq)) == ref.match(list(seq))


def _brute(policy: str, ids, la, hits, depth, k):
    def key(i):
        primary = {
            "lru": la[i],
            "lfu": hits[i],
            "cost": (depth[i] + 1) * (hits[i] + 1),
        }[policy]
        return (primary, la[i], ids[i])

    return [ids[i] for i in sorted(range(len(ids)), key=key)[:k]]


@given(
    st.integers(0, 12).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(1, 1000), min_size=n, max_size=n, unique=True),
            st.lists(st.integers(0, 5), min_size=n, max_size=n),
            st.lists(st.integers(0, 4), min_size=n, max_size=n),
            st.lists(st.integers(0, 6), min_size=n, max_size=n),
        )
    ),
    st.integers(0, 14),
    st.booleans(),
)
def test_policies_pick_the_victims_their_definition_says(arrays, k, use_jnp):
    ids, la, hits, depth = arrays
    conv = (lambda x: jnp.asarray(x, jnp.int32)) if use_jnp else np.asarray
    for name, policy in POLICIES.items():
        got = policy(*(conv(x) for x in (ids, la, hits, depth)), k)
        assert got.tolist() == _brute(name, ids, la, hits, depth, k), name


def test_policy_registry_and_cost_shape():
    assert set(POLICIES) == {"lru", "lfu", "cost"} and get_policy("cost") is POLICIES["cost"]
    with pytest.raises(ValueError, match="unknown eviction policy 'arc'; known: cost, lfu, lru"):
        get_policy("arc")
    with pytest.raises(ValueError, match="1-D of one length"):
        get_policy("lru")([1, 2], [0], [0, 0], [0, 0], 1)
    # A shallow, unhit block is cheaper than a deep one or a popular one.
    assert recompute_cost([0, 0, 3], [0, 5, 0]).tolist() == [1, 6, 4]
    assert get_policy("cost")([7, 8, 9], [9, 0, 0], [0, 0, 3], [0, 5, 0], 1).tolist() == [7]
    assert get_policy("lru")([7, 8, 9], [9, 0, 0], [0, 0, 3], [0, 5, 0], 1).tolist() == [8]


# ---- driven together with the block pool ------------------------------------------
NB, MAXK = 12, 5
_acquire = jax.jit(bp.acquire_ref)
_unlink = jax.jit(bp.unlink_free)
_free = jax.jit(bp.free)


@settings(max_examples=25)
@given(
    st.sampled_from(sorted(INDEXES)),
    st.sampled_from(sorted(POLICIES)),
    st.lists(st.tuples(tokens_st, st.booleans()), max_size=14),
)
def test_with_block_pool_no_block_is_free_and_referenced(index_name, policy_name, requests):
    """Admit requests like the engine: reuse the hit, take fresh blocks (evicting
    unreferenced leaves chosen by the policy when none is uncached and free), register
    the full blocks, and finish some requests. A block held by a live request is never
    evicted, and no block is both on the free list and referenced."""
    idx, policy = INDEXES[index_name](BS), get_policy(policy_name)
    pool = bp.create_block_pool(NB)
    live: list[list[int]] = []
    last_access: dict[int, int] = {}
    hits: dict[int, int] = {}
    for step, (toks, finishes) in enumerate(requests):
        held = idx.match(toks)
        for b in held:
            pool = _acquire(pool, jnp.int32(b))
            last_access[b], hits[b] = step, hits.get(b, 0) + 1
        parent = held[-1] if held else NULL_BLOCK
        for i in range(len(held), len(toks) // BS):
            rc = np.asarray(pool.refcount)
            free_uncached = [b for b in range(1, NB) if rc[b] == 0 and b not in idx]
            if not free_uncached:
                cands = sorted(b for b in idx.evictable() if rc[b] == 0)
                if not cands:
                    break  # out of memory: the request runs with what it holds
                victim = int(
                    policy(
                        cands,
                        [last_access.get(b, -1) for b in cands],
                        [hits.get(b, 0) for b in cands],
                        [idx.depth(b) for b in cands],
                        1,
                    )[0]
                )
                assert all(victim not in r for r in live) and victim not in held
                idx.remove(victim)
                free_uncached = [victim]
            b = free_uncached[0]
            pool, ok = _unlink(pool, jnp.int32(b))
            assert bool(ok)
            assert idx.insert(parent, toks[i * BS : (i + 1) * BS], b) == b
            held.append(b)
            last_access[b], parent = step, b
        live.append(held)
        if finishes:
            done = live.pop(0)
            pad = np.full((MAXK,), NULL_BLOCK, np.int32)
            pad[: len(done)] = done
            pool, ok = _free(pool, jnp.asarray(pad))
            assert bool(ok)
        rc = np.asarray(pool.refcount)
        on_free_list = set(bp.free_list(pool))
        assert not any(rc[b] > 0 for b in on_free_list)
        assert on_free_list == {b for b in range(1, NB) if rc[b] == 0}
        for r in live:  # live requests' blocks stay cached and referenced
            assert all(b in idx and rc[b] > 0 for b in r)
        want = [sum(r.count(b) for r in live) for b in range(NB)]
        assert rc.tolist() == want
