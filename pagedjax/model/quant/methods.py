"""Which quantization a model runs with, and loading it: vLLM's rule (the checkpoint's
``config.json`` ``quantization_config`` decides; ``quantization=`` may name the same
method or, for a 16/32-bit checkpoint, an in-flight mode) and the loaders per method.

Methods:
- pre-quantized checkpoints: ``awq``, ``gptq``, ``compressed-tensors`` (hf_formats.py),
  detected from ``quantization_config.quant_method``;
- ``gguf``: a GGUF file's quantized tensors kept packed (gguf_packed.py);
- in-flight: ``int8_per_channel_weight_only``, ``fp8_per_tensor``, ``fp8_per_channel``,
  ``int4``, ``nf4`` (inflight.py), applied after any 16/32-bit load.

Refusals (ValueError): an unknown method name; an in-flight mode or another method asked
of a checkpoint that is already quantized with a different one; a pre-quantized method
asked of a checkpoint that does not carry it; a quantization_config method not built
(the message lists the built ones).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pagedjax.model.config import ModelArch, load_arch
from pagedjax.model.forward import Params
from pagedjax.model.hf_keys import canonical_tensors
from pagedjax.model.loader import checkpoint_files, convert_hf_tensors, resolve_dtype
from pagedjax.model.quant.hf_formats import (
    awq_weight,
    collect_modules,
    compressed_tensors_weight,
    config_get,
    gptq_weight,
)
from pagedjax.model.quant.inflight import INFLIGHT_MODES
from pagedjax.model.quant.weight import QuantizedWeight
from pagedjax.model.safetensors_io import load_tensors

log = logging.getLogger(__name__)

CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors")
METHODS = (*CHECKPOINT_METHODS, "gguf", *INFLIGHT_MODES)
# Deprecated names vLLM 0.32 still accepts for in-flight quantization, with a warning
# (its weight_utils.get_quant_config: "fp8" on a checkpoint without an fp8
# quantization_config is "fp8_per_tensor").
DEPRECATED_ALIASES = {"fp8": "fp8_per_tensor"}


def check_method(name: str | None) -> str | None:
    """name itself if it is a quantization method (or None); a deprecated alias is
    mapped to its method with a warning (``DEPRECATED_ALIASES``); ValueError otherwise."""
    if name in DEPRECATED_ALIASES:
        new = DEPRECATED_ALIASES[name]
        log.warning("quantization %r is deprecated for in-flight quantization (as in vLLM);"
                    " running %r: pass quantization=%r instead", name, new, new)  # fmt: skip
        return new
    if name is not None and name not in METHODS:
        raise ValueError(f"unknown quantization {name!r}; supported: {list(METHODS)}")
    return name


def checkpoint_quantization_config(directory: Path) -> dict[str, Any] | None:
    """config.json's quantization_config (None when absent or no config.json)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("quantization_config")


def resolve_method(requested: str | None, directory: Path | None) -> str | None:
    """The method a model directory (None: no checkpoint) runs with (module docstring)."""
    requested = check_method(requested)
    qc = checkpoint_quantization_config(directory) if directory is not None else None
    detected = None if qc is None else qc.get("quant_method")
    if detected is not None and detected not in CHECKPOINT_METHODS:
        raise ValueError(
            f"checkpoint quantization_config.quant_method={detected!r} is not supported; "
            f"supported: {list(CHECKPOINT_METHODS)}"
        )
    if detected is None:
        if requested in CHECKPOINT_METHODS:
            where = directory or "this model"
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint quantized with it; "
                f"{where} has no quantization_config"
            )
        if requested == "gguf":
            raise ValueError("quantization='gguf' needs a .gguf file as the model")
        return requested
    if requested is not None and requested != detected:
        raise ValueError(
            f"the checkpoint is quantized with {detected!r}; quantization={requested!r} "
            "cannot be applied to it (omit it or pass the checkpoint's method)"
        )
    return detected


def _kernel_key(arch: ModelArch, module: str) -> str:
    """HF module name -> the canonical key of its dense weight (what the params name)."""
    (key,) = canonical_tensors(arch, {f"{module}.weight": np.zeros(0)}).keys()
    return key


def _compressed_tensors_scheme(qc: dict[str, Any]) -> tuple[str, int, str]:
    """(format, weight bits, activation quantization) of a compressed-tensors config with
    one config group (what llm-compressor's W4A16 / W8A16 / W8A8 recipes write)."""
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: {len(groups)} config groups (1 is supported)")
    weights = groups[0].get("weights") or {}
    acts = groups[0].get("input_activations")
    bits = int(weights.get("num_bits", 8))
    if not weights.get("symmetric", True):
        raise ValueError("compressed-tensors: asymmetric weights are not supported")
    act = "none"
    if acts is not None:
        if not acts.get("dynamic", False):
            raise ValueError("compressed-tensors: static activation scales are not supported")
        act = "fp8" if acts.get("type") == "float" else "int8"
    if fmt not in ("pack-quantized", "int-quantized", "float-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported")
    return fmt, bits, act


def quantized_kernels(
    method: str, qc: dict[str, Any], tensors: dict[str, np.ndarray], arch: ModelArch
) -> dict[str, QuantizedWeight]:
    """Pops the quantized modules' tensors out of ``tensors`` (HF names) and returns
    their QuantizedWeights by canonical weight key."""
    if method == "awq":
        if int(config_get(qc, "bits", config_get(qc, "w_bit", 4))) != 4:
            raise ValueError("AWQ: only 4-bit weights are supported")
        version = str(config_get(qc, "version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (GEMM only)")
        mods = collect_modules(tensors, "qweight", ("qweight", "qzeros", "scales"), ())
        built = {m: awq_weight(t, m) for m, t in mods.items()}
    elif method == "gptq":
        bits = int(config_get(qc, "bits", 4))
        fmt = config_get(qc, "checkpoint_format", "gptq")
        offset = 0 if fmt == "gptq_v2" else 1
        mods = collect_modules(tensors, "qweight", ("qweight", "qzeros", "scales"), ("g_idx",))
        built = {m: gptq_weight(t, m, bits, offset) for m, t in mods.items()}
    else:  # compressed-tensors
        fmt, bits, act = _compressed_tensors_scheme(qc)
        if fmt == "pack-quantized":
            optional = ("weight_shape", "weight_zero_point", "weight_g_idx")
            mods = collect_modules(
                tensors, "weight_packed", ("weight_packed", "weight_scale"), optional
            )
        else:
            mods = collect_modules(tensors, "weight_scale", ("weight", "weight_scale"),
                                   ("input_scale", "weight_zero_point"))  # fmt: skip
        built = {m: compressed_tensors_weight(t, m, fmt, bits, act) for m, t in mods.items()}
    if not built:
        raise ValueError(f"{method} checkpoint has no quantized linear modules")
    return {_kernel_key(arch, m): w for m, w in built.items()}


def load_quantized_checkpoint(
    directory: str | Path, dtype: Any = jnp.float32
) -> tuple[ModelArch, Params]:
    """(arch, params) of a pre-quantized HF checkpoint (method from its config.json);
    the quantized linears as QuantizedWeights, everything else in dtype."""
    directory = Path(directory)
    arch = load_arch(directory)
    qc = checkpoint_quantization_config(directory)
    method = resolve_method(None, directory)
    if method is None or qc is None:
        raise ValueError(f"{directory} is not a quantized checkpoint (no quantization_config)")
    tensors: dict[str, np.ndarray] = {}
    for f in checkpoint_files(directory):
        tensors.update(load_tensors(f))
    kernels = quantized_kernels(method, qc, tensors, arch)
    return arch, convert_hf_tensors(arch, tensors, resolve_dtype(dtype), kernels=kernels)
