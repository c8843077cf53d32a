"""Model, weights and tokenizer from a ModelConfig: a local HF directory, a GGUF file, a
catalog name (a real model fetched once into the user's cache) or a preset name."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.config import ModelConfig
from pagedjax.gguf_file import parse_gguf
from pagedjax.model import PRESETS, ModelArch, load_arch, load_hf_checkpoint, preset_arch
from pagedjax.model import random_params as make_random_params
from pagedjax.model.catalog import CATALOG, fetch_model
from pagedjax.model.gguf_loader import load_gguf_arch, load_gguf_checkpoint
from pagedjax.model.quant.gguf_packed import load_gguf_packed
from pagedjax.model.quant.inflight import INFLIGHT_MODES, quantize_params
from pagedjax.model.quant.methods import (
    CHECKPOINT_METHODS,
    check_method,
    load_quantized_checkpoint,
    resolve_method,
)
from pagedjax.tokenizer import ByteTokenizer, Tokenizer, gguf_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(name: str, checkpoint_dir: Path | None, platform: str) -> Any:
    """ "auto": float32 on CPU (bf16 matmuls are emulated there, slow and lossy); on an
    accelerator the checkpoint's torch_dtype when it is 16-bit, else bfloat16."""
    if name != "auto":
        return _DTYPES[name]
    if platform == "cpu":
        return jnp.float32
    if checkpoint_dir is not None and (checkpoint_dir / "config.json").is_file():
        cfg = json.loads((checkpoint_dir / "config.json").read_text())
        if cfg.get("torch_dtype") in ("float16", "bfloat16"):
            return _DTYPES[cfg["torch_dtype"]]
        if cfg.get("torch_dtype") == "float32":
            return jnp.float32
    return jnp.bfloat16


def load_model(mc: ModelConfig) -> tuple[ModelArch, Any, Tokenizer, Any]:
    """(arch, params, tokenizer, dtype) for mc.model.

    A directory with config.json loads its safetensors (load_format "auto" /
    "safetensors") or random weights ("dummy"); a preset name has no weights, so
    "auto" means "dummy" there (logged). A catalog name (``smollm2-135m-instruct``) is
    fetched once into the cache (pagedjax/model/catalog.py) and loads as its GGUF file; a
    ``.gguf`` file loads dequantized (kept packed with quantization="gguf"), with the
    tokenizer and chat template of its metadata. mc.quantization: the checkpoint's own
    method when None (config.json's quantization_config), or an in-flight mode applied
    after loading (pagedjax/model/quant/methods.py). The tokenizer comes from
    mc.tokenizer, else the directory or GGUF file, else a byte-level fallback with the
    model's bos/eos ids.
    """
    platform = jax.devices()[0].platform
    path = Path(mc.model)
    mc = dataclasses.replace(mc, quantization=check_method(mc.quantization))  # "fp8" aliased
    if mc.model in CATALOG or (path.suffix == ".gguf" and path.is_file()):
        if mc.load_format == "safetensors":
            raise ValueError(f"{mc.model!r} is a GGUF model; use load_format='auto' or 'dummy'")
        if mc.quantization in CHECKPOINT_METHODS:
            raise ValueError(f"{mc.model!r} is a GGUF model, not a {mc.quantization} checkpoint")
        gguf_path = fetch_model(mc.model) if mc.model in CATALOG else path
        dtype = resolve_dtype(mc.dtype, None, platform)
        gf = parse_gguf(gguf_path)  # once: the weights and the tokenizer read this header
        if mc.load_format == "dummy":  # the file's shapes and tokenizer, random weights
            arch = load_gguf_arch(gf)
            params = make_random_params(arch, mc.seed, dtype)
        elif mc.quantization == "gguf":  # the file's quantized linears kept packed
            arch, params = load_gguf_packed(gf, dtype)
        else:
            arch, params = load_gguf_checkpoint(gf, dtype)
        if mc.tokenizer:
            tokenizer = load_tokenizer(mc.tokenizer)
        else:
            tokenizer = gguf_tokenizer(gguf_path, gf.metadata)
        return arch, _in_flight(params, mc.quantization), tokenizer, dtype
    method = mc.quantization
    if path.is_dir():
        dtype = resolve_dtype(mc.dtype, path, platform)
        method = resolve_method(mc.quantization, path)
        if mc.load_format == "dummy":
            if method in CHECKPOINT_METHODS:
                raise ValueError(f"load_format='dummy' cannot build {method} weights")
            arch = load_arch(path)
            params = make_random_params(arch, mc.seed, dtype)
        elif method in CHECKPOINT_METHODS:
            arch, params = load_quantized_checkpoint(path, dtype)
        else:
            arch, params = load_hf_checkpoint(path, dtype)
        tok_dir: Path | None = path
    elif mc.model in PRESETS:
        if mc.load_format == "safetensors":
            raise ValueError(f"preset {mc.model!r} has no weights; use load_format='dummy'")
        if mc.load_format == "auto":
            log.info("preset %s has no checkpoint: random weights (load_format=dummy)", mc.model)
        method = resolve_method(mc.quantization, None)
        dtype = resolve_dtype(mc.dtype, None, platform)
        arch = preset_arch(mc.model)
        params = make_random_params(arch, mc.seed, dtype)
        tok_dir = None
    else:
        raise FileNotFoundError(
            f"model {mc.model!r} is neither a local checkpoint directory, a .gguf file, a"
            f" catalog model ({sorted(CATALOG)}) nor a preset ({sorted(PRESETS)})"
        )
    if mc.tokenizer is not None:
        tokenizer = load_tokenizer(mc.tokenizer)
    elif tok_dir is not None:
        tokenizer = load_tokenizer(tok_dir)
    else:
        tokenizer = ByteTokenizer(arch.eos_token_id, arch.bos_token_id)
    return arch, _in_flight(params, method), tokenizer, dtype


def load_model_tokenizer(mc: ModelConfig) -> Tokenizer:
    """The tokenizer ``load_model(mc)`` returns, without loading weights or starting JAX's
    backend (an API process whose engine core runs in another process, core_client.py)."""
    if mc.tokenizer is not None:
        return load_tokenizer(mc.tokenizer)
    path = Path(mc.model)
    if mc.model in CATALOG or (path.suffix == ".gguf" and path.is_file()):
        return gguf_tokenizer(fetch_model(mc.model) if mc.model in CATALOG else path)
    if path.is_dir():
        return load_tokenizer(path)
    if mc.model in PRESETS:
        arch = preset_arch(mc.model)
        return ByteTokenizer(arch.eos_token_id, arch.bos_token_id)
    raise FileNotFoundError(
        f"model {mc.model!r}: no checkpoint directory, GGUF file, catalog model or preset"
    )


def _in_flight(params: Any, method: str | None) -> Any:
    """params with an in-flight quantization mode applied (unchanged for None and for
    the methods a loader already applied)."""
    if method in INFLIGHT_MODES:
        log.info("quantizing the linear layers in flight: %s", method)
        return quantize_params(params, method)
    return params
