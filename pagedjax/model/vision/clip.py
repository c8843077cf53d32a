"""CLIP ViT vision tower as pure functions over a params pytree, equal to transformers'
``CLIPVisionModel`` (the tower LLaVA uses).

Contract: ``clip_hidden_states(params, pixel_values, arch)`` with pixel_values
[B, 3, image_size, image_size] (NCHW, as CLIPImageProcessor returns) gives
[num_layers + 1, B, num_patches + 1, hidden]: index 0 is the pre-layernormed embeddings,
index i the output of encoder layer i, exactly HF's ``hidden_states`` tuple, so LLaVA's
``vision_feature_layer`` (e.g. -2) indexes it the same way. Token 0 is the CLS token.
Compute runs in the params' dtype; softmax in fp32. post_layernorm is not applied (LLaVA
reads hidden states, never the pooled output); its tensors are accepted and ignored.

Why pure functions over stacked layers rather than a Flax module: the tower runs once per
image, outside the paged KV cache, and a ``lax.scan`` over stacked layer weights keeps the
compiled program one layer long whatever the depth (as the decoder's layer loop does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = Any  # nested dict of arrays

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


@dataclasses.dataclass(frozen=True)
class CLIPVisionArch:
    """The shape of a CLIP vision tower (HF CLIPVisionConfig's fields that matter)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} not divisible by {self.num_heads} heads"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} not a multiple of patch_size {self.patch_size}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}"
            )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> CLIPVisionArch:
        """From a CLIPVisionConfig dict (``vision_config`` of a LLaVA config.json); HF's other
        keys (dropout, initializer ranges, projection_dim) do not change the forward."""
        if config.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"not a CLIP vision config: model_type {config.get('model_type')!r}")
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            image_size=config["image_size"],
            patch_size=config["patch_size"],
            num_channels=config.get("num_channels", 3),
            layer_norm_eps=config.get("layer_norm_eps", 1e-5),
            hidden_act=config.get("hidden_act", "quick_gelu"),
        )


_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
_LAYER_NORMS = ("layer_norm1", "layer_norm2")


def convert_clip_tensors(
    arch: CLIPVisionArch, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32
) -> Params:
    """HF CLIPVisionModel tensors (keys starting ``embeddings.``, ``pre_layrnorm.``,
    ``encoder.layers.{i}.``, ``post_layernorm.``; callers strip ``vision_model.`` and
    outer prefixes) -> params. Linear kernels are stored [in, out]; the patch conv as a
    [C*p*p, hidden] matrix (a stride-p conv without bias is a matmul over patches).
    Raises ValueError naming missing tensors, shape mismatches or unexpected tensors."""
    h, p, c = arch.hidden_size, arch.patch_size, arch.num_channels
    used: set[str] = set()

    def get(key: str, shape: tuple[int, ...]) -> np.ndarray:
        if key not in tensors:
            raise ValueError(f"CLIP checkpoint is missing tensor {key!r}")
        used.add(key)
        x = np.asarray(tensors[key])
        if x.shape != shape:
            raise ValueError(
                f"shape mismatch for {key!r}: checkpoint {x.shape}, config implies {shape}"
            )
        return x

    def cast(tree: Any) -> Any:
        return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {"scale": get(f"{prefix}.weight", (h,)), "bias": get(f"{prefix}.bias", (h,))}

    sizes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
             "self_attn.out_proj": (h, h), "mlp.fc1": (arch.intermediate_size, h),
             "mlp.fc2": (h, arch.intermediate_size)}
    layers = []
    for i in range(arch.num_layers):
        pre = f"encoder.layers.{i}"
        layer: dict[str, Any] = {}
        for name in _LAYER_LINEARS:
            out_f, in_f = sizes[name]
            layer[name.split(".")[1]] = {
                "kernel": get(f"{pre}.{name}.weight", (out_f, in_f)).T,
                "bias": get(f"{pre}.{name}.bias", (out_f,)),
            }
        for name in _LAYER_NORMS:
            layer[name] = norm(f"{pre}.{name}")
        layers.append(layer)
    conv = get("embeddings.patch_embedding.weight", (h, c, p, p))
    params = {
        "patch_embedding": conv.reshape(h, c * p * p).T,
        "class_embedding": get("embeddings.class_embedding", (h,)),
        "position_embedding": get(
            "embeddings.position_embedding.weight", (arch.num_patches + 1, h)
        ),
        "pre_layrnorm": norm("pre_layrnorm"),
        # Stacked on a leading layer axis for lax.scan.
        "layers": jax.tree.map(lambda *xs: np.stack(xs), *layers),
    }
    # position_ids is a non-persistent buffer in new HF but saved by old checkpoints.
    ignored = {k for k in tensors if k.startswith("post_layernorm.") or k.endswith("position_ids")}
    extra = set(tensors) - used - ignored
    if extra:
        raise ValueError(f"CLIP checkpoint has tensors the config does not use: {sorted(extra)}")
    return cast(params)


def _layer_norm(x: jax.Array, p: dict[str, jax.Array], eps: float) -> jax.Array:
    # Statistics in fp32 (HF's LayerNorm under autocast does the same).
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return x @ p["kernel"] + p["bias"]


def patchify(pixel_values: jax.Array, patch_size: int) -> jax.Array:
    """[B, C, H, W] -> [B, (H/p)*(W/p), C*p*p], patches row-major and each patch flattened
    (C, p, p) as the conv weight is, so patches @ W.reshape(h, -1).T equals the conv."""
    b, c, hh, ww = pixel_values.shape
    p = patch_size
    x = pixel_values.reshape(b, c, hh // p, p, ww // p, p)
    x = x.transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hh // p) * (ww // p), c * p * p)


def clip_embeddings(params: Params, pixel_values: jax.Array, arch: CLIPVisionArch) -> jax.Array:
    """[B, C, H, W] -> [B, num_patches + 1, hidden] (CLS first, position embeddings added,
    before pre_layrnorm)."""
    want = (arch.num_channels, arch.image_size, arch.image_size)
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != want:
        raise ValueError(
            f"pixel_values must be [B, {want[0]}, {want[1]}, {want[2]}], got {pixel_values.shape}"
        )
    dtype = params["patch_embedding"].dtype
    patches = patchify(pixel_values.astype(dtype), arch.patch_size) @ params["patch_embedding"]
    cls = jnp.broadcast_to(params["class_embedding"], (patches.shape[0], 1, arch.hidden_size))
    return jnp.concatenate([cls, patches], axis=1) + params["position_embedding"]


def _encoder_layer(x: jax.Array, p: Params, arch: CLIPVisionArch) -> jax.Array:
    b, n, h = x.shape
    heads, d = arch.num_heads, arch.head_dim
    y = _layer_norm(x, p["layer_norm1"], arch.layer_norm_eps)
    split = lambda t: t.reshape(b, n, heads, d)
    q = split(_dense(y, p["q_proj"]))
    k = split(_dense(y, p["k_proj"]))
    v = split(_dense(y, p["v_proj"]))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * d**-0.5
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)  # no mask: every patch sees all
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, h)
    x = x + _dense(attn, p["out_proj"])
    y = _layer_norm(x, p["layer_norm2"], arch.layer_norm_eps)
    y = _dense(_ACTIVATIONS[arch.hidden_act](_dense(y, p["fc1"])), p["fc2"])
    return x + y


def clip_hidden_states(params: Params, pixel_values: jax.Array, arch: CLIPVisionArch) -> jax.Array:
    """[num_layers + 1, B, num_patches + 1, hidden]: HF's ``hidden_states`` tuple, stacked."""
    x = _layer_norm(clip_embeddings(params, pixel_values, arch), params["pre_layrnorm"],
                    arch.layer_norm_eps)

    def step(carry: jax.Array, layer: Params) -> tuple[jax.Array, jax.Array]:
        out = _encoder_layer(carry, layer, arch)
        return out, out

    _, outs = jax.lax.scan(step, x, params["layers"])
    return jnp.concatenate([x[None], outs], axis=0)


def select_features(
    hidden_states: jax.Array, feature_layer: int | Sequence[int], strategy: str
) -> jax.Array:
    """LLaVA's feature selection: the hidden state(s) at ``feature_layer`` (negative counts
    from the end; a list concatenates along hidden), CLS dropped for "default", kept for
    "full". -> [B, N, hidden * len(layers)]."""
    if strategy not in ("default", "full"):
        raise ValueError(
            f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}"
        )
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    n = hidden_states.shape[0]
    for i in layers:
        if not -n <= i < n:
            raise ValueError(f"vision_feature_layer {i} out of range for {n} hidden states")
    feats = [hidden_states[i] for i in layers]
    if strategy == "default":
        feats = [f[:, 1:] for f in feats]
    return jnp.concatenate(feats, axis=-1)
