"""Medusa heads (Cai et al., 2024): N small heads on the target's last hidden state.

Each head i (0-based) reads the target's post-norm feature f_p at position p (exactly
what the target's LM head sees; vLLM hands its Medusa model the same hidden states) and
predicts the token i + 1 positions after the target's own next token:

    y = f_p;  for each of R residual blocks:  y = y + SiLU(y @ W_{i,r} + b_{i,r})
    logits_i = y @ U_i                        # the head's own vocabulary projection
    head i predicts x_{p+2+i}                 # the target's f_p predicts x_{p+1}

No attention and no KV: a draft of k tokens costs k small MLPs and k LM-head matmuls on
one row per sequence, all independent (a chain of argmaxes; trees are not built here).

Params (a pytree of float32 arrays; N heads, R = num_hidden_layers, H hidden, V vocab):
    {"w": [N, R, H, H]  (in x out: y @ w),  "b": [N, R, H],  "lm_head": [N, H, V]}
``medusa_logits(params, f)`` is the pure forward.

Stored as a directory, two layouts read by ``load_heads``:

* pagedjax's own (``save_heads``): ``config.json`` = ``MedusaConfig`` (format
  "pagedjax-medusa-1", unknown keys rejected) and ``model.safetensors`` holding exactly
  ``w``, ``b``, ``lm_head`` with the shapes above.
* vLLM's Medusa checkpoint layout (config ``model_type`` "medusa" / architectures
  ["MedusaModel"], vLLM's MedusaConfig keys, or the original repo's
  ``medusa_num_heads`` / ``medusa_num_layers``); tensors in ``model.safetensors`` named
  as vLLM's loader maps them: ``blocks.{i}.layers.{r}.weight`` [H, H] (torch out x in),
  ``blocks.{i}.layers.{r}.bias`` [H] (present iff ``medusa_fc_bias``), ``lm_heads.{i}.weight``
  [V, H] (only ``lm_heads.0.weight`` with ``original_lm_head``: one head shared by all),
  each optionally prefixed ``medusa_heads.``. Refused by name: a truncated vocabulary
  (``truncated_vocab_size`` < vocab_size / a ``token_map`` tensor), ``logit_scale`` != 1,
  a ``.bin`` / ``.pt`` file (safetensors only), any other tensor.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.config import ModelArch
from pagedjax.model.eagle import check_feature_target
from pagedjax.model.safetensors_io import load_tensors

FORMAT = "pagedjax-medusa-1"
TRAIN_HINT = "train heads with `python -m pagedjax.tools.train_medusa`"


@dataclass(frozen=True)
class MedusaConfig:
    """config.json of pagedjax's own head directory.

    hidden_size, vocab_size: must equal the target's (checked at load). num_heads: N,
    the most drafts per step (head i drafts token i). num_hidden_layers: R residual
    blocks per head (vLLM's / Medusa's default 1). format: always "pagedjax-medusa-1".
    target: the target's name (informational). train: free-form training metadata,
    never read by the engine."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_hidden_layers: int = 1
    format: str = FORMAT
    target: str = ""
    train: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_hidden_layers < 0:
            raise ValueError(f"medusa heads: need num_heads >= 1 and num_hidden_layers >= 0,"
                             f" got {self.num_heads}, {self.num_hidden_layers}")  # fmt: skip

    @classmethod
    def for_target(cls, arch: ModelArch, num_heads: int, num_hidden_layers: int = 1,
                   target: str = "") -> MedusaConfig:  # fmt: skip
        return cls(arch.hidden_size, arch.vocab_size, num_heads, num_hidden_layers, target=target)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config.json") -> MedusaConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(names)}")
        missing = sorted({"hidden_size", "vocab_size", "num_heads"} - set(data))
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")
        cfg = cls(**data)
        if cfg.format != FORMAT:
            raise ValueError(f"{where}: format {cfg.format!r}, expected {FORMAT!r}")
        return cfg


# vLLM's MedusaConfig keys (and the original Medusa repo's names it maps), plus the
# generic keys a transformers config.json carries.
VLLM_KEYS = frozenset({
    "model_type", "architectures", "hidden_size", "vocab_size", "num_heads",
    "num_hidden_layers", "max_paths", "topk", "truncated_vocab_size", "original_lm_head",
    "medusa_fc_bias", "medusa_num_heads", "medusa_num_layers", "base_model_name_or_path",
    "logit_scale", "torch_dtype", "transformers_version", "max_seq_len",
})  # fmt: skip


def is_vllm_layout(data: dict[str, Any]) -> bool:
    """config.json of a vLLM / Medusa-repo checkpoint rather than pagedjax's own."""
    return (data.get("model_type") == "medusa" or "MedusaModel" in data.get("architectures", ())
            or "medusa_num_heads" in data)  # fmt: skip


def vllm_config(data: dict[str, Any], where: str) -> tuple[MedusaConfig, bool, bool]:
    """(config, fc_bias, original_lm_head) of a vLLM-layout config.json; ValueError
    naming an unknown key or a setting not built."""
    unknown = sorted(set(data) - VLLM_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} for a vLLM Medusa config;"
                         f" known: {sorted(VLLM_KEYS)}")  # fmt: skip
    heads = data.get("num_heads", data.get("medusa_num_heads"))
    layers = data.get("num_hidden_layers", data.get("medusa_num_layers", 1))
    if heads is None or "hidden_size" not in data or "vocab_size" not in data:
        raise ValueError(f"{where}: a Medusa config needs hidden_size, vocab_size and"
                         " num_heads (or medusa_num_heads)")  # fmt: skip
    vocab = int(data["vocab_size"])
    trunc = data.get("truncated_vocab_size")
    if trunc is not None and int(trunc) != vocab:
        raise ValueError(f"{where}: truncated_vocab_size {trunc} < vocab_size {vocab}"
                         " (a token_map draft vocabulary) is not built")  # fmt: skip
    if float(data.get("logit_scale", 1.0)) != 1.0:
        raise ValueError(f"{where}: logit_scale {data['logit_scale']} != 1 is not built")
    cfg = MedusaConfig(int(data["hidden_size"]), vocab, int(heads), int(layers),
                       target=str(data.get("base_model_name_or_path", "")))  # fmt: skip
    shared = bool(data.get("original_lm_head", False))
    return cfg, bool(data.get("medusa_fc_bias", False)), shared


def check_target(cfg: MedusaConfig, target: ModelArch) -> None:
    """ValueError naming the mismatch when the heads cannot run on ``target``
    (``eagle.check_feature_target``: the same features as the EAGLE head's)."""
    check_feature_target("medusa heads", cfg, target)


def param_shapes(cfg: MedusaConfig) -> dict[str, tuple[int, ...]]:
    n, r, h, v = cfg.num_heads, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    return {"w": (n, r, h, h), "b": (n, r, h), "lm_head": (n, h, v)}


def init_heads(cfg: MedusaConfig, seed: int = 0, std: float = 0.02,
               lm_head: Any = None) -> dict[str, jax.Array]:  # fmt: skip
    """Random heads: w normal(std), b zero; lm_head normal(std), or every head starting
    from ``lm_head`` [H, V] (the target's, as Medusa initialises them)."""
    shapes = param_shapes(cfg)
    kw, kl = jax.random.split(jax.random.key(seed))
    lm = (std * jax.random.normal(kl, shapes["lm_head"], jnp.float32) if lm_head is None
          else jnp.broadcast_to(jnp.asarray(lm_head, jnp.float32), shapes["lm_head"]))  # fmt: skip
    return {"w": std * jax.random.normal(kw, shapes["w"], jnp.float32),
            "b": jnp.zeros(shapes["b"], jnp.float32), "lm_head": jnp.array(lm)}  # fmt: skip


def medusa_hidden(params: Any, features: jax.Array) -> jax.Array:
    """Each head's residual stack on features [S, H] -> float32 [S, N, H]."""
    w, b = params["w"], params["b"]
    n, r = w.shape[0], w.shape[1]
    y = jnp.broadcast_to(features.astype(jnp.float32)[:, None, :],
                         (features.shape[0], n, features.shape[-1]))  # fmt: skip
    for j in range(r):  # R is static and small (1 in vLLM's / Medusa's checkpoints)
        y = y + jax.nn.silu(jnp.einsum("snh,nhk->snk", y, w[:, j]) + b[None, :, j])
    return y


def medusa_logits(params: Any, features: jax.Array) -> jax.Array:
    """The heads' logits: features float[S, H] (post-norm) -> float32 [S, N, V]; head i
    (``[:, i]``) predicts the token i + 1 after the one the target predicts from them."""
    y = medusa_hidden(params, features)
    return jnp.einsum("snh,nhv->snv", y, params["lm_head"].astype(jnp.float32))


def save_heads(directory: str | Path, cfg: MedusaConfig, params: Any) -> Path:
    """Write config.json and model.safetensors (pagedjax's layout) into ``directory``."""
    from safetensors.numpy import save_file

    directory = Path(directory).expanduser()
    shapes = param_shapes(cfg)
    tensors = {k: np.ascontiguousarray(np.asarray(params[k], np.float32)) for k in shapes}
    for k, arr in tensors.items():
        if arr.shape != shapes[k]:
            raise ValueError(f"save_heads: {k} has shape {arr.shape}, expected {shapes[k]}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


_VLLM_NAME = re.compile(r"(?:medusa_heads\.)?(blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)"
                        r"|lm_heads\.(\d+)\.weight)")  # fmt: skip


def _from_vllm(got: dict[str, np.ndarray], cfg: MedusaConfig, bias: bool, shared: bool,
               where: str) -> dict[str, np.ndarray]:  # fmt: skip
    """vLLM-named tensors -> pagedjax's params (transposed to in x out)."""
    n, r, h, v = cfg.num_heads, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    want: dict[str, tuple[str, tuple, tuple[int, ...]]] = {}
    for i in range(n):
        for j in range(r):
            want[f"blocks.{i}.layers.{j}.weight"] = ("w", (i, j), (h, h))
            if bias:
                want[f"blocks.{i}.layers.{j}.bias"] = ("b", (i, j), (h,))
        if i == 0 or not shared:
            want[f"lm_heads.{i}.weight"] = ("lm_head", (i,), (v, h))
    names = {}
    for name in got:
        m = _VLLM_NAME.fullmatch(name)
        key = name.removeprefix("medusa_heads.") if m else None
        if key not in want:
            raise ValueError(f"{where}: unexpected tensor {name!r} (known: blocks.I.layers.R."
                             "weight/bias, lm_heads.I.weight, optionally medusa_heads.-prefixed;"
                             " a token_map is not built)")  # fmt: skip
        names[key] = name
    missing = sorted(set(want) - set(names))
    if missing:
        raise ValueError(f"{where}: tensors {missing[:4]} missing"
                         + (f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""))
    out = {k: np.zeros(s, np.float32) for k, s in param_shapes(cfg).items()}
    for key, (dest, idx, shape) in want.items():
        arr = np.asarray(got[names[key]], np.float32)
        if arr.shape != shape:
            raise ValueError(f"{where}: {names[key]} has shape {arr.shape}, expected {shape}")
        out[dest][idx] = arr if dest == "b" else arr.T
    if shared:
        out["lm_head"][1:] = out["lm_head"][0]
    return out


def load_heads(directory: str | Path, target: ModelArch) -> tuple[MedusaConfig, dict[str, Any]]:
    """(config, params) of the heads in ``directory`` (either layout, module docstring),
    checked against ``target``. FileNotFoundError / ValueError naming the directory and
    what is wrong."""
    directory = Path(directory).expanduser()
    cfg_path, weights = directory / "config.json", directory / "model.safetensors"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"medusa head directory {str(directory)!r} lacks config.json"
                                f" ({TRAIN_HINT})")  # fmt: skip
    if not weights.is_file():
        other = sorted(p.name for p in directory.glob("*") if p.suffix in (".bin", ".pt"))
        extra = f"; {other} found: convert to safetensors, .bin / .pt is not read" if other else ""
        raise FileNotFoundError(f"medusa head directory {str(directory)!r} lacks"
                                f" model.safetensors{extra} ({TRAIN_HINT})")  # fmt: skip
    data = json.loads(cfg_path.read_text())
    got = dict(load_tensors(weights))
    if is_vllm_layout(data):
        cfg, bias, shared = vllm_config(data, str(cfg_path))
        check_target(cfg, target)
        arrays = _from_vllm(got, cfg, bias, shared, str(weights))
    else:
        cfg = MedusaConfig.from_dict(data, where=str(cfg_path))
        check_target(cfg, target)
        shapes = param_shapes(cfg)
        if set(got) != set(shapes):
            odd = sorted(set(got) ^ set(shapes))
            raise ValueError(f"{weights}: tensors {odd} missing or unexpected"
                             f" (expected exactly {sorted(shapes)})")  # fmt: skip
        arrays = {}
        for k, s in shapes.items():
            if got[k].shape != s:
                raise ValueError(f"{weights}: {k} has shape {got[k].shape}, expected {s}")
            arrays[k] = np.array(got[k], np.float32)
    return cfg, {k: jnp.asarray(v) for k, v in arrays.items()}


__all__ = ["FORMAT", "MedusaConfig", "check_target", "init_heads", "is_vllm_layout",
           "load_heads", "medusa_hidden", "medusa_logits", "param_shapes", "save_heads",
           "vllm_config"]  # fmt: skip
