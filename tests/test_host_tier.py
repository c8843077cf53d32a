"""The host tier (issue 35 item 1, docs/kv_tiers.md): prefix blocks evicted from the
device pool kept in the host pool and loaded back on a hit.

Pure parts against brute-force references (Hypothesis): the bounded index and the shared
host allocator (``exchange`` with swap-like allocations interleaved), the cross-tier hit.
Engine: a multi-turn workload on a small device pool, tier off vs on (greedy outputs
identical, host hits, fewer prompt tokens computed, every block free at the end).
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pagedjax import LLM, SamplingParams
from pagedjax.config import CacheConfig, ConfigError
from pagedjax.memory import block_pool as bp
from pagedjax.memory.host_tier import HostTierIndex, cross_tier_hit, exchange, leading_run
from pagedjax.memory.prefix_cache import chain_hashes

MAX_N = 8
_exchange = jax.jit(exchange, static_argnums=(4,))
_allocate = jax.jit(bp.allocate, static_argnums=(2,))
_free = jax.jit(bp.free)
_cross_tier_hit = jax.jit(cross_tier_hit, static_argnums=(3,))


def _pool_invariants(pool: bp.BlockPool, held: dict[int, int]) -> None:
    """Free list == refcount-0 blocks, exactly; refcounts == the references held."""
    rc = np.asarray(pool.refcount)
    free = bp.free_list(pool)
    assert len(free) == len(set(free)) == int(pool.num_free)
    assert all(rc[b] == 0 for b in free)  # never both free and referenced
    assert set(free) | {b for b in range(1, pool.num_blocks) if rc[b] > 0} == set(
        range(1, pool.num_blocks)
    )
    for b in range(1, pool.num_blocks):
        assert rc[b] == held.get(b, 0)


@settings(max_examples=20)
@given(
    num_blocks=st.sampled_from([3, 10]),
    capacity=st.integers(0, 10),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("store"), st.lists(st.integers(0, 15), max_size=MAX_N)),
            st.tuples(st.just("swap_out"), st.integers(1, 4)),
            st.tuples(st.just("swap_in"), st.integers(0, 3)),
        ),
        max_size=12,
    ),
)
def test_index_and_shared_allocator_stay_bounded_and_consistent(num_blocks, capacity, ops):
    """Stores (the tier) and swap-like allocations share one BlockPool: the tier never
    holds more than its capacity, each kept block has exactly the tier's reference, no
    block is both free and referenced, and a swap never gets a kept block."""
    pool = bp.create_block_pool(num_blocks)
    index = HostTierIndex(capacity, block_size=2)
    swapped: list[list[int]] = []
    for op, arg in ops:
        if op == "store":
            hashes = [h for h in dict.fromkeys(arg) if h not in index]
            hashes = hashes[len(hashes) - min(len(hashes), capacity) :]
            victims, freed = index.plan_store(len(hashes))
            index.evict(victims)
            rel = np.zeros(MAX_N, np.int32)
            rel[: len(freed)] = freed
            pool, got, count = _exchange(pool, rel, np.int32(len(freed)), np.int32(len(hashes)),
                                         MAX_N)  # fmt: skip
            got = np.asarray(got)[: int(count)].tolist()
            assert int(count) == min(len(hashes), int(pool.num_free) + int(count))
            index.commit(
                hashes[: len(got)], [np.full(2, h, np.int32) for h in hashes[: len(got)]], got
            )
        elif op == "swap_out":
            pool, blocks, ok = _allocate(pool, np.int32(arg), 4)
            if bool(ok):
                taken = np.asarray(blocks)[:arg].tolist()
                assert not set(taken) & set(index.blocks())  # a kept block is never taken
                swapped.append(taken)
        elif swapped:
            row = swapped.pop(arg % len(swapped))
            padded = np.zeros(4, np.int32)
            padded[: len(row)] = row
            pool, ok = _free(pool, padded)
            assert bool(ok)
        assert len(index) <= capacity
        held = {b: 1 for b in index.blocks()}
        for row in swapped:
            for b in row:
                held[b] = held.get(b, 0) + 1
        assert len(set(index.blocks())) == len(index)
        _pool_invariants(pool, held)


def test_commit_refuses_past_capacity_and_duplicates():
    index = HostTierIndex(2, block_size=2)
    index.commit([1, 2], [np.zeros(2, np.int32)] * 2, [5, 6])
    with pytest.raises(ValueError, match="over capacity"):
        index.commit([3], [np.zeros(2, np.int32)], [7])
    index.evict([1])
    with pytest.raises(ValueError, match="already kept"):
        index.commit([2], [np.zeros(2, np.int32)], [7])
    assert index.plan_store(1) == ([], []) and index.plan_store(2) == ([2], [6])


def _brute_hit(on_dev: list[bool], on_host: list[bool], n_tokens: int, bs: int) -> tuple[int, int]:
    """Walk the blocks: the device prefix, then the host run continuing it; a hit that
    reaches the last token gives back its last block (taken from the host part first)."""
    d = 0
    while d < len(on_dev) and on_dev[d]:
        d += 1
    h = 0
    while d + h < len(on_host) and on_host[d + h]:
        h += 1
    total = d + h
    while total > 0 and total * bs >= n_tokens:
        total -= 1
    return min(d, total), total - min(d, total)


@settings(max_examples=60)
@given(
    rows=st.lists(
        st.tuples(st.lists(st.booleans(), min_size=6, max_size=6),
                  st.lists(st.booleans(), min_size=6, max_size=6), st.integers(1, 24)),
        min_size=6, max_size=6,
    ),
)  # fmt: skip
def test_cross_tier_hit_is_the_longest_prefix_across_tiers(rows):
    bs = 4
    on_dev = np.array([r[0] for r in rows])
    on_host = np.array([r[1] for r in rows])
    n_tok = np.array([r[2] for r in rows])
    full = n_tok // bs
    cols = np.arange(6)[None, :]
    on_dev &= cols < full[:, None]  # only a prompt's full blocks can be cached
    on_host &= cols < full[:, None]
    d = leading_run(on_dev, np.zeros(len(rows), int))
    h = leading_run(on_host, d)
    use_d, use_h = cross_tier_hit(d, h, n_tok, bs)
    jd, jh = _cross_tier_hit(jnp.asarray(d), jnp.asarray(h), jnp.asarray(n_tok), bs)
    assert np.array_equal(np.asarray(jd), use_d) and np.array_equal(np.asarray(jh), use_h)
    for k in range(len(rows)):
        assert (int(use_d[k]), int(use_h[k])) == _brute_hit(
            list(on_dev[k]), list(on_host[k]), int(n_tok[k]), bs
        )


@settings(max_examples=60)
@given(seed=st.integers(0, 10_000), n_keep=st.integers(0, 30))
def test_index_run_matches_a_brute_force_prefix_dict(seed, n_keep):
    """Prompts over a 3-token alphabet share prefixes; keep random blocks (by chained
    hash); ``run`` from any start returns exactly the kept blocks of the longest run of
    kept whole-prefix blocks, checked against a dict keyed by the whole prefix."""
    rng = random.Random(seed)
    bs = 2
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(0, 12))] for _ in range(8)]
    index = HostTierIndex(64, bs)
    ref: dict[tuple[int, ...], int] = {}
    blocks = iter(range(1, 1000))
    for _ in range(n_keep):
        p = rng.choice(prompts)
        if len(p) < bs:
            continue
        i = rng.randrange(len(p) // bs)
        h = chain_hashes(p, bs)[i]
        if h in index:
            continue
        blk = next(blocks)
        index.commit([h], [np.asarray(p[i * bs : (i + 1) * bs], np.int32)], [blk])
        ref[tuple(p[: (i + 1) * bs])] = blk
    for p in prompts:
        hashes = chain_hashes(p, bs)
        for start in range(len(hashes) + 1):
            want = []
            for i in range(start, len(hashes)):
                blk = ref.get(tuple(p[: (i + 1) * bs]))
                if blk is None:
                    break
                want.append(blk)
            assert index.run(hashes, p, start, len(hashes)) == want


def test_options_are_vllms_and_refuse_other_backends():
    assert CacheConfig().kv_offloading_size == 0.0  # off by default
    CacheConfig(kv_offloading_size=1.0, kv_offloading_backend="native")
    with pytest.raises(ConfigError, match="'lmcache' is not built"):
        CacheConfig(kv_offloading_size=1.0, kv_offloading_backend="lmcache")
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        CacheConfig(kv_offloading_size=-1.0)
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        CacheConfig(kv_offloading_size=1.0, enable_prefix_caching=False)


# ---------------------------------------------------------------------------- engine

BS = 4
ENGINE = dict(num_gpu_blocks_override=24, block_size=BS, max_num_seqs=2,
              max_num_batched_tokens=16, warmup="none", swap_space=0.0,
              num_scheduler_steps=1)  # fmt: skip
TIER_BLOCKS = 48


def _bytes_per_block(engine) -> int:
    """KV bytes of one block, every layer, K and V."""
    return sum(x.nbytes for x in jax.tree.leaves(engine.kv)) // engine.num_blocks


def _multi_turn(llm: LLM, convs: int, turns: int, seed: int) -> tuple[list, list[int]]:
    """``convs`` conversations, one turn of each per round (each turn resends the whole
    history plus new user tokens), so a conversation's prefix is evicted by the others'
    before its next turn. Returns (outputs per round, host tier size after each round)."""
    rng = random.Random(seed)
    hist = [[rng.randrange(3, 500) for _ in range(14)] for _ in range(convs)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs, sizes = [], []
    for _ in range(turns):
        got = llm.generate([{"prompt_token_ids": h} for h in hist], params, use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in got]
        outs.append(ids)
        tier = llm.llm_engine.core.host_tier
        sizes.append(len(tier.index) if tier is not None else 0)
        hist = [
            h + o + [rng.randrange(3, 500) for _ in range(5)]
            for h, o in zip(hist, ids, strict=True)
        ]
    return outs, sizes


def _all_free(engine) -> None:
    """Every device block free (cached-evictable counts as free); every host block free
    or held once by the tier."""
    mem = engine.state.mem
    assert int(mem.pool.num_free) == engine.num_usable_blocks()
    assert not np.asarray(mem.pool.refcount).any()
    if mem.host_pool is not None:
        rc = np.asarray(mem.host_pool.refcount)
        tier = engine.core.host_tier
        kept = set(tier.index.blocks()) if tier is not None else set()
        assert all(rc[b] == (1 if b in kept else 0) for b in range(1, rc.shape[0]))
        assert int(mem.host_pool.num_free) + len(kept) == rc.shape[0] - 1


@pytest.mark.tier2
def test_multi_turn_outputs_equal_and_host_hits_save_prefill():
    runs, stats, sizes = {}, {}, {}
    size_gib = bpb = 0
    for gib in (0.0, None):
        if gib is None:  # the tier: TIER_BLOCKS blocks of the engine's KV
            gib = size_gib = (TIER_BLOCKS + 0.5) * bpb / (1 << 30)
        # The tier's run also takes the fused K-step decode loop (an iteration that
        # would evict rolls back to the one-step path, which offloads).
        steps = 1 if gib == 0.0 else 4
        llm = LLM("tiny-llama", kv_offloading_size=gib, **(ENGINE | {"num_scheduler_steps": steps}))
        bpb = _bytes_per_block(llm.llm_engine)
        runs[gib], sizes[gib] = _multi_turn(llm, convs=4, turns=3, seed=0)
        stats[gib] = llm.llm_engine.stats()
        _all_free(llm.llm_engine)
    off, on = stats[0.0], stats[size_gib]
    assert runs[size_gib] == runs[0.0]
    assert "prefix_cache_host_hit_tokens" not in off
    assert on["kv_host_tier_capacity_blocks"] == TIER_BLOCKS
    assert on["kv_offloaded_blocks"] > 0 and on["kv_reloaded_blocks"] > 0
    assert on["kv_relinked_blocks"] > 0  # device blocks after a host run were reused too
    assert on["prefix_cache_host_hit_tokens"] == on["kv_reloaded_blocks"] * BS > 0
    assert on["prefix_cache_hit_tokens"] == (
        on["prefix_cache_device_hit_tokens"] + on["prefix_cache_host_hit_tokens"]
    )
    assert on["kv_offloaded_bytes"] == on["kv_offloaded_blocks"] * bpb
    assert max(sizes[size_gib]) <= TIER_BLOCKS
    # The same prompts were looked up; the host hits are prompt tokens not computed.
    assert on["prefix_cache_query_tokens"] == off["prefix_cache_query_tokens"]
    computed = {g: s["prefix_cache_query_tokens"] - s["prefix_cache_hit_tokens"]
                for g, s in stats.items()}  # fmt: skip
    assert computed[size_gib] < computed[0.0]


def test_server_flags_and_metrics():
    """--kv-offloading-size / --kv-offloading-backend reach LLM(...); a connector is
    refused by name; the host tier's counters reach /metrics."""
    from prometheus_client import generate_latest

    from pagedjax.entrypoints.llm import engine_config
    from pagedjax.entrypoints.openai import cli_args
    from pagedjax.entrypoints.openai.metrics import ServerMetrics

    p = cli_args.make_parser()
    args = p.parse_args(["--model", "m", "--kv-offloading-size", "2",
                         "--kv-offloading-backend", "native"])  # fmt: skip
    kw = cli_args.llm_kwargs(args)
    assert kw["kv_offloading_size"] == 2.0 and kw["kv_offloading_backend"] == "native"
    assert engine_config(**kw).cache.kv_offloading_size == 2.0
    bad = cli_args.llm_kwargs(p.parse_args(["--model", "m", "--kv-offloading-backend", "lmcache"]))
    with pytest.raises(ConfigError, match="'lmcache' is not built"):
        engine_config(**bad)
    m = ServerMetrics("m")
    stats = dict(prefix_cache_query_tokens=100, prefix_cache_hit_tokens=60,
                 prefix_cache_host_hit_tokens=40, kv_offloaded_blocks=7, kv_reloaded_blocks=10,
                 kv_offloaded_bytes=700, kv_reloaded_bytes=1000)  # fmt: skip
    counts = dict(running=0, waiting=0, swapped=0)
    m._apply(dict(counts=counts, stats=stats, usable=10, free=10, preemptions=0))
    text = generate_latest(m.registry).decode()
    for name, value in (("prefix_cache_host_hits", 40), ("kv_offload_blocks", 7),
                        ("kv_reload_blocks", 10), ("kv_reload_bytes", 1000)):  # fmt: skip
        assert f'pagedjax:{name}_total{{model_name="m"}} {float(value)}' in text


@pytest.mark.tier2  # 1,000 requests: issue 35's leak check (~12 s)
def test_thousand_requests_leave_every_block_free_and_the_tier_in_bounds():
    """1,000 requests (shared system prompts, so the pool evicts and the tier offloads and
    reloads all along) leave every device block free or cached-evictable and every host
    block free or held once by the tier; the tier never held more than its capacity."""
    llm = LLM("tiny-llama", kv_offloading_size=0.0, **ENGINE)
    bpb = _bytes_per_block(llm.llm_engine)
    del llm
    llm = LLM("tiny-llama", kv_offloading_size=(TIER_BLOCKS + 0.5) * bpb / (1 << 30),
              **(ENGINE | {"max_num_seqs": 8}))  # fmt: skip
    engine = llm.llm_engine
    tier = engine.core.host_tier
    rng = random.Random(1)
    systems = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    sizes = []
    engine.add_step_observer(lambda _: sizes.append(len(tier.index)))
    for _ in range(10):  # 10 x 100 requests
        prompts = [{"prompt_token_ids": rng.choice(systems) + [rng.randrange(3, 500)
                    for _ in range(rng.randrange(1, 9))]} for _ in range(100)]  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    s = engine.stats()
    assert s["kv_offloaded_blocks"] > 0 and s["kv_reloaded_blocks"] > 0
    assert max(sizes) <= TIER_BLOCKS == tier.capacity
    _all_free(engine)
