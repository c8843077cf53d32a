"""The disk tier (memory/disk_tier.py, engine/kv_offload.py; docs/kv_tiers.md): block files
that a restarted engine reads, and never a foreign, corrupt or mismatched one."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest

from pagedjax.config import CacheConfig, ConfigError
from pagedjax.memory.disk_tier import DiskTier

B = 4
SPECS = [((2, 1, 3, B, 8), np.float32), ((2, 1, 3, B, 1), np.float32)]


def _tier(root, fp="ab" * 8, cap=1 << 20) -> DiskTier:
    return DiskTier(root, fp, SPECS, B, cap)


def _blocks(n: int, seed: int = 0) -> tuple[list[int], np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    hashes = [int(x) for x in rng.integers(1, 2**63, n)]
    tokens = rng.integers(3, 500, (n, B)).astype(np.int32)
    leaves = [rng.normal(size=(s[0], n, *s[2:])).astype(d) for s, d in SPECS]
    return hashes, tokens, leaves


def test_roundtrip_restart_and_refusals(tmp_path, caplog):
    hashes, tokens, leaves = _blocks(5)
    tier = _tier(tmp_path)
    assert tier.write(hashes, tokens, leaves) == 5
    assert tier.write(hashes[:2], tokens[:2], [x[:, :2] for x in leaves]) == 0  # kept already
    assert not list(tier.dir.glob("*.tmp"))  # atomic writes leave no temporary file
    again = _tier(tmp_path)  # a restarted engine: the files are found
    assert len(again) == 5 and hashes[3] in again
    for i, h in enumerate(hashes):
        got = again.read(h, tokens[i])
        assert got is not None
        for x, want in zip(got, leaves, strict=True):
            np.testing.assert_array_equal(x, want[:, i : i + 1])
    assert again.read(hashes[0], tokens[0] + 1) is None  # other tokens under the hash
    assert again.read(12345, tokens[0]) is None  # no file
    other = _tier(tmp_path, fp="cd" * 8)  # another model / format: its own directory
    assert len(other) == 0 and other.read(hashes[0], tokens[0]) is None
    with pytest.raises(ValueError, match="capacity_bytes"):
        _tier(tmp_path, cap=0)
    with pytest.raises(ValueError, match="fingerprint"):
        _tier(tmp_path, fp="../x")


def test_corrupt_and_foreign_files_are_ignored_with_a_warning(tmp_path, caplog):
    hashes, tokens, leaves = _blocks(3)
    tier = _tier(tmp_path)
    tier.write(hashes, tokens, leaves)
    (tier.dir / f"{hashes[0]:016x}.npz").write_bytes(b"not a zip file")  # corrupt
    foreign = _tier(tmp_path, fp="ef" * 8)  # a foreign file copied under our name
    foreign.write(hashes[1:2], tokens[1:2], [x[:, 1:2] for x in leaves])
    (foreign.dir / f"{hashes[1]:016x}.npz").replace(tier.dir / f"{hashes[1]:016x}.npz")
    narrow = [((2, 1, 3, B, 4), np.float32), SPECS[1]]  # same fingerprint, other leaf shapes
    wrong = DiskTier(tmp_path / "w", "ab" * 8, narrow, B, 1 << 20)
    wrong.write(hashes[2:], tokens[2:], [leaves[0][..., :4][:, 2:], leaves[1][:, 2:]])
    (wrong.dir / f"{hashes[2]:016x}.npz").replace(tier.dir / f"{hashes[2]:016x}.npz")
    fresh = _tier(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pagedjax.memory.disk_tier"):
        for i in range(3):
            assert fresh.read(hashes[i], tokens[i]) is None
            assert fresh.read(hashes[i], tokens[i]) is None  # warned once per file
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3 and all("disk tier: ignoring" in m for m in warned)


def test_capacity_keeps_the_most_recently_used_files(tmp_path):
    hashes, tokens, leaves = _blocks(6, seed=1)
    one = _tier(tmp_path / "probe")
    one.write(hashes[:1], tokens[:1], [x[:, :1] for x in leaves])
    size = one.used_bytes
    tier = _tier(tmp_path, cap=3 * size)
    for i in range(6):
        tier.write(hashes[i : i + 1], tokens[i : i + 1], [x[:, i : i + 1] for x in leaves])
        if i == 3:  # a read makes hashes[1] recently used (mtime), so it outlives 2 and 3
            assert tier.read(hashes[1], tokens[1]) is not None
    assert tier.used_bytes <= 3 * size and len(tier) == 3
    assert {h for h in hashes if h in tier} == {hashes[1], hashes[4], hashes[5]}


def test_options_flags_and_metrics():
    """The options are checked; the server flags reach LLM(...); the counters reach
    /metrics."""
    from prometheus_client import generate_latest

    from pagedjax.entrypoints.llm import engine_config
    from pagedjax.entrypoints.openai import cli_args
    from pagedjax.entrypoints.openai.metrics import ServerMetrics

    args = cli_args.make_parser().parse_args(
        ["--model", "m", "--kv-offloading-size", "2", "--kv-offloading-disk-path", "/tmp/x",
         "--kv-offloading-disk-size", "1.5"]
    )  # fmt: skip
    cc = engine_config(**cli_args.llm_kwargs(args)).cache
    assert (cc.kv_offloading_disk_path, cc.kv_offloading_disk_size) == ("/tmp/x", 1.5)
    m = ServerMetrics("m")
    stats = dict(prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0,
                 kv_disk_written_blocks=9, kv_disk_loaded_blocks=4)  # fmt: skip
    m._apply(dict(counts=dict(running=0, waiting=0, swapped=0), stats=stats, usable=1, free=1,
                  preemptions=0))  # fmt: skip
    text = generate_latest(m.registry).decode()
    for name, value in (("kv_disk_written_blocks", 9), ("kv_disk_loaded_blocks", 4)):
        assert f'pagedjax:{name}_total{{model_name="m"}} {float(value)}' in text
    CacheConfig(kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/x")
    with pytest.raises(ConfigError, match="kv_offloading_disk_path"):
        CacheConfig(kv_offloading_disk_path="/tmp/x")  # no host tier above it
    with pytest.raises(ConfigError, match="kv_offloading_disk_size"):
        CacheConfig(kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/x",
                    kv_offloading_disk_size=0.0)  # fmt: skip


# ---------------------------------------------------------------------------- engine


@pytest.mark.tier2
def test_a_restarted_engine_reads_the_disk_tier_and_another_model_does_not(tmp_path):
    """Engine A offloads a conversation's blocks (device -> host -> disk); a new engine B
    with the same model finds them on disk (disk -> host -> device) with greedy outputs
    equal to an engine without tiers; an engine with other weights loads none."""
    from pagedjax import LLM, SamplingParams

    engine = dict(num_gpu_blocks_override=24, block_size=B, max_num_seqs=2,
                  max_num_batched_tokens=16, warmup="none", swap_space=0.0,
                  num_scheduler_steps=1)  # fmt: skip
    rng = random.Random(0)
    convs = [[rng.randrange(3, 500) for _ in range(22)] for _ in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(llm, prompts):
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in got]

    plain = LLM("tiny-llama", **engine)
    want = run(plain, convs)
    del plain
    tier = dict(kv_offloading_size=0.01, kv_offloading_disk_path=str(tmp_path))
    a = LLM("tiny-llama", **engine, **tier)
    assert run(a, convs) == want  # 4 x 6+ blocks through a 23-block pool: evictions
    sa = a.llm_engine.stats()
    assert sa["kv_disk_written_blocks"] > 0 and sa["kv_disk_loaded_blocks"] == 0
    del a
    b = LLM("tiny-llama", **engine, **tier)
    assert run(b, convs[:1]) == want[:1]
    sb = b.llm_engine.stats()
    assert sb["kv_disk_loaded_blocks"] >= 5  # the first conversation's full blocks
    assert sb["prefix_cache_host_hit_tokens"] >= 5 * B
    del b
    c = LLM("tiny-llama", seed=1, **engine, **tier)  # other random weights
    run(c, convs[:1])
    assert c.llm_engine.stats()["kv_disk_loaded_blocks"] == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2  # one per fingerprint
