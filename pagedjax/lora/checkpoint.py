"""PEFT LoRA checkpoints for the Llama family: adapter_config.json + adapter_model.safetensors
-> per-module A [L, in, r] and B [L, r, out] arrays and the scale.

PEFT's LoRA linear computes ``base(x) + lora_B(lora_A(x)) * scaling`` with lora_A.weight
[r, in], lora_B.weight [out, r] (torch's [out, in] orientation) and scaling = lora_alpha / r
(rslora: lora_alpha / sqrt(r)). Here A = lora_A.weight.T and B = lora_B.weight.T, the
[in, out] orientation of pagedjax's kernels, so the delta is x @ A @ B * scale.

Refused with a ValueError naming the cause, before anything reaches a device: a missing or
unreadable file; a PEFT feature this loader would silently get wrong (DoRA, per-module
rank/alpha patterns, LoRA biases, modules_to_save, a non-LoRA peft_type); a target module
the model lacks (only q/k/v/o_proj and gate/up/down_proj of the decoder layers are served,
and the MLP ones not for MoE models); a rank above ``max_lora_rank``; and a tensor whose
shape disagrees with the base model (an adapter trained for another base). A layer the
adapter does not touch (PEFT's layers_to_transform) gets zero A and B, an exact no-op.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pagedjax.model.safetensors_io import load_tensors

if TYPE_CHECKING:
    from pagedjax.model.config import ModelArch

# The decoder-layer linears served, by their HF (and pagedjax parameter) names.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LLAMA_TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.[\w-]+)?\.weight$"
)


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: ``rank`` r, ``scale`` (alpha / r, or alpha / sqrt(r) for rslora),
    ``weights`` {module: (A float32 [L, in, r], B float32 [L, r, out])} for the targeted
    modules only (numpy, host memory: the slot table copies them into its device arrays)."""

    rank: int
    scale: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def llama_module_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """{module: (in, out)} of the LoRA-servable linears of a Llama-family ModelArch (the
    MLP ones only for a dense MLP: a MoE's experts are not servable here)."""
    hd = arch.num_heads * arch.head_dim
    kvd = arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    shapes = {"q_proj": (h, hd), "k_proj": (h, kvd), "v_proj": (h, kvd), "o_proj": (hd, h)}
    if not arch.num_experts:
        shapes.update(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))
    return shapes


def _read_config(path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        why = "" if path.is_dir() else " (no such directory)"
        raise ValueError(f"LoRA adapter {str(path)!r}: missing {CONFIG_FILE}{why}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {str(path)!r}: corrupt {CONFIG_FILE}: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    return cfg


def _check_config(cfg: dict, where: str) -> None:
    """Refuses what this loader would get wrong rather than serve it approximately."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: DoRA adapters (use_dora) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{where}: per-module {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: LoRA biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {cfg['modules_to_save']} is not supported")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise ValueError(f"{where}: adapter_config r must be a positive int, got {cfg.get('r')!r}")
    if not isinstance(cfg.get("lora_alpha"), int | float):
        raise ValueError(f"{where}: adapter_config lora_alpha missing or not a number")


def load_peft_adapter(
    path: str | Path, module_shapes: dict[str, tuple[int, int]], num_layers: int,
    max_lora_rank: int,
) -> LoRAAdapter:  # fmt: skip
    """Reads a PEFT LoRA checkpoint directory for a base model whose servable linears have
    ``module_shapes`` ({module: (in, out)}, e.g. ``llama_module_shapes(arch)``) over
    ``num_layers`` decoder layers. Returns a ``LoRAAdapter``; raises ValueError as the
    module docstring lists."""
    path = Path(path)
    where = f"LoRA adapter {str(path)!r}"
    cfg = _read_config(path)
    _check_config(cfg, where)
    r, alpha = cfg["r"], float(cfg["lora_alpha"])
    if r > max_lora_rank:
        raise ValueError(f"{where}: rank {r} exceeds max_lora_rank={max_lora_rank}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list | tuple | set):
        lacking = sorted(set(targets) - set(module_shapes))
        if lacking:
            raise ValueError(f"{where}: target modules {lacking} are not LoRA-servable linears "
                             f"of this model (servable: {sorted(module_shapes)})")  # fmt: skip
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"{where}: missing {WEIGHTS_FILE} (.bin checkpoints are not read)")
    try:
        tensors = load_tensors(weights_path)
    except Exception as e:  # any parse failure of a truncated/garbled file is "corrupt"
        raise ValueError(f"{where}: corrupt {WEIGHTS_FILE}: {e}") from e

    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{where}: tensor {key!r} is not a decoder-layer LoRA A/B weight "
                             f"this loader serves")  # fmt: skip
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in module_shapes:
            raise ValueError(f"{where}: target module {module!r} is not a LoRA-servable linear "
                             f"of this model (servable: {sorted(module_shapes)})")  # fmt: skip
        if layer >= num_layers:
            raise ValueError(f"{where}: tensor {key!r} is for layer {layer}; the base model "
                             f"has {num_layers} layers (adapter for another base?)")  # fmt: skip
        d_in, d_out = module_shapes[module]
        want = (r, d_in) if which == "A" else (d_out, r)
        if tuple(value.shape) != want:
            raise ValueError(f"{where}: {key} has shape {tuple(value.shape)}, the base model "
                             f"needs {want} (adapter for another base model?)")  # fmt: skip
        found.setdefault(module, {}).setdefault(layer, {})[which] = value
    if not found:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")

    weights = {}
    for module, layers in found.items():
        d_in, d_out = module_shapes[module]
        a = np.zeros((num_layers, d_in, r), np.float32)
        b = np.zeros((num_layers, r, d_out), np.float32)
        for layer, ab in layers.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{where}: layer {layer} {module} lacks lora_"
                                 f"{'B' if 'A' in ab else 'A'}")  # fmt: skip
            a[layer] = np.asarray(ab["A"], np.float32).T
            b[layer] = np.asarray(ab["B"], np.float32).T
        weights[module] = (a, b)
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return LoRAAdapter(rank=r, scale=scale, weights=weights)
