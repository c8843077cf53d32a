"""Loading models: HF safetensors checkpoints -> Flax params, and Orbax save/restore of the
converted params."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.config import ModelArch, load_arch
from pagedjax.model.forward import Params, abstract_params
from pagedjax.model.hf_keys import canonical_tensors, ignored
from pagedjax.model.quant.serialization import from_plain, to_plain
from pagedjax.model.quant.weight import QuantizedWeight, stack_layers
from pagedjax.model.safetensors_io import load_tensors

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype: Any) -> Any:
    """Accepts "float32" / "bfloat16" / "float16" or the jnp dtype itself."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}")
        return DTYPES[dtype]
    if np.dtype(dtype) not in {np.dtype(d) for d in DTYPES.values()}:
        raise ValueError(f"unsupported dtype {dtype}; supported: {sorted(DTYPES)}")
    return dtype


def checkpoint_files(directory: Path) -> list[Path]:
    """The .safetensors files of a checkpoint: those named by model.safetensors.index.json if
    present (sharded), else every *.safetensors in the directory."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / n for n in names]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} listed in {index.name} not found")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights found in {directory}")
    return files


def _hf_key(path: tuple[str, ...]) -> tuple[str, bool, bool]:
    """Flax param path -> (normalized HF key, transpose?, stacked?). Dense kernels are
    [in, out]; a stacked key (under the layer loop's "layers") has a "{i}" for the layer index."""
    *mods, leaf = path
    stacked = bool(mods) and mods[0] == "layers"
    if stacked:
        mods = ["layers", "{i}", *mods[1:]]
    hf_leaf = {"kernel": "weight", "embedding": "weight", "scale": "weight"}.get(leaf, leaf)
    return ".".join([*mods, hf_leaf]), leaf == "kernel", stacked


def convert_hf_tensors(
    arch: ModelArch,
    tensors: dict[str, np.ndarray],
    dtype: Any = jnp.float32,
    kernels: dict[str, QuantizedWeight] | None = None,
) -> Params:
    """HF tensor dict -> Flax params of dtype. Raises ValueError naming any missing tensor,
    shape mismatch, or unexpected tensor (a sign that config and weights disagree).

    ``kernels``: linear weights a quantized checkpoint's loader already built, by
    canonical key (``layers.3.self_attn.q_proj.weight``); they stand for the dense tensor
    of that key (shape-checked as [in, out]) and are stacked per layer as they are.

    Keys are first made canonical per family (``hf_keys.canonical_tensors``: prefixes
    stripped, Phi-3 / GPT-NeoX fused projections split, Mixtral experts stacked); each Flax
    parameter path then names its canonical key (``_hf_key``)."""
    dtype = resolve_dtype(dtype)
    named = canonical_tensors(arch, tensors)  # per-family prefixes, fused/split tensors
    shapes = abstract_params(arch, dtype)
    used = set()
    missing = []

    kernels = kernels or {}

    def one(key: str, transpose: bool, shape: tuple[int, ...]) -> Any:
        if key in kernels:
            used.add(key)
            q = kernels[key]
            # A kernel is [in, out]; an embedding [vocab, hidden] is held as its LM-head
            # transpose [hidden, vocab].
            want = tuple(shape) if transpose else tuple(shape)[::-1]
            if (q.in_features, q.out_features) != want:
                raise ValueError(
                    f"shape mismatch for quantized weight {key!r}: checkpoint has [in, out] "
                    f"({q.in_features}, {q.out_features}), config implies {want}"
                )
            return q
        if key not in named:
            missing.append(key)
            return None
        used.add(key)
        source, x = named[key]
        if transpose:
            x = x.T
        if x.shape != shape:
            raise ValueError(
                f"shape mismatch for tensor {source!r}: checkpoint has "
                f"{tuple(named[key][1].shape)}, config implies "
                f"{shape[::-1] if transpose else shape}"
            )
        return np.asarray(x).astype(dtype)

    def convert(path, spec):
        key, transpose, stacked = _hf_key(tuple(p.key for p in path))
        if not stacked:
            x = one(key, transpose, spec.shape)
            return None if x is None else jax.tree.map(jnp.asarray, x)
        # Decoder layers are stacked on a leading axis (the layer loop's ``fori_loop``).
        rows = [one(key.format(i=i), transpose, spec.shape[1:]) for i in range(spec.shape[0])]
        if any(r is None for r in rows):
            return None
        if isinstance(rows[0], QuantizedWeight):
            return jax.tree.map(jnp.asarray, stack_layers(rows))
        return jnp.asarray(np.stack(rows))

    params = jax.tree_util.tree_map_with_path(convert, shapes)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)}")
    extra = {
        source
        for k, (source, _) in named.items()
        if k not in used
        and k not in kernels
        and not ignored(arch, k)
        and not (k == "lm_head.weight" and arch.tie_word_embeddings)
    }
    extra |= set(kernels) - used
    if extra:
        raise ValueError(f"checkpoint has tensors the config does not use: {sorted(extra)}")
    return params


def load_hf_checkpoint(directory: str | Path, dtype: Any = jnp.float32) -> tuple[ModelArch, Params]:
    """(arch, params) from a local HF directory: config.json + *.safetensors (sharded via
    model.safetensors.index.json or not). Weights are cast to dtype (fp32/bf16/fp16)."""
    directory = Path(directory)
    arch = load_arch(directory)  # raises FileNotFoundError for a missing dir/config
    tensors: dict[str, np.ndarray] = {}
    for f in checkpoint_files(directory):
        tensors.update(load_tensors(f))
    return arch, convert_hf_tensors(arch, tensors, dtype)


def save_params(directory: str | Path, arch: ModelArch, params: Params) -> None:
    """Writes converted params with Orbax to <directory>/params and arch to arch.json;
    quantized weights as their arrays, their formats in quant.json (quant/serialization.py)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "arch.json").write_text(arch.to_json())
    plain, formats = to_plain(params)  # quantized weights: arrays + quant.json
    (directory / "quant.json").write_text(json.dumps(formats))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory / "params", plain, force=True)


def restore_params(directory: str | Path) -> tuple[ModelArch, Params]:
    """Inverse of save_params: (arch, params) with the saved dtypes."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not (directory / "arch.json").is_file() or not (directory / "params").is_dir():
        raise FileNotFoundError(f"no saved params (arch.json + params/) in {directory}")
    arch = ModelArch.from_json((directory / "arch.json").read_text())
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(directory / "params")
    quant = directory / "quant.json"
    formats = json.loads(quant.read_text()) if quant.is_file() else {}
    return arch, from_plain(params, formats)
