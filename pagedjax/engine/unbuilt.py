"""Refusals of feature combinations the engine does not build, before anything loads.

``reject_unbuilt_features(config)`` raises ValueError naming the combination: too few
devices for the TP size, a speculative method or draft it cannot build, speculation under
tensor parallelism, LoRA with what it is not built with (lora_manager.py), data
parallelism (one ``LLMEngine`` is one replica; ``DataParallelEngine`` holds several), and
what pipeline parallelism is not built with (``reject_unbuilt_pipeline``).
Called by ``LLMEngine.from_config`` before the weights load, and again by the constructor
for engines built from loaded parameters.
"""

from __future__ import annotations

from pagedjax.config import EngineConfig
from pagedjax.engine.lora_manager import check_lora_buildable
from pagedjax.engine.parallel import check_device_count
from pagedjax.engine.spec.decoder import check_buildable


def reject_unbuilt_features(config: EngineConfig) -> None:
    par = config.parallel
    check_device_count(par.tensor_parallel_size, pipeline_parallel_size=par.pipeline_parallel_size)
    reject_unbuilt_pipeline(config)
    check_buildable(config.speculative, config.model.model)
    if config.speculative is not None and config.parallel.tensor_parallel_size > 1:
        raise ValueError("speculative_config with tensor_parallel_size > 1: not built yet")
    check_lora_buildable(config)
    if config.parallel.data_parallel_size > 1:  # replicas are data_parallel.py's, above
        raise ValueError("LLMEngine is one replica; data_parallel_size > 1: DataParallelEngine")


def reject_unbuilt_pipeline(config: EngineConfig) -> None:
    """ValueError naming what pipeline_parallel_size > 1 is not built with: speculative
    decoding (its draft and verification programs run the layers without the pipeline),
    LoRA (adapter slots are not laid out in stage slots) and data parallelism (replicas
    are split by tensor_parallel_size devices). The 8-bit KV cache is refused where the
    pool is placed (``parallel.DevicePlacement.params``), a multi-modal model in
    ``multimodal.py``."""
    pp = config.parallel.pipeline_parallel_size
    if pp == 1:
        return
    for what, on in (
        ("speculative_config", config.speculative is not None),
        ("enable_lora", config.lora is not None),
        (f"data_parallel_size={config.parallel.data_parallel_size}",
         config.parallel.data_parallel_size > 1),
    ):  # fmt: skip
        if on:
            raise ValueError(f"{what} with pipeline_parallel_size={pp}: not built"
                             " (docs/parallelism.md, Pipeline parallelism)")  # fmt: skip
