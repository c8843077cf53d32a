"""Flax models over the paged KV cache, their architecture description and loading."""

from pagedjax.model.config import ModelArch, arch_from_hf_config, load_arch
from pagedjax.model.forward import (
    abstract_params,
    build_module,
    dummy_input,
    forward,
    make_forward,
    random_params,
)
from pagedjax.model.input import ModelInput
from pagedjax.model.kv_cache import KVCache, allocate_kv_cache
from pagedjax.model.loader import (
    convert_hf_tensors,
    load_hf_checkpoint,
    restore_params,
    save_params,
)
from pagedjax.model.presets import PRESETS, preset_arch
from pagedjax.model.quant.weight import QuantizedWeight, compute_dtype

__all__ = [
    "KVCache",
    "ModelArch",
    "ModelInput",
    "PRESETS",
    "QuantizedWeight",
    "abstract_params",
    "allocate_kv_cache",
    "arch_from_hf_config",
    "build_module",
    "compute_dtype",
    "convert_hf_tensors",
    "dummy_input",
    "forward",
    "load_arch",
    "load_hf_checkpoint",
    "make_forward",
    "preset_arch",
    "random_params",
    "restore_params",
    "save_params",
]
