"""Model architecture description, parsed from a Hugging Face config.json or a named preset."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

# HF model_type -> our implementation. The rotary pre-norm decoders (Llama, Mistral, Qwen2/3,
# Phi-3, Gemma 2, Mixtral) share llama.py, switched by the feature fields of ModelArch; OPT and
# GPT-NeoX have their own modules (docs/model_families.md).
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "phi3": "llama",
    "gemma2": "llama",
    "mixtral": "llama",
    "opt": "opt",
    "gpt_neox": "gpt_neox",
}
# HF config.json `architectures[0]` -> model_type it must come with.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "MixtralForCausalLM": "mixtral",
    "OPTForCausalLM": "opt",
    "GPTNeoXForCausalLM": "gpt_neox",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
MOE_DISPATCHES = ("dense", "grouped")


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """Everything the forward needs to know about a model; hashable so jit can close over it.

    ``layer_windows[i]`` is the sliding window of layer i (None: full attention).
    ``rope_scaling`` is a sorted tuple of (key, value) pairs of HF's rope parameters, or None.
    OPT-only fields (word_embed_proj_dim, do_layer_norm_before, ...) are ignored by Llama.
    The feature fields after them default to plain Llama; each names the family that needs
    it. ``moe_dispatch`` is not architecture but the way the MoE layer runs ("dense": every
    expert on every token, weighted by a mostly-zero combine matrix; "grouped": tokens sorted
    by expert and one grouped matmul), kept here so jit's cache key includes it.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    layer_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # OPT
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    final_layer_norm: bool = True
    layer_norm_affine: bool = True
    # Rotary families' features (defaults: Llama)
    rotary_pct: float = 1.0  # GPT-NeoX rotary_pct, Phi-3 partial_rotary_factor
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    norm_unit_offset: bool = False  # Gemma: RMSNorm gain is (1 + weight)
    sandwich_norms: bool = False  # Gemma 2: norms after attention and MLP too
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden) in the compute dtype
    query_pre_attn_scalar: float | None = None  # Gemma 2: sm_scale = scalar ** -0.5
    attn_soft_cap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_soft_cap: float | None = None  # Gemma 2: same on the logits
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    num_experts: int = 0  # Mixtral: experts per MoE layer (0: dense MLP)
    experts_per_token: int = 2  # Mixtral: top-k
    moe_dispatch: str = "dense"
    # Qwen2-VL's M-RoPE: the rotary frequencies split in (temporal, height, width) sections
    # (HF's mrope_section, summing to rotary_dim / 2), each turned by its own position row
    # (model/rope.py). None: one position per token (every other family).
    mrope_section: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(
                f"unknown architecture model_type={self.model_type!r}; "
                f"supported: {sorted(FAMILIES)}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if len(self.layer_windows) != self.num_layers:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        if self.rope_type == "longrope":
            raise ValueError(
                "Phi-3 long-rope scaling (rope_scaling type 'longrope', the 128k-context "
                "checkpoints) is not implemented; the 4k-context Phi-3 checkpoints (no "
                "rope_scaling) are supported"
            )
        if not 0 < self.rotary_pct <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"rotary_pct={self.rotary_pct} must be in (0, 1] and give an even rotary "
                f"dimension (head_dim={self.head_dim})"
            )
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be in [1, num_experts="
                f"{self.num_experts}]"
            )
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(
                f"moe_dispatch must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}"
            )
        if self.mrope_section is not None and (
            len(self.mrope_section) != 3 or sum(self.mrope_section) != self.rotary_dim // 2
        ):
            raise ValueError(
                f"mrope_section {self.mrope_section} must be 3 sections summing to rotary_dim"
                f" / 2 = {self.rotary_dim // 2}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; "
                f"supported: {SUPPORTED_ROPE_TYPES}"
            )

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling or ()).get("rope_type", "default")

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that RoPE rotates (HF: int(head_dim * pct))."""
        return int(self.head_dim * self.rotary_pct)

    @property
    def sliding_window(self) -> int | None:
        """The window if any layer slides (Mistral: all layers), else None."""
        windows = {w for w in self.layer_windows if w is not None}
        return max(windows) if windows else None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def kv_bytes_per_token(self, dtype: Any) -> int:
        """Bytes of K and V one token occupies in the cache across all layers."""
        itemsize = np.dtype(dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelArch:
        d = json.loads(text)
        d["rope_scaling"] = _freeze(d["rope_scaling"])
        d["layer_windows"] = tuple(d["layer_windows"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        if d.get("mrope_section") is not None:
            d["mrope_section"] = tuple(d["mrope_section"])
        return cls(**d)


def _freeze(mapping: dict | list | None) -> tuple[tuple[str, Any], ...] | None:
    if not mapping:
        return None
    items = mapping.items() if isinstance(mapping, dict) else mapping
    return tuple(sorted((str(k), v) for k, v in items))


def _rope(cfg: dict) -> tuple[float, tuple | None]:
    """(theta, scaling) from either transformers>=5 `rope_parameters` or older
    `rope_theta` + `rope_scaling` (what most checkpoints on disk carry)."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if not params and cfg.get("rope_scaling"):
        params = dict(cfg["rope_scaling"])
    if "type" in params and "rope_type" not in params:  # legacy key
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, _freeze(params)


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _require(cfg: dict, key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config is missing required field {key!r}")
    return cfg[key]


def _check_architecture(cfg: dict) -> str:
    """The config's model_type, after checking it and `architectures` name a supported
    family; the error lists the supported architectures."""
    model_type = cfg.get("model_type")
    names = cfg.get("architectures") or []
    supported = f"supported architectures: {sorted(ARCHITECTURES)}"
    if model_type not in FAMILIES:
        raise ValueError(
            f"unknown architecture model_type={model_type!r} (architectures={names}); "
            f"{supported}"
        )
    for name in names[:1]:
        if name not in ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {name!r} (model_type={model_type!r}); {supported}"
            )
        if ARCHITECTURES[name] != model_type:
            raise ValueError(
                f"config names architecture {name!r} but model_type={model_type!r} (expected "
                f"{ARCHITECTURES[name]!r})"
            )
    return model_type


def _partial_rotary(cfg: dict, default: float = 1.0) -> float:
    params = cfg.get("rope_parameters") or {}
    for value in (params.get("partial_rotary_factor"), cfg.get("partial_rotary_factor"),
                  cfg.get("rotary_pct")):  # fmt: skip
        if value is not None:
            return float(value)
    return default


def _layer_windows(cfg: dict, model_type: str, layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows: HF's `layer_types` when present, else the family's rule."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if model_type in ("mistral", "phi3", "mixtral"):
        return (window,) * layers
    if model_type == "gemma2":  # HF's default: layers 0, 2, 4, ... slide
        return tuple(window if (i + 1) % 2 else None for i in range(layers))
    return (None,) * layers


def arch_from_hf_config(cfg: dict) -> ModelArch:
    """Builds a ModelArch from the dict of a Hugging Face config.json."""
    model_type = _check_architecture(cfg)
    layers = int(_require(cfg, "num_hidden_layers"))
    heads = int(_require(cfg, "num_attention_heads"))
    hidden = int(_require(cfg, "hidden_size"))
    tied_default = model_type in ("opt", "gemma2")  # the HF config classes' defaults
    common = dict(
        model_type=model_type,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied_default)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
    )
    if model_type == "opt":
        proj = int(cfg.get("word_embed_proj_dim") or hidden)
        act = cfg.get("activation_function", "relu")
        pre_ln = bool(cfg.get("do_layer_norm_before", True))
        return ModelArch(
            **common,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=int(_require(cfg, "ffn_dim")),
            norm_eps=1e-5,  # torch.nn.LayerNorm default, which HF's OPT uses
            hidden_act=act,
            qkv_bias=bool(cfg.get("enable_bias", True)),
            o_bias=bool(cfg.get("enable_bias", True)),
            mlp_bias=bool(cfg.get("enable_bias", True)),
            word_embed_proj_dim=proj,
            do_layer_norm_before=pre_ln,
            final_layer_norm=pre_ln and not cfg.get("_remove_final_layer_norm", False),
            layer_norm_affine=bool(cfg.get("layer_norm_elementwise_affine", True)),
        )
    theta, scaling = _rope(cfg)
    if model_type == "gpt_neox":
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta")
                      or cfg.get("rotary_emb_base") or theta)  # fmt: skip
        bias = bool(cfg.get("attention_bias", True))
        return ModelArch(
            **common,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=int(_require(cfg, "intermediate_size")),
            norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            hidden_act=cfg.get("hidden_act", "gelu"),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=True,
            rotary_pct=_partial_rotary(cfg, default=0.25),
            parallel_residual=bool(cfg.get("use_parallel_residual", True)),
        )
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    attention_bias = bool(cfg.get("attention_bias", False))
    act = cfg.get("hidden_act", "silu")
    gemma = model_type == "gemma2"
    if gemma:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return ModelArch(
        **common,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(cfg, "intermediate_size")),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        hidden_act=act,
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        layer_windows=_layer_windows(cfg, model_type, layers),
        rotary_pct=_partial_rotary(cfg),
        qk_norm=model_type == "qwen3",
        norm_unit_offset=gemma,
        sandwich_norms=gemma,
        embed_scale=gemma,
        query_pre_attn_scalar=(
            float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None
        ),
        # HF Gemma2Config's defaults (50, 30) when absent; an explicit null turns a cap off.
        attn_soft_cap=cfg.get("attn_logit_softcapping", 50.0) if gemma else None,
        final_soft_cap=cfg.get("final_logit_softcapping", 30.0) if gemma else None,
        num_experts=int(cfg.get("num_local_experts", 0)) if model_type == "mixtral" else 0,
        experts_per_token=int(cfg.get("num_experts_per_tok", 2)),
    )


def load_arch(directory: str | Path) -> ModelArch:
    """Reads <directory>/config.json into a ModelArch."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config.json not found in checkpoint directory {directory}")
    return arch_from_hf_config(json.loads(path.read_text()))
