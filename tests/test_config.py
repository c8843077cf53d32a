"""Configuration: YAML loading, unknown keys and invalid values rejected by name."""

from __future__ import annotations

import pytest

from pagedjax.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    apply_overrides,
    load_dataclass,
    load_yaml,
)


def test_defaults_and_yaml_round_trip(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text(
        "model: {model: llama-2-7b, load_format: dummy}\n"
        "cache: {block_size: 32, num_gpu_blocks_override: 100}\n"
        "scheduler: {scheduling_mode: paper, max_num_batched_tokens: 2560}\n"
    )
    cfg = EngineConfig.from_yaml(path)
    assert cfg.model.model == "llama-2-7b"
    assert cfg.cache.block_size == 32
    assert cfg.scheduler.scheduling_mode == "paper"
    assert cfg.parallel.tensor_parallel_size == 1
    cfg2 = load_yaml(EngineConfig, path, overrides=["cache.block_size=8", "model.seed=3"])
    assert cfg2.cache.block_size == 8 and cfg2.model.seed == 3


@pytest.mark.parametrize(
    "data, key",
    [
        ({"cache": {"blok_size": 16}}, "cache.blok_size"),
        ({"engine": {}}, "engine"),
        ({"cache": {"block_size": 12}}, "cache.block_size"),
        ({"cache": {"block_size": 0}}, "cache.block_size"),
        ({"cache": {"block_size": 512}}, "cache.block_size"),
        ({"cache": {"block_size": "16"}}, "cache.block_size"),
        ({"cache": {"gpu_memory_utilization": 0.0}}, "cache.gpu_memory_utilization"),
        ({"cache": {"gpu_memory_utilization": 1.5}}, "cache.gpu_memory_utilization"),
        ({"cache": {"num_gpu_blocks_override": 1}}, "cache.num_gpu_blocks_override"),
        ({"cache": {"kv_cache_memory_bytes": -5}}, "cache.kv_cache_memory_bytes"),
        ({"cache": {"swap_space": -1}}, "cache.swap_space"),
        ({"cache": {"enable_prefix_caching": "yes"}}, "cache.enable_prefix_caching"),
        ({"scheduler": {"watermark": 1.0}}, "scheduler.watermark"),
        ({"scheduler": {"watermark": -0.1}}, "scheduler.watermark"),
        ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs"),
        ({"scheduler": {"max_num_batched_tokens": -1}}, "scheduler.max_num_batched_tokens"),
        ({"scheduler": {"scheduling_mode": "fast"}}, "scheduler.scheduling_mode"),
        ({"scheduler": {"preemption_mode": "drop"}}, "scheduler.preemption_mode"),
        ({"model": {"max_model_len": 0}}, "model.max_model_len"),
        ({"model": {"dtype": "float64"}}, "model.dtype"),
        ({"parallel": {"tensor_parallel_size": 0}}, "parallel.tensor_parallel_size"),
        ({"cache": [1, 2]}, "cache"),
    ],
)
def test_invalid_values_name_the_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_dataclass(EngineConfig, data)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="cache.block_size"):
        CacheConfig(block_size=3)


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_yaml(EngineConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["cache.block_size"])
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_yaml(EngineConfig, bad)
