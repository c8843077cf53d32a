"""An EAGLE-1 style draft head: one Llama decoder layer over the target's features.

EAGLE (Li et al., 2024) drafts in feature space: at position p the head reads the
target's feature f_p (the last hidden state *after* the final norm, i.e. exactly what
the LM head sees; EAGLE-1 reads the base model's ``outputs[0]``, which is post-norm)
and the embedding of the token that followed, x_{p+1}:

    h_p  = fc([embed(x_{p+1}); f_p])           # Linear(2H -> H, bias), as EAGLE-1
    g_p  = LlamaDecoderLayer(h_p | earlier h)   # causal attention over the head's own KV
    logits_p = lm_head(g_p)                     # the target's head, shared; predicts x_{p+2}

g_p is trained to regress f_{p+1}, so it is fed back as the feature for the next
position when drafting autoregressively. The target's embedding and LM head are shared
(not stored); the head adds ``fc`` and one decoder layer (SmolLM2-135M: ~4.6 M params).
Differences from EAGLE-1, for simplicity: the layer keeps its input RMSNorm (EAGLE-1
drops it in layer 0), and no final norm is applied to g (as EAGLE-1).

Stored as a directory: ``config.json`` (``EagleConfig``, unknown keys rejected) and
``model.safetensors`` with the tensors named by their Flax path joined with "." (e.g.
``fc.kernel``, ``layer.self_attn.q_proj.kernel``), float32.

**Truncated draft vocabulary** (FR-Spec, Zhao et al. 2025; EAGLE-3's d2t): with
``draft_vocab_size`` N > 0 the file also holds ``draft_vocab``, int32[N], distinct
ascending target ids (the most frequent in the target's own answers), and the head
scores only those rows of the LM head when drafting: on a CPU at batch 1 the full
head (SmolLM2: 49152 x 576 fp32, 113 MB read per drafted token) costs about a quarter
of a target step, 8192 rows a sixth of that. Verification still uses the target's full
distribution, so outputs are unchanged; a draft is always an id in the subset.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.attention import ragged_paged_attention
from pagedjax.model.config import ModelArch
from pagedjax.model.input import ModelInput
from pagedjax.model.layers import AttentionFn, KVPool, LayerInputs, linear
from pagedjax.model.llama import LlamaDecoderLayer
from pagedjax.model.safetensors_io import load_tensors

FORMAT = "pagedjax-eagle-1"


@dataclass(frozen=True)
class EagleConfig:
    """config.json of a head directory.

    format: always "pagedjax-eagle-1". target: the target model's name (informational).
    hidden_size, vocab_size: must equal the target's (checked at load).
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size: the decoder
    layer's sizes (the rest of the layer, RoPE and norm eps, is the target's).
    train: free-form training metadata (steps, loss, data), never read by the engine.
    draft_vocab_size: 0 = the draft scores the full vocabulary; N > 0 = only the N ids
    of the ``draft_vocab`` tensor (module docstring).
    """

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    format: str = FORMAT
    target: str = ""
    train: dict[str, Any] = field(default_factory=dict)
    draft_vocab_size: int = 0

    @classmethod
    def for_target(cls, arch: ModelArch, target: str = "") -> EagleConfig:
        """A head shaped like one of the target's layers."""
        return cls(arch.hidden_size, arch.vocab_size, arch.num_heads, arch.num_kv_heads,
                   arch.head_dim, arch.intermediate_size, target=target)  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config.json") -> EagleConfig:
        return head_config_from_dict(cls, data, where, FORMAT)

    def head_arch(self, target: ModelArch) -> ModelArch:
        """The one-layer arch the head's decoder layer runs with (checks the target)."""
        check_target(self, target)
        return dataclasses.replace(
            target, num_layers=1, layer_windows=(None,), num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
        )  # fmt: skip


def head_config_from_dict(cls: type, data: dict[str, Any], where: str, fmt: str) -> Any:
    """A head directory's config.json as ``cls`` (a dataclass with ``format``,
    ``vocab_size`` and ``draft_vocab_size``): ValueError naming unknown or missing keys, a
    format other than ``fmt`` or a draft vocabulary outside [0, vocab_size]."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(names)}")
    missing = sorted(
        f.name for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        and f.name not in data
    )  # fmt: skip
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    cfg = cls(**data)
    if cfg.format != fmt:
        raise ValueError(f"{where}: format {cfg.format!r}, expected {fmt!r}")
    if not 0 <= cfg.draft_vocab_size <= cfg.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size {cfg.draft_vocab_size} is not in"
                         f" [0, vocab_size {cfg.vocab_size}]")  # fmt: skip
    return cfg


def check_target(cfg: EagleConfig, target: ModelArch) -> None:
    """ValueError naming the mismatch when the head cannot run on ``target``."""
    check_feature_target("eagle head", cfg, target)


def check_feature_target(what: str, cfg: Any, target: ModelArch) -> None:
    """ValueError naming the mismatch when a drafter on the target's final features
    (``what``: "eagle head", "medusa heads"; ``cfg`` with hidden_size and vocab_size)
    cannot run on ``target``: the features come from a dense Llama-family target's
    final norm (``spec.eagle.forward_with_features``), and the sizes must match."""
    if target.family != "llama" or target.num_experts or target.sandwich_norms:
        raise ValueError(
            f"{what}: target model_type {target.model_type!r} is not supported (a dense"
            " Llama-family target without Gemma 2's norms)"
        )
    for name in ("hidden_size", "vocab_size"):
        if getattr(cfg, name) != getattr(target, name):
            raise ValueError(
                f"{what}: {name} {getattr(cfg, name)} does not match the target's"
                f" {getattr(target, name)} (trained for another model?)"
            )


class EagleHead(nn.Module):
    """apply({'params': p}, kv, features [T, H], next_embeds [T, H], batch) ->
    (kv', g [T, H]). kv: the head's own pool, (k, v) each [1, num_blocks, Hkv, B, D];
    batch: a ragged ModelInput (its tokens are unused: the inputs are the embeddings)."""

    arch: ModelArch  # head_arch(...): one layer
    param_dtype: Any = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention

    @nn.compact
    def __call__(self, kv: KVPool, features: jax.Array, next_embeds: jax.Array,
                 batch: ModelInput) -> tuple[KVPool, jax.Array]:  # fmt: skip
        a, pd = self.arch, self.param_dtype
        x = jnp.concatenate([next_embeds.astype(features.dtype), features], axis=-1)
        x = linear(a.hidden_size, "fc", bias=True, param_dtype=pd)(x)
        layer = LlamaDecoderLayer(a, pd, self.attention_fn, True, name="layer")
        inputs = LayerInputs(index=jnp.int32(0), window=jnp.int32(0))
        (x, k_pool, v_pool), _ = layer((x, *kv), inputs, batch)
        return (k_pool, v_pool), x


def init_head(cfg: EagleConfig, target: ModelArch, seed: int = 0, std: float = 0.02) -> Any:
    """Random head params (normal(std) matrices, unit norm gains, zero biases); fc
    starts as [0; I] so an untrained head passes the target's feature through."""
    arch = cfg.head_arch(target)
    module = EagleHead(arch)
    h = arch.hidden_size
    pool = (jnp.zeros((1, 1, arch.num_kv_heads, 1, arch.head_dim), jnp.float32),) * 2
    x = jnp.zeros((1, h), jnp.float32)
    shapes = jax.eval_shape(
        lambda: module.init(jax.random.key(0), pool, x, x, _dummy_input())["params"]
    )
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for k, (path, s) in zip(keys, leaves, strict=True):
        name = path[-1].key
        if name == "weight":
            out.append(jnp.ones(s.shape, jnp.float32))
        elif name == "bias":
            out.append(jnp.zeros(s.shape, jnp.float32))
        else:
            out.append(std * jax.random.normal(k, s.shape, jnp.float32))
    params = jax.tree_util.tree_unflatten(treedef, out)
    eye = jnp.concatenate([jnp.zeros((h, h)), jnp.eye(h)], axis=0)
    params["fc"]["kernel"] = eye + params["fc"]["kernel"] * 0.1
    return params


def _dummy_input() -> ModelInput:
    z = jnp.zeros((1,), jnp.int32)
    return ModelInput(
        tokens=z, positions=z, slot_mapping=z, block_tables=jnp.zeros((1, 1), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32), cu_q_lens=jnp.asarray([0, 1], jnp.int32),
        logits_indices=z,
    )  # fmt: skip


def flatten_params(params: Any) -> dict[str, np.ndarray]:
    """A parameter tree as {"a.b.c": float32 array}: the checkpoints' tensor names."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {".".join(p.key for p in path): np.asarray(v, np.float32) for path, v in flat}


def check_draft_vocab(vocab: np.ndarray, cfg: EagleConfig, where: str) -> np.ndarray:
    """``vocab`` as int32[draft_vocab_size], or ValueError naming what is wrong (a
    shape other than the config's, ids out of range, not strictly ascending)."""
    vocab = np.asarray(vocab)
    if vocab.shape != (cfg.draft_vocab_size,) or not np.issubdtype(vocab.dtype, np.integer):
        raise ValueError(
            f"{where}: draft_vocab has shape {vocab.shape} ({vocab.dtype}), expected"
            f" int32[{cfg.draft_vocab_size}] (config draft_vocab_size)"
        )
    if vocab.size and (vocab.min() < 0 or vocab.max() >= cfg.vocab_size):
        raise ValueError(f"{where}: draft_vocab ids outside [0, {cfg.vocab_size})")
    if np.any(np.diff(vocab) <= 0):
        raise ValueError(f"{where}: draft_vocab ids must be distinct and ascending")
    return vocab.astype(np.int32)


def save_head(directory: str | Path, cfg: EagleConfig, params: Any,
              draft_vocab: np.ndarray | None = None) -> Path:  # fmt: skip
    """Write config.json and model.safetensors into ``directory`` (created);
    ``draft_vocab`` (int32[cfg.draft_vocab_size]) is required iff draft_vocab_size > 0."""
    return write_head(directory, cfg, dataclasses.asdict(cfg), params, draft_vocab)


def write_head(directory: str | Path, cfg: Any, config_json: dict[str, Any], params: Any,
               draft_vocab: np.ndarray | None) -> Path:  # fmt: skip
    """A head checkpoint in pagedjax's layout, for EAGLE and EAGLE-3 alike: ``config_json``
    as config.json, the flattened ``params`` (float32) and the checked ``draft_vocab`` as
    model.safetensors in ``directory`` (created). ``cfg`` is the head's config (its
    ``vocab_size`` / ``draft_vocab_size`` check the ids); the draft vocabulary is
    required iff ``draft_vocab_size`` > 0."""
    from safetensors.numpy import save_file

    directory = Path(directory).expanduser()
    tensors = flatten_params(params)
    if cfg.draft_vocab_size or draft_vocab is not None:
        if draft_vocab is None:
            raise ValueError("save_head: draft_vocab_size > 0 needs the draft_vocab ids")
        tensors["draft_vocab"] = check_draft_vocab(draft_vocab, cfg, "save_head")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def load_head(
    directory: str | Path, target: ModelArch
) -> tuple[EagleConfig, Any, np.ndarray | None]:
    """(config, params, draft_vocab) of the head in ``directory``, checked against
    ``target``; draft_vocab int32[N] or None (the full vocabulary).
    FileNotFoundError / ValueError naming the directory and what is wrong."""
    directory = Path(directory).expanduser()
    cfg_path, weights = directory / "config.json", directory / "model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise FileNotFoundError(
                f"eagle head directory {str(directory)!r} lacks {p.name} (train one with"
                " `python -m pagedjax.tools.train_eagle`)"
            )
    cfg = EagleConfig.from_dict(json.loads(cfg_path.read_text()), where=str(cfg_path))
    cfg.head_arch(target)  # checks hidden / vocab sizes
    want = flatten_params(jax.tree.map(np.asarray, init_head(cfg, target)))
    got = dict(load_tensors(weights))
    vocab = got.pop("draft_vocab", None)
    if (vocab is None) != (cfg.draft_vocab_size == 0):
        raise ValueError(f"{weights}: draft_vocab tensor {'absent' if vocab is None else 'present'}"
                         f" but config draft_vocab_size is {cfg.draft_vocab_size}")  # fmt: skip
    if vocab is not None:
        vocab = check_draft_vocab(vocab, cfg, str(weights))
    if set(got) != set(want):
        odd = sorted(set(got) ^ set(want))
        raise ValueError(f"{weights}: tensors {odd} missing or unexpected")
    params: dict[str, Any] = {}
    for name, arr in got.items():
        if arr.shape != want[name].shape:
            shape = want[name].shape
            raise ValueError(f"{weights}: {name} has shape {arr.shape}, expected {shape}")
        node = params
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(np.array(arr, np.float32))
    return cfg, params, vocab


__all__ = ["EagleConfig", "EagleHead", "check_draft_vocab", "check_target", "flatten_params",
           "init_head", "load_head", "save_head", "write_head"]  # fmt: skip
