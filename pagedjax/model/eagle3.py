"""An EAGLE-3 draft head (Li et al., 2025): features fused from three target layers.

EAGLE-3 reads the target's residual stream at a low, a middle and a high layer instead
of its last feature only. With F_p = [a_p; b_p; c_p] (the three [H] states at position
p, concatenated: 3H) and x the tokens:

    h_p   = fc(F_p)                                     # Linear(3H -> H, no bias)
    u     = [input_layernorm(embed(x_{p+1})); hidden_norm(h_p)]          # 2H
    r     = h_p + self_attn(u | earlier positions)     # q/k/v_proj read 2H
    g_p   = r + mlp(post_attention_layernorm(r))       # the head's output (pre-norm)
    logits_p = lm_head(norm(g_p))                       # its own norm and LM head; x_{p+2}

(vLLM 0.32's ``llama_eagle3.py`` with ``norm_before_residual`` false, its default.)
When drafting beyond the first token the head's own g replaces fc(F) as the hidden
input (EAGLE-3's rule: the head's output is fed back, not regressed onto the target's
feature; training unrolls this, ``tools/train_eagle3.py``). The embedding is the
target's (shared, not stored); the head stores fc, one decoder layer ("midlayer"), its
final ``norm`` and its ``lm_head`` over a draft vocabulary.

**Which layers** (``aux_layers``, vLLM's indexing, which its
``get_eagle3_aux_hidden_state_layers`` defaults to (2, L // 2, L - 3)): id j is the
residual stream *entering* layer j (0: the embeddings; L, an extension: after the last
layer, before the final norm), three ids, strictly ascending (vLLM concatenates them
in layer order). SmolLM2-135M (L = 30): (2, 15, 27).

**Draft vocabulary** (EAGLE-3's d2t): with ``draft_vocab_size`` N > 0 the LM head has N
rows for ``draft_vocab`` (int32[N], distinct ascending target ids; vLLM's ``d2t`` is
the offset ``draft_vocab - arange(N)``); 0 = the full vocabulary (N = V rows).

Two layouts, read by ``load_head``:

* pagedjax's own (``save_head``): ``config.json`` = ``Eagle3Config`` (format
  "pagedjax-eagle-3", unknown keys rejected) and ``model.safetensors``, float32,
  tensors named by their Flax path (``fc.kernel`` [3H, H], ``midlayer.self_attn.q_proj.
  kernel`` [2H, heads * D], ``norm.weight``, ``lm_head.kernel`` [H, N]) plus
  ``draft_vocab`` when N > 0.
* vLLM / EAGLE-3's checkpoint names (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): an HF
  Llama config with ``num_hidden_layers`` 1 and ``draft_vocab_size`` (architectures
  naming Eagle3 or ``draft_vocab_size`` present), tensors ``fc.weight``, ``midlayer.*``
  (torch's out x in, transposed at load), ``norm.weight``, ``lm_head.weight`` [N, H],
  ``d2t`` int[N] and optionally ``t2d`` bool[V] (checked against d2t); bf16 / fp16 are
  read as float32. Refused by name: ``norm_before_residual``, more than one layer, a
  ``target_hidden_size`` other than hidden_size, attention / MLP biases, the draft's own
  ``embed_tokens``, a ``rope_theta`` other than the target's, unknown config keys or
  tensors, a t2d disagreeing with d2t.
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
from pagedjax.model.eagle import (
    check_draft_vocab,
    check_feature_target,
    flatten_params,
    head_config_from_dict,
    write_head,
)
from pagedjax.model.input import ModelInput
from pagedjax.model.layers import AttentionFn, KVPool, RMSNorm, linear
from pagedjax.model.llama import GatedMLP, RotaryAttention
from pagedjax.model.safetensors_io import load_tensors

FORMAT = "pagedjax-eagle-3"
TRAIN_HINT = "train one with `python -m pagedjax.tools.train_eagle3`"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default choice for a target of ``num_layers`` layers: (2, L // 2, L - 3)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """config.json of pagedjax's head directory.

    hidden_size, vocab_size: must equal the target's. num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size: the head's layer (RoPE and norm
    eps are the target's). aux_layers: the three target layer ids fused (module
    docstring). draft_vocab_size: 0 = full vocabulary, N > 0 = the ``draft_vocab``
    tensor's N ids. train: free-form training metadata, never read by the engine.
    """

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    aux_layers: tuple[int, ...]
    format: str = FORMAT
    target: str = ""
    train: dict[str, Any] = field(default_factory=dict)
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))

    @classmethod
    def for_target(cls, arch: ModelArch, target: str = "",
                   aux_layers: tuple[int, ...] | None = None) -> Eagle3Config:  # fmt: skip
        """A head shaped like one of the target's layers, on vLLM's default layers."""
        aux = default_aux_layers(arch.num_layers) if aux_layers is None else aux_layers
        return cls(arch.hidden_size, arch.vocab_size, arch.num_heads, arch.num_kv_heads,
                   arch.head_dim, arch.intermediate_size, tuple(aux), target=target)  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config.json") -> Eagle3Config:
        return head_config_from_dict(cls, data, where, FORMAT)

    @property
    def draft_rows(self) -> int:
        """Rows of the head's LM head: N, or V for the full vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    def head_arch(self, target: ModelArch) -> ModelArch:
        """The one-layer arch of the head's layer (checks the target). No biases and no
        q/k norm whatever the target has: vLLM's EAGLE-3 layer is a plain Llama one."""
        check_target(self, target)
        return dataclasses.replace(
            target, num_layers=1, layer_windows=(None,), num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, qkv_bias=False, o_bias=False,
            mlp_bias=False, qk_norm=False,
        )  # fmt: skip


def check_target(cfg: Eagle3Config, target: ModelArch) -> None:
    """ValueError naming the mismatch when the head cannot run on ``target``: sizes, a
    non-Llama target, aux layer ids that are not three strictly ascending ids in
    [0, num_layers]."""
    check_feature_target("eagle3 head", cfg, target)
    aux = cfg.aux_layers
    if (len(aux) != 3 or any(b <= a for a, b in zip(aux, aux[1:], strict=False))
            or aux[0] < 0 or aux[-1] > target.num_layers):  # fmt: skip
        raise ValueError(
            f"eagle3 head: aux_layers {list(aux)} must be three strictly ascending layer ids"
            f" in [0, {target.num_layers}] (the target's num_layers; vLLM's default"
            f" {list(default_aux_layers(target.num_layers))})"
        )


class Eagle3Layer(nn.Module):
    """The head's decoder layer: (embeds [T, H], hidden [T, H], kv, batch) -> (g [T, H],
    kv'). Attention reads [input_layernorm(embeds); hidden_norm(hidden)] (2H), the
    residual stream starts from ``hidden`` (module docstring)."""

    arch: ModelArch
    param_dtype: Any
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, embeds: jax.Array, hidden: jax.Array, kv: KVPool,
                 batch: ModelInput) -> tuple[jax.Array, KVPool]:  # fmt: skip
        a, pd = self.arch, self.param_dtype
        norm = lambda name: RMSNorm(a.norm_eps, pd, name=name)
        u = jnp.concatenate([norm("input_layernorm")(embeds.astype(hidden.dtype)),
                             norm("hidden_norm")(hidden)], axis=-1)  # fmt: skip
        h, kv = RotaryAttention(a, pd, self.attention_fn, name="self_attn")(
            u, kv, jnp.int32(0), None, batch
        )
        r = hidden + h
        return r + GatedMLP(a, pd, name="mlp")(norm("post_attention_layernorm")(r)), kv


class Eagle3Head(nn.Module):
    """apply({'params': p}, kv, hidden, embeds [T, H], batch) -> (kv', g [T, H]).

    hidden: the fused target features [T, 3H] (fc applies) or the head's own earlier
    output g [T, H] (fed back as is, EAGLE-3's drafting rule). kv: the head's own pool,
    (k, v) each [1, num_blocks, Hkv, B, D]; batch: a ragged ModelInput (its tokens are
    unused: the embeddings come in). p needs only "fc" and "midlayer"; the final norm
    and LM head are ``head_logits``'."""

    arch: ModelArch  # Eagle3Config.head_arch(...)
    param_dtype: Any = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention

    @nn.compact
    def __call__(self, kv: KVPool, hidden: jax.Array, embeds: jax.Array,
                 batch: ModelInput) -> tuple[KVPool, jax.Array]:  # fmt: skip
        a = self.arch
        if hidden.shape[-1] != a.hidden_size:  # fused features (3H): vLLM's combine step
            hidden = linear(a.hidden_size, "fc", bias=False, param_dtype=self.param_dtype)(hidden)
        g, kv = Eagle3Layer(a, self.param_dtype, self.attention_fn, name="midlayer")(
            embeds, hidden, kv, batch
        )
        return kv, g


def head_logits(params: Any, g: jax.Array, eps: float) -> jax.Array:
    """fp32 logits [..., N] over the head's draft vocabulary: lm_head(norm(g)).
    params: the head's {"norm": {"weight"}, "lm_head": {"kernel" [H, N]}}."""
    x = RMSNorm(eps).apply({"params": params["norm"]}, g)
    return jnp.dot(x, params["lm_head"]["kernel"]).astype(jnp.float32)


def module_params(params: Any) -> dict[str, Any]:
    """The part of the head's params ``Eagle3Head`` reads (fc, midlayer)."""
    return {k: params[k] for k in ("fc", "midlayer")}


def init_head(cfg: Eagle3Config, target: ModelArch, seed: int = 0, std: float = 0.02) -> Any:
    """Random head params (normal(std) matrices, unit norm gains). fc starts near
    [0; 0; I] (the highest of the three features passed through), so an untrained head
    starts from the target's upper residual stream; lm_head is random (training copies
    the target's rows for the draft vocabulary)."""
    arch = cfg.head_arch(target)
    module = Eagle3Head(arch)
    h = arch.hidden_size
    pool = (jnp.zeros((1, 1, arch.num_kv_heads, 1, arch.head_dim), jnp.float32),) * 2
    dummy = ModelInput(
        tokens=jnp.zeros((1,), jnp.int32), positions=jnp.zeros((1,), jnp.int32),
        slot_mapping=jnp.zeros((1,), jnp.int32), block_tables=jnp.zeros((1, 1), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32), cu_q_lens=jnp.asarray([0, 1], jnp.int32),
        logits_indices=jnp.zeros((1,), jnp.int32),
    )  # fmt: skip
    shapes = jax.eval_shape(lambda: module.init(
        jax.random.key(0), pool, jnp.zeros((1, 3 * h)), jnp.zeros((1, h)), dummy)["params"])
    shapes = dict(shapes, norm={"weight": jax.ShapeDtypeStruct((h,), jnp.float32)},
                  lm_head={"kernel": jax.ShapeDtypeStruct((h, cfg.draft_rows), jnp.float32)})
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for k, (path, s) in zip(keys, leaves, strict=True):
        if path[-1].key == "weight":
            out.append(jnp.ones(s.shape, jnp.float32))
        else:
            out.append(std * jax.random.normal(k, s.shape, jnp.float32))
    params = jax.tree_util.tree_unflatten(treedef, out)
    eye = jnp.concatenate([jnp.zeros((2 * h, h)), jnp.eye(h)], axis=0)
    params["fc"]["kernel"] = eye + params["fc"]["kernel"] * 0.1
    return params


def _nest(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for name, arr in flat.items():
        node = params
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(np.array(arr, np.float32))
    return params


def save_head(directory: str | Path, cfg: Eagle3Config, params: Any,
              draft_vocab: np.ndarray | None = None) -> Path:  # fmt: skip
    """Write config.json and model.safetensors (pagedjax's layout) into ``directory``;
    ``draft_vocab`` (int32[cfg.draft_vocab_size]) is required iff draft_vocab_size > 0."""
    data = dataclasses.asdict(cfg) | {"aux_layers": list(cfg.aux_layers)}
    return write_head(directory, cfg, data, params, draft_vocab)


# vLLM / EAGLE-3 layout: config keys read, and keys accepted as harmless HF metadata.
VLLM_READ = frozenset({
    "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "num_hidden_layers", "draft_vocab_size", "rope_theta",
    "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "target_hidden_size",
    "attention_bias", "mlp_bias", "hidden_act", "rms_norm_eps", "logit_scale",
})  # fmt: skip
VLLM_IGNORED = frozenset({
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "max_position_embeddings", "pretraining_tp", "rope_scaling",
    "tie_word_embeddings", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "attention_dropout", "mlp_dropout", "_name_or_path",
})  # fmt: skip


def is_vllm_layout(data: dict[str, Any]) -> bool:
    """config.json of a vLLM / EAGLE-3 checkpoint rather than pagedjax's own."""
    arch_names = " ".join(str(a) for a in data.get("architectures", ()))
    return "eagle3" in arch_names.lower() or "draft_vocab_size" in data and "format" not in data


def vllm_config(data: dict[str, Any], target: ModelArch, where: str) -> Eagle3Config:
    """Eagle3Config of a vLLM-layout config.json; ValueError naming an unknown key or a
    setting not built."""
    unknown = sorted(set(data) - VLLM_READ - VLLM_IGNORED)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} for an EAGLE-3 config;"
                         f" known: {sorted(VLLM_READ | VLLM_IGNORED)}")  # fmt: skip
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
        if key not in data:
            raise ValueError(f"{where}: an EAGLE-3 config needs {key}")
    checks = [
        ("num_hidden_layers", data.get("num_hidden_layers", 1) == 1, "more than one layer"),
        ("norm_before_residual", not data.get("norm_before_residual", False),
         "norm_before_residual"),
        ("target_hidden_size", data.get("target_hidden_size", data["hidden_size"])
         == data["hidden_size"], "a target_hidden_size other than hidden_size"),
        ("attention_bias", not data.get("attention_bias", False), "attention biases"),
        ("mlp_bias", not data.get("mlp_bias", False), "MLP biases"),
        ("hidden_act", data.get("hidden_act", "silu") == "silu", "an activation but silu"),
        ("logit_scale", float(data.get("logit_scale", 1.0)) == 1.0, "logit_scale != 1"),
        ("rope_theta", float(data.get("rope_theta", target.rope_theta)) == target.rope_theta,
         f"a rope_theta other than the target's {target.rope_theta}"),
    ]  # fmt: skip
    for key, ok, what in checks:
        if not ok:
            raise ValueError(f"{where}: {key} {data.get(key)!r}: {what} is not built")
    heads = int(data["num_attention_heads"])
    h, v = int(data["hidden_size"]), int(data["vocab_size"])
    n = int(data.get("draft_vocab_size") or v)
    aux = data.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers)
    return Eagle3Config(
        h, v, heads, int(data.get("num_key_value_heads", heads)),
        int(data.get("head_dim") or h // heads), int(data["intermediate_size"]), tuple(aux),
        target=str(data.get("_name_or_path", "")), draft_vocab_size=0 if n == v else n,
    )  # fmt: skip


def _from_vllm(got: dict[str, np.ndarray], cfg: Eagle3Config, want: dict[str, np.ndarray],
               where: str) -> tuple[dict[str, np.ndarray], np.ndarray | None]:  # fmt: skip
    """vLLM-named tensors -> (pagedjax's flat params, draft_vocab or None)."""
    got = dict(got)
    if "embed_tokens.weight" in got:
        raise ValueError(f"{where}: embed_tokens.weight: a head with its own embedding is not"
                         " built (the target's is shared)")  # fmt: skip
    d2t, t2d = got.pop("d2t", None), got.pop("t2d", None)
    names = {k.replace(".kernel", ".weight"): k for k in want}
    odd = sorted(set(got) ^ set(names))
    if odd:
        raise ValueError(f"{where}: tensors {odd} missing or unexpected (expected"
                         f" {sorted(names)} plus d2t / t2d)")  # fmt: skip
    flat = {}
    for name, key in names.items():
        kernel = key.endswith(".kernel")  # torch Linear weights are out x in
        shape = want[key].T.shape if kernel else want[key].shape
        if tuple(got[name].shape) != shape:
            raise ValueError(f"{where}: {name} has shape {got[name].shape}, expected {shape}")
        arr = np.asarray(got[name], np.float32)
        flat[key] = arr.T if kernel else arr
    n, v = cfg.draft_rows, cfg.vocab_size
    if cfg.draft_vocab_size == 0:
        if d2t is not None and np.any(np.asarray(d2t)):
            raise ValueError(f"{where}: d2t maps ids but draft_vocab_size equals vocab_size")
        return flat, None
    if d2t is None:
        raise ValueError(f"{where}: d2t missing (draft_vocab_size {n} < vocab_size {v})")
    d2t = np.asarray(d2t)
    if d2t.shape != (n,) or not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"{where}: d2t has shape {d2t.shape} ({d2t.dtype}), expected int[{n}]")
    ids = np.arange(n, dtype=np.int64) + d2t.astype(np.int64)  # vLLM: target = i + d2t[i]
    if ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != n:
        raise ValueError(f"{where}: d2t maps to target ids outside [0, {v}) or to one id twice")
    if t2d is not None:
        t2d = np.asarray(t2d)
        mask = np.zeros(v, bool)
        mask[ids] = True
        if t2d.shape != (v,) or not np.array_equal(t2d.astype(bool), mask):
            raise ValueError(f"{where}: t2d does not mark exactly the ids d2t maps to")
    order = np.argsort(ids, kind="stable")  # pagedjax keeps the ids ascending
    flat["lm_head.kernel"] = flat["lm_head.kernel"][:, order]
    return flat, ids[order].astype(np.int32)


def load_head(
    directory: str | Path, target: ModelArch
) -> tuple[Eagle3Config, Any, np.ndarray | None]:
    """(config, params, draft_vocab) of the head in ``directory`` (either layout),
    checked against ``target``; draft_vocab int32[N] or None (the full vocabulary).
    FileNotFoundError / ValueError naming the directory and what is wrong."""
    directory = Path(directory).expanduser()
    cfg_path, weights = directory / "config.json", directory / "model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise FileNotFoundError(f"eagle3 head directory {str(directory)!r} lacks"
                                    f" {p.name} ({TRAIN_HINT})")  # fmt: skip
    data = json.loads(cfg_path.read_text())
    vllm = is_vllm_layout(data)
    if vllm:
        cfg = vllm_config(data, target, str(cfg_path))
    else:
        cfg = Eagle3Config.from_dict(data, where=str(cfg_path))
    cfg.head_arch(target)  # checks sizes and aux layers
    want = flatten_params(jax.tree.map(np.asarray, init_head(cfg, target)))
    got = dict(load_tensors(weights))
    if vllm:
        flat, vocab = _from_vllm(got, cfg, want, str(weights))
        return cfg, _nest(flat), vocab
    vocab = got.pop("draft_vocab", None)
    if (vocab is None) != (cfg.draft_vocab_size == 0):
        raise ValueError(f"{weights}: draft_vocab tensor {'absent' if vocab is None else 'present'}"
                         f" but config draft_vocab_size is {cfg.draft_vocab_size}")  # fmt: skip
    if vocab is not None:
        vocab = check_draft_vocab(vocab, cfg, str(weights))
    if set(got) != set(want):
        raise ValueError(f"{weights}: tensors {sorted(set(got) ^ set(want))} missing or unexpected")
    for name, arr in got.items():
        if arr.shape != want[name].shape:
            raise ValueError(f"{weights}: {name} has shape {arr.shape}, expected"
                             f" {want[name].shape}")  # fmt: skip
    return cfg, _nest(got), vocab


__all__ = ["FORMAT", "Eagle3Config", "Eagle3Head", "Eagle3Layer", "check_target",
           "default_aux_layers", "head_logits", "init_head", "is_vllm_layout", "load_head",
           "module_params", "save_head", "vllm_config"]  # fmt: skip
