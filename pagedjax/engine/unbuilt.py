"""Refusals of feature combinations the engine does not build, before anything loads.

``reject_unbuilt_features(config)`` raises ValueError naming the combination: too few
devices for the TP size, a speculative method or draft it cannot build, speculation under
tensor parallelism, LoRA with what it is not built with (lora_manager.py), and data
parallelism (one ``LLMEngine`` is one replica; ``DataParallelEngine`` holds several).
Called by ``LLMEngine.from_config`` before the weights load, and again by the constructor
for engines built from loaded parameters.
"""

from __future__ import annotations

from pagedjax.config import EngineConfig
from pagedjax.engine.lora_manager import check_lora_buildable
from pagedjax.engine.parallel import check_device_count
from pagedjax.engine.spec.decoder import check_buildable


def reject_unbuilt_features(config: EngineConfig) -> None:
    check_device_count(config.parallel.tensor_parallel_size)
    check_buildable(config.speculative, config.model.model)
    if config.speculative is not None and config.parallel.tensor_parallel_size > 1:
        raise ValueError("speculative_config with tensor_parallel_size > 1: not built yet")
    check_lora_buildable(config)
    if config.parallel.data_parallel_size > 1:  # replicas are data_parallel.py's, above
        raise ValueError("LLMEngine is one replica; data_parallel_size > 1: DataParallelEngine")
