"""The simulated KV tiers (pagedjax/simulator/kv_tiers.py) and the conversation workloads
(pagedjax/workloads/conversations.py, trace_jsonl.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.simulator.cost_model import roofline
from pagedjax.simulator.kv_tiers import (
    DEVICE,
    HOST,
    HOST_LINKS,
    StepTime,
    TierCache,
    TierSimConfig,
    simulate_tiers,
)
from pagedjax.workloads import (
    agentic,
    load_conversation_trace,
    multi_turn,
    write_conversation_trace,
)
from pagedjax.workloads.conversations import token_block_keys

# --- the placement model against a brute-force dict ----------------------------------

# A request: a prompt of `length` blocks drawn from one of a few "documents" (so prompts
# share prefixes), held for a while, then released.
request = st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(0, 3))


def brute_hit(keys: list[int], device: set[int], host: set[int]) -> list[int]:
    out = []
    for k in keys:
        if k in device:
            out.append(DEVICE)
        elif k in host:
            out.append(HOST)
        else:
            break
    return out


def drive(cache: TierCache, reqs: list[tuple[int, int, int]], check=None) -> list[int]:
    """Runs requests through the cache: lookup, acquire (releasing the oldest live
    requests until it fits), register the prompt's blocks, release later. Returns the
    hit blocks per request."""
    live: list[tuple[list[int], int]] = []
    hits = []
    for doc, length, extra in reqs:
        keys = np.array([doc * 1000 + b for b in range(length)], np.int64)
        if check is not None:
            check(cache, keys)
        tiers = cache.lookup(keys)
        total = length + extra
        while not cache.acquire(keys, tiers, total):
            held, anon = live.pop(0)
            cache.release(held, anon)
            tiers = cache.lookup(keys)  # the release may have changed nothing: same hit
        held = keys[: len(tiers)].tolist()
        got = cache.register(keys[len(tiers) :])
        held += got
        live.append((held, total - len(held)))
        hits.append(len(tiers))
        assert cache.host_size <= cache.host_blocks
        assert 0 <= cache.empty_blocks <= cache.device_blocks
        if len(live) > 3:
            cache.release(*live.pop(0))
    for held, anon in live:
        cache.release(held, anon)
    return hits


@settings(max_examples=60, deadline=None)
@given(st.lists(request, min_size=1, max_size=40), st.integers(0, 30))
def test_hit_is_the_longest_cached_prefix_and_the_host_tier_stays_in_bounds(reqs, host):
    cache = TierCache(device_blocks=16, host_blocks=host)

    def check(c: TierCache, keys: np.ndarray) -> None:
        want = brute_hit(keys.tolist(), c.device_keys(), c.host_keys())
        assert c.lookup(keys).tolist() == want
        assert c.host_size <= host

    drive(cache, [(d, min(n, 16), min(e, 16 - min(n, 16))) for d, n, e in reqs], check)
    assert cache.anonymous == 0
    assert cache.available_blocks == cache.device_blocks  # everything free again


@settings(max_examples=60, deadline=None)
@given(st.lists(request, min_size=1, max_size=40), st.integers(1, 30))
def test_hits_with_the_host_tier_are_at_least_those_without(reqs, host):
    reqs = [(d, min(n, 16), min(e, 16 - min(n, 16))) for d, n, e in reqs]
    with_tier = drive(TierCache(16, host), reqs)
    without = drive(TierCache(16, 0), reqs)
    assert all(a >= b for a, b in zip(with_tier, without, strict=True))


def test_inclusive_host_tier_and_eviction_order():
    c = TierCache(device_blocks=4, host_blocks=8)
    a = np.array([1, 2, 3], np.int64)
    assert c.acquire(a, c.lookup(a), 3)
    c.release(c.register(a), 0)
    # A 4-block request evicts the 3 cached blocks into the host tier.
    b = np.array([10, 11, 12, 13], np.int64)
    assert c.acquire(b, c.lookup(b), 4)
    assert c.offloaded_blocks == 3 and c.host_keys() == {1, 2, 3}
    c.release(c.register(b), 0)
    tiers = c.lookup(a)
    assert tiers.tolist() == [HOST] * 3
    assert c.acquire(a, tiers, 3)  # reloaded: on device and still on the host
    assert {1, 2, 3} <= c.device_keys() and {1, 2, 3} <= c.host_keys()
    c.release(a.tolist(), 0)
    # Freed blocks go last block first: a 1-block allocation evicts block 3, not 1.
    one = np.array([99], np.int64)
    assert c.acquire(one, c.lookup(one), 2)
    assert 1 in c.device_keys() and 3 not in c.device_keys()


def test_acquire_refuses_without_change_when_full():
    c = TierCache(device_blocks=4)
    a = np.array([1, 2], np.int64)
    assert c.acquire(a, c.lookup(a), 4)
    before = (c.empty_blocks, c.anonymous)
    assert not c.acquire(np.array([5], np.int64), np.zeros(0, np.int8), 1)
    assert (c.empty_blocks, c.anonymous) == before
    with pytest.raises(ValueError, match="device_blocks"):
        TierCache(0)


# --- the step time and the server --------------------------------------------------


def test_step_time_equals_the_roofline_and_refuses_moe():
    cm = roofline("H100-80GB", "llama-3-8b")
    st_ = StepTime.from_roofline(cm)
    for x in [(0, 32, 40000, 0, 0), (2048, 10, 9000, 3e6, 2), (512, 0, 0, 1.3e5, 1)]:
        assert float(st_(*x)) == pytest.approx(float(cm(*x)), rel=1e-4)
    host = roofline("H100-80GB", "llama-3-8b", seq_overhead_s=1e-4)  # vllm2023's kind
    for x in [(0, 32, 40000, 0, 0), (2048, 10, 9000, 3e6, 2)]:
        assert float(StepTime.from_roofline(host)(*x)) == pytest.approx(float(host(*x)), rel=1e-4)
    with pytest.raises(ValueError, match="MoE"):
        StepTime.from_roofline(roofline("A100-80GB", "mixtral-8x7b", tp=2))


def test_host_links_state_their_source():
    assert HOST_LINKS["A100-40GB"].effective_bytes_per_s == 25e9
    assert HOST_LINKS["H100-80GB"].effective_bytes_per_s == 50e9
    assert all("PCIe" in link.source for link in HOST_LINKS.values())


def _serve(w, host_blocks, **kw):
    cm = roofline("H100-80GB", "llama-3-8b")
    return simulate_tiers(w, cm, TierSimConfig(device_blocks=256, host_blocks=host_blocks, **kw))


def test_server_host_tier_cuts_ttft_when_the_working_set_exceeds_the_pool():
    w = multi_turn(24, 4, 4.0, seed=3, max_len=4096)
    assert w.working_set_blocks(16) > 3 * 256
    off, on = _serve(w, 0), _serve(w, 4096)
    for r in (off, on):
        assert np.all(np.isfinite(r.finish_s)) and np.all(r.ttft_s > 0)
        assert np.all(r.finish_s >= r.first_token_s)
        assert r.host_peak_blocks <= 4096
        # Closed loop: a conversation's turn is sent after its previous turn ended.
        for c in range(w.num_conversations):
            idx = np.flatnonzero(w.conversation == c)
            idx = idx[np.argsort(w.turn[idx])]
            assert np.all(r.sent_s[idx[1:]] >= r.finish_s[idx[:-1]])
    assert off.host_hit_tokens == 0 and on.host_hit_tokens > 0
    assert on.host_hits.sum() == on.host_hit_tokens and on.device_hits.sum() == on.device_hit_tokens
    assert np.all(on.device_hits + on.host_hits < w.requests.prompt_len)  # >= 1 computed
    assert on.computed_prompt_tokens < off.computed_prompt_tokens
    assert on.summary()["ttft_p50_ms"] < off.summary()["ttft_p50_ms"]
    sync = _serve(w, 4096, reload="sync")
    assert sync.host_hit_tokens > 0


def test_server_refuses_a_request_larger_than_the_pool():
    w = multi_turn(1, 1, 1.0, seed=0, max_len=8192, system_prompt_len=5000)
    with pytest.raises(ValueError, match="request 0 needs"):
        _serve(w, 0)
    with pytest.raises(ValueError, match="reload"):
        TierSimConfig(device_blocks=8, reload="later")


# --- workloads ----------------------------------------------------------------------


def test_multi_turn_resends_the_history_and_is_deterministic():
    w = multi_turn(6, 5, 2.0, seed=1, max_len=4096)
    again = multi_turn(6, 5, 2.0, seed=1, max_len=4096)
    assert np.array_equal(w.requests.prompt_len, again.requests.prompt_len)
    assert np.array_equal(w.requests.arrival_time, again.requests.arrival_time)
    assert np.all(np.diff(w.requests.arrival_time) >= 0)
    assert np.all(w.requests.total_len <= 4096)
    for c in range(6):
        idx = np.flatnonzero(w.conversation == c)
        assert w.turn[idx].tolist() == list(range(len(idx)))
        p, o = w.requests.prompt_len[idx], w.requests.output_len[idx]
        assert np.all(p[1:] > p[:-1] + o[:-1])  # history + a new user message
        # Turn t + 1's prompt blocks start with turn t's prompt and reply blocks.
        for a, b in zip(idx[:-1], idx[1:], strict=True):
            prev = np.concatenate([w.block_keys(a, 16), w.output_block_keys(a, 16)])
            assert np.array_equal(w.block_keys(b, 16)[: len(prev)], prev)
    # Conversation i does not depend on how many were asked for.
    more = multi_turn(9, 5, 2.0, seed=1, max_len=4096)
    for c in range(6):
        assert sorted(more.requests.prompt_len[more.conversation == c]) == sorted(
            w.requests.prompt_len[w.conversation == c]
        )
    cum = more.cumulative_working_set(16)
    assert cum[5] == w.working_set_blocks(16) and cum[-1] == more.working_set_blocks(16)
    with pytest.raises(ValueError, match="num_conversations"):
        multi_turn(0, 3, 1.0)


def test_agentic_shares_the_context_across_agents():
    a = agentic(3, 10, math.inf, seed=2, context_len=512, max_len=4096)
    assert np.all(a.requests.arrival_time == 0)
    assert np.all(a.requests.prompt_len > 512)
    first = [np.flatnonzero(a.conversation == c)[0] for c in range(3)]
    shared = [a.block_keys(i, 16)[:32] for i in first]
    assert all(np.array_equal(shared[0], s) for s in shared)  # 512 / 16 shared blocks
    assert not np.array_equal(a.block_keys(first[0], 16)[32:33], a.block_keys(first[1], 16)[32:33])
    with pytest.raises(ValueError, match="max_len"):
        agentic(2, 3, 1.0, context_len=4096, max_len=4096)


def test_trace_round_trip_and_token_rows(tmp_path):
    w = multi_turn(4, 3, 1.0, seed=0, system_prompt_len=100)
    path = write_conversation_trace(tmp_path / "t.jsonl", w)
    back = load_conversation_trace(path)
    assert np.array_equal(back.requests.prompt_len, w.requests.prompt_len)
    assert back.working_set_blocks(16) == w.working_set_blocks(16)
    rows = [
        {"arrival_s": 0.0, "conversation": "a", "prompt_tokens": list(range(40)), "output_len": 4},
        {"arrival_s": 1.0, "conversation": "b", "prompt_tokens": list(range(36)) + [7] * 8,
         "output_len": 4},
    ]  # fmt: skip
    (tmp_path / "tok.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    t = load_conversation_trace(tmp_path / "tok.jsonl")
    k0, k1 = t.block_keys(0, 16), t.block_keys(1, 16)
    assert np.array_equal(k0[:2], k1[:2]) and len(t.output_block_keys(0, 16)) == 0
    assert np.array_equal(k0, token_block_keys(np.arange(40), 16))
    # Replayed: the second conversation's prompt hits the first one's two shared blocks.
    r = _serve(t, 0)
    assert r.device_hits.tolist() == [0, 32]


BAD_ROWS = [
    ("not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"conversation": 1, "prompt_len": 5, "output_len": 1}', "missing key 'arrival_s'"),
    ('{"arrival_s": -1, "conversation": 1, "prompt_len": 5, "output_len": 1}', "arrival_s"),
    ('{"arrival_s": 0, "conversation": 1, "prompt_len": 0, "output_len": 1}', "prompt_len"),
    ('{"arrival_s": 0, "conversation": 1, "output_len": 1}', "exactly one of"),
    ('{"arrival_s": 0, "conversation": 1, "prompt_len": 5, "prompt_tokens": [1], '
     '"output_len": 1}', "exactly one of"),
    ('{"arrival_s": 0, "conversation": 1, "prompt_tokens": [1, -2], "output_len": 1}',
     "prompt_tokens"),
    ('{"arrival_s": 0, "conversation": 1.5, "prompt_len": 5, "output_len": 1}', "conversation"),
    ('{"arrival_s": 0, "conversation": 1, "prompt_len": 5, "output_len": true}', "output_len"),
    ('{"arrival_s": 0, "conversation": 1, "prompt_len": 5, "output_len": 1, "x": 1}',
     "unknown key"),
    ('{"arrival_s": 0, "conversation": 1, "prompt_len": 5, "output_len": 1, '
     '"shared_prefix": "s"}', "go together"),
    ('{"arrival_s": 0, "conversation": 1, "prompt_tokens": [3], "output_len": 1}',
     "mixes token and length rows"),
    ('{"arrival_s": 0, "conversation": 2, "prompt_len": 9, "output_len": 1, '
     '"shared_prefix": "s", "shared_prefix_len": 3}', "has length 3 here but 4"),
]  # fmt: skip


@pytest.mark.parametrize(("row", "match"), BAD_ROWS)
def test_trace_refuses_bad_rows_by_line_number(tmp_path, row, match):
    good = [
        '{"arrival_s": 0, "conversation": 1, "prompt_len": 5, "output_len": 1}',
        '{"arrival_s": 0, "conversation": 3, "prompt_len": 9, "output_len": 1, '
        '"shared_prefix": "s", "shared_prefix_len": 4}',
        "",
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([*good, row]) + "\n")
    with pytest.raises(ValueError, match=match) as e:
        load_conversation_trace(path)
    assert f"{path}:4" in str(e.value)
    with pytest.raises(ValueError, match="no trace file"):
        load_conversation_trace(tmp_path / "missing.jsonl")


def test_experiment_runs_small_and_config_refusals(tmp_path):
    from experiments import kv_tiers
    from experiments.config import ExperimentConfig, KvTiersSettings, TierProfile
    from pagedjax.config import ConfigError

    prof = TierProfile("H100-80GB", "llama-3-8b", device_pool_gib=0.5, host_tier_gib=4.0,
                       rate=4.0, max_model_len=4096)  # fmt: skip
    s = KvTiersSettings(profiles=[prof], working_set_multiples=[0.5, 4.0], turns=4)
    cfg = ExperimentConfig(experiments=["kv_tiers"], kv_tiers=s)
    summary = kv_tiers.run(cfg, tmp_path, lambda it, **_: it)
    pts = summary["profiles"]["H100-80GB/llama-3-8b"]["points"]
    assert pts[0]["conversations"] < pts[1]["conversations"]
    assert pts[1]["on"]["host_hit_rate"] > 0 == pts[1]["off"]["host_hit_rate"]
    assert pts[1]["ttft_p50_ratio_off_on"] > 1
    assert (tmp_path / "kv_tiers.csv").exists() and (tmp_path / "kv_tiers.png").exists()
    assert kv_tiers.table(summary)
    with pytest.raises(ConfigError, match="working_set_multiples"):
        KvTiersSettings(working_set_multiples=[2.0, 1.0])
    with pytest.raises(ConfigError, match="profiles.gpu"):
        TierProfile(gpu="B200")
    with pytest.raises(ConfigError, match="agent_context_len"):
        KvTiersSettings(workload="agentic", agent_context_len=4096)


def test_real_engine_lines_parse():
    from experiments.kv_tiers import parse_real_engine

    out = (
        "tier off: TTFT p50   165.0 ms  p90   207.6 ms  prompt tokens computed   8448  hits\n"
        "tier on : TTFT p50   142.4 ms  p90   179.5 ms  prompt tokens computed   2688  hits\n"
        "greedy outputs equal: True\n"
    )
    r = parse_real_engine(out)
    assert r["off"] == dict(ttft_p50_ms=165.0, ttft_p90_ms=207.6, prompt_tokens_computed=8448)
    assert r["on"]["prompt_tokens_computed"] == 2688 and r["greedy_outputs_equal"]


@pytest.mark.slow  # the real engine, twice, on a tiny random llama (~1 min on 2 cores)
def test_real_engine_ablation_runs_through_the_experiment():
    from experiments.config import KvTiersSettings
    from experiments.kv_tiers import run_real_engine

    args = ["--convs", "3", "--turns", "2", "--system-len", "48", "--pool-blocks", "8",
            "--tier-blocks", "32", "--hidden", "64", "--layers", "1", "--heads", "2"]  # fmt: skip
    r = run_real_engine(KvTiersSettings(real_engine=True, real_engine_args=args))
    assert r["returncode"] == 0, r["output_tail"]
    assert r["greedy_outputs_equal"]
    assert r["on"]["prompt_tokens_computed"] < r["off"]["prompt_tokens_computed"]


def test_host_tier_drops_its_least_recently_used_block():
    c = TierCache(device_blocks=2, host_blocks=2)
    for k in (1, 2, 3, 4):  # 2 blocks each: every request evicts the previous one's block
        keys = np.array([k], np.int64)
        assert c.acquire(keys, c.lookup(keys), 2)
        c.release(c.register(keys), 1)
    # 1, 2, 3 were offloaded; the tier holds 2, so 1 (the oldest) was dropped.
    assert c.host_keys() == {2, 3} and c.device_keys() == {4}
    assert c.offloaded_blocks == 3 and c.host_evicted_blocks == 1
    hit = np.array([2], np.int64)
    assert c.lookup(hit).tolist() == [HOST]
    assert c.acquire(hit, c.lookup(hit), 1)  # reload 2: touched, so 3 is now the oldest
    c.release([2], 0)
    keys = np.array([9], np.int64)
    assert c.acquire(keys, c.lookup(keys), 2)  # evicts 4 (offloaded) and 2 (kept: touched)
    assert c.host_keys() == {2, 4} and c.host_size == 2
    assert c.offloaded_blocks == 4 and c.host_evicted_blocks == 2  # 3 went, not 2
