"""Eviction policies in the engine (``CacheConfig.eviction_policy``, docs/kv_tiers.md).

Default tier (a few seconds): the jittable victim order against the host policy
functions of ``memory/eviction.py``; the policy allocator driven through random
allocate / register / hit / free sequences (no block both free and referenced, a held
block is never chosen, the victims are exactly the policy function's choice on the same
arrays); the options; the default "lru" programs carry no statistics and no sort.

Second tier: the engine on every (prefix index) x (eviction policy) x (host tier off,
on): equal greedy outputs, and a workload on which LRU and LFU must keep different
blocks.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.config import CacheConfig, ConfigError
from pagedjax.memory import block_pool as bp
from pagedjax.memory import block_stats as bst
from pagedjax.memory import eviction
from pagedjax.memory.paged_policy import PagedPolicy

N = 16  # pool size in the property tests (block 0 is the null block)
K = 4  # most blocks one allocation takes


def _expected(name, refcount, cached, la, hits, depth, k):
    """The victims by the host functions: free uncached blocks by (last access, id),
    then the policy function over the free cached ones."""
    ids = np.arange(len(refcount))
    free = (refcount == 0) & (ids != 0)
    unc = ids[free & ~cached]
    unc = unc[np.lexsort((unc, la[unc]))]
    c = ids[free & cached]
    pol = eviction.get_policy(name)(c, la[c], hits[c], depth[c], len(c))
    return [int(x) for x in np.concatenate([unc, pol])[:k]]


_order = jax.jit(eviction.victim_order, static_argnums=0)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(eviction.POLICIES)),
    rows=st.lists(
        st.tuples(st.booleans(), st.booleans(), st.integers(0, 5), st.integers(0, 6),
                  st.integers(0, 7)),
        min_size=N, max_size=N,
    ),
)
def test_victim_order_is_the_policy_functions_choice(name, rows):
    free, cached, la, hits, depth = (np.array(c) for c in zip(*rows, strict=True))
    free[0] = False  # the null block
    order = np.asarray(_order(name, jnp.asarray(free), jnp.asarray(cached), jnp.asarray(la),
                              jnp.asarray(hits), jnp.asarray(depth)))  # fmt: skip
    n_free = int(free.sum())
    refcount = np.where(free, 0, 1)
    assert order[:n_free].tolist() == _expected(name, refcount, cached, la, hits, depth, n_free)
    assert sorted(order.tolist()) == list(range(N))  # every block once; held ones last
    assert not free[order[n_free:]].any()


_pop = jax.jit(bst.pop_victims, static_argnums=4)
_drop = jax.jit(bp.drop_refs)
_acquire = jax.jit(bp.acquire_ref)
_touch = jax.jit(bst.touch)
_hit = jax.jit(bst.hit)
_registered = jax.jit(bst.registered)
_tick = jax.jit(bst.tick)

OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "free", "hit", "tick"]), st.integers(0, 99)),
    min_size=1, max_size=24,
)  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["lfu", "cost"]), ops=OPS)
def test_policy_allocator_never_takes_a_held_block_and_follows_the_policy(name, ops):
    """Requests allocate (their full blocks registered, at depth = position), are freed,
    and hit free cached blocks; every allocation takes exactly the policy's victims."""
    pool = bp.create_block_pool(N)
    stats = bst.create_block_stats(N, name)
    cached = np.zeros(N, bool)
    held: list[list[int]] = []
    pad = np.zeros(K, np.int32)

    def arr(blocks):
        a = pad.copy()
        a[: len(blocks)] = blocks
        return jnp.asarray(a), jnp.arange(K) < len(blocks)

    for op, x in ops:
        rc = np.asarray(pool.refcount)
        if op == "alloc":
            k = min(1 + x % K, int(pool.num_free))
            if k == 0:
                continue
            want = _expected(name, rc, cached, np.asarray(stats.last_access),
                             np.asarray(stats.hit_count), np.asarray(stats.depth), k)  # fmt: skip
            pool, got = _pop(pool, jnp.asarray(cached), stats, jnp.int32(k), K)
            got = [int(b) for b in np.asarray(got)[:k]]
            assert got == want
            assert not any(b in r for r in held for b in got)  # never a held block
            cached[got] = False  # the pool handed them out: new contents
            full = got[: x % (k + 1)]  # some fill up and are registered
            cached[full] = True
            blocks, mask = arr(full)
            stats = _registered(stats, blocks, jnp.arange(K, dtype=jnp.int32), mask)
            held.append(got)
        elif op == "free" and held:
            req = held.pop(x % len(held))
            blocks, mask = arr(req)
            stats = _touch(stats, blocks, mask)
            pool = _drop(pool, blocks, jnp.int32(len(req)))
        elif op == "hit":
            free_cached = np.flatnonzero((rc == 0) & cached)
            if len(free_cached):
                b = int(free_cached[x % len(free_cached)])
                pool = _acquire(pool, jnp.int32(b))
                blocks, mask = arr([b])
                stats = _hit(stats, blocks, mask)
                held.append([b])
        else:
            stats = _tick(stats)
        # No block both free and referenced; the free list is exactly the free blocks.
        rc = np.asarray(pool.refcount)
        on_list = bp.free_list(pool)
        assert sorted(on_list) == [b for b in range(1, N) if rc[b] == 0]
        assert int(pool.num_free) == len(on_list)
        assert all(rc[b] >= 1 for r in held for b in r)


def test_eviction_policy_option_is_checked():
    assert CacheConfig().eviction_policy == "lru"
    for name in ("lfu", "cost"):
        assert CacheConfig(eviction_policy=name).eviction_policy == name
    with pytest.raises(ConfigError, match="cache.eviction_policy.*'lru', 'lfu' or 'cost'"):
        CacheConfig(eviction_policy="mru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eviction_policy"):
        PagedPolicy(8, 4, 2, 4, eviction_policy="fifo")
    with pytest.raises(ValueError, match="free list"):
        bst.create_block_stats(8, "lru")


def test_eviction_policy_reaches_the_config_from_llm_and_the_server_flag():
    from pagedjax.entrypoints.llm import engine_config
    from pagedjax.entrypoints.openai import cli_args

    assert engine_config(model="tiny-llama").cache.eviction_policy == "lru"
    assert engine_config(model="tiny-llama", eviction_policy="cost").cache.eviction_policy == "cost"
    parser = cli_args.make_parser()
    kwargs = cli_args.llm_kwargs(parser.parse_args(["--model", "m", "--eviction-policy", "lfu"]))
    assert kwargs["eviction_policy"] == "lfu"
    assert "eviction_policy" not in cli_args.llm_kwargs(parser.parse_args(["--model", "m"]))
    assert "--eviction-policy" in cli_args.PAGEDJAX_ONLY
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--model", "m", "--eviction-policy", "mru"])
    assert exit_info.value.code == 2


def test_default_lru_keeps_the_free_list_program():
    """"lru" carries no statistics and its allocation has no sort (the free list's pop);
    "lfu" sorts. (The default programs were also checked identical, text for text, to
    those before the option existed: docs/kv_tiers.md.)"""
    kw = dict(enable_prefix_caching=True, num_host_blocks=4)
    ids, m = jnp.zeros(2, jnp.int32), jnp.ones(2, bool)
    texts = {}
    for name in ("lru", "lfu"):
        pol = PagedPolicy(16, 4, 2, 4, eviction_policy=name, **kw)
        state = pol.init_state()
        assert (state.stats is None) == (name == "lru")
        grow = jax.jit(lambda s, pol=pol: pol.grow(s, ids, ids + 5, ids, ids, m, True))
        texts[name] = grow.lower(state).as_text()
    assert "stablehlo.sort" not in texts["lru"] and "stablehlo.sort" in texts["lfu"]
    # Without prefix caching no policy keeps statistics (no free block holds anything).
    assert PagedPolicy(16, 4, 2, 4, eviction_policy="lfu").init_state().stats is None


# ---------------------------------------------------------------------------- engine

BS = 4
ENGINE = dict(num_gpu_blocks_override=24, block_size=BS, max_num_seqs=2,
              max_num_batched_tokens=16, warmup="none", swap_space=0.0,
              num_scheduler_steps=1)  # fmt: skip
TIER_BLOCKS = 32


def _workload(llm) -> tuple[list[list[int]], list[int]]:
    """A popular 12-token prefix S (3 blocks) asked 3 times, then 5 unique 22-token
    prompts (enough to cycle the 23-block pool), then S again; then 3 conversations x
    2 turns sharing S (so hits are split between tiers). One request at a time.
    Returns (greedy outputs, prefix-cache hit tokens of each request)."""
    from pagedjax import SamplingParams

    rng = random.Random(1)
    s = [rng.randrange(3, 500) for _ in range(12)]
    prompts = [s + [rng.randrange(3, 500) for _ in range(3)] for _ in range(3)]
    prompts += [[rng.randrange(3, 500) for _ in range(22)] for _ in range(5)]
    prompts += [s + [rng.randrange(3, 500) for _ in range(3)]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = llm.llm_engine
    outs, hits = [], []

    def ask(p):
        before = engine.stats()["prefix_cache_hit_tokens"]
        got = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        outs.append(list(got.outputs[0].token_ids))
        hits.append(engine.stats()["prefix_cache_hit_tokens"] - before)
        return outs[-1]

    for p in prompts:
        ask(p)
    convs = [s + [rng.randrange(3, 500) for _ in range(6)] for _ in range(3)]
    for _ in range(2):
        convs = [c + ask(c) + [rng.randrange(3, 500) for _ in range(4)] for c in convs]
    return outs, hits


@pytest.mark.tier2
def test_every_index_policy_and_tier_gives_the_same_greedy_outputs():
    """12 engines (index x policy x tier): equal greedy outputs; on the popular-prefix
    request LFU (S has hits, the unique prompts none) hits on device where the free
    list's LRU has evicted S; every device block free at the end."""
    from pagedjax import LLM

    bpb = None
    runs, hits, stats = {}, {}, {}
    for tier in (False, True):
        for index in ("hash", "radix"):
            for policy in ("lru", "lfu", "cost"):
                gib = (TIER_BLOCKS + 0.5) * bpb / (1 << 30) if tier else 0.0
                llm = LLM("tiny-llama", prefix_index=index, eviction_policy=policy,
                          kv_offloading_size=gib, **ENGINE)  # fmt: skip
                engine = llm.llm_engine
                if bpb is None:
                    bpb = sum(x.nbytes for x in jax.tree.leaves(engine.kv)) // engine.num_blocks
                key = (tier, index, policy)
                runs[key], hits[key] = _workload(llm)
                stats[key] = engine.stats()
                mem = engine.state.mem
                assert int(mem.pool.num_free) == engine.num_usable_blocks()
                assert (mem.stats is None) == (policy == "lru")
    first = runs[(False, "hash", "lru")]
    assert all(r == first for r in runs.values()), "greedy outputs differ"
    for tier in (False, True):
        for index in ("hash", "radix"):
            lru, lfu = hits[(tier, index, "lru")], hits[(tier, index, "lfu")]
            assert lru[1] == lru[2] == lfu[1] == lfu[2] == 12  # S from the device
            # The popular prefix after the unique prompts: LRU evicted it (its blocks were
            # freed first); LFU kept it (3 hits against none). With the tier LRU gets it
            # back from the host.
            assert lfu[8] == 12
            if not tier:
                assert lru[8] == 0
            else:
                assert lru[8] == 12
                host = "prefix_cache_host_hit_tokens"
                assert stats[(tier, index, "lru")][host] > stats[(tier, index, "lfu")][host]
    # The policies choose differently: not every policy hits the same tokens in all.
    totals = {k: sum(v) for k, v in hits.items()}
    assert len({totals[(False, "hash", p)] for p in ("lru", "lfu", "cost")}) > 1
