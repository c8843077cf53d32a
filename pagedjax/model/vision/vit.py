"""The pre-norm ViT encoder that CLIP's and SigLIP's vision towers share, as pure
functions over a params pytree: patchify (a stride-p conv as a matmul over flattened
patches), LayerNorm, and a ``lax.scan`` over stacked encoder layers (layer_norm1 ->
full bidirectional self-attention -> residual; layer_norm2 -> fc1 -> act -> fc2 ->
residual), each exactly transformers' ``CLIPEncoderLayer`` / ``SiglipEncoderLayer``
(the two are the same computation).

Contract: hidden states are [B, N, hidden] in the params' dtype; LayerNorm statistics
and the attention softmax run in fp32. No attention mask: every token sees every token
(images with padded patches are refused by the towers, not masked here).

Why a module of its own: CLIP (clip.py) and SigLIP (siglip.py) differ only in their
embeddings (CLS token, pre-layernorm, patch bias, post-layernorm); the encoder stack and
its tensor conversion are one piece of code, tested through both towers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = Any  # nested dict of arrays

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


@dataclasses.dataclass(frozen=True)
class EncoderShape:
    """What an encoder layer's forward needs from a tower's config (hashable: a static
    jit argument)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} not divisible by {self.num_heads} heads"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {sorted(ACTIVATIONS)}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class TowerArch:
    """The shape of a ViT vision tower (the HF vision config fields that matter); CLIP and
    SigLIP subclass it with their own defaults for ``layer_norm_eps`` / ``hidden_act``."""

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
        _ = self.encoder_shape  # raises on heads not dividing hidden, unknown hidden_act
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} not a multiple of patch_size {self.patch_size}"
            )

    @property
    def encoder_shape(self) -> EncoderShape:
        return EncoderShape(self.hidden_size, self.intermediate_size, self.num_heads,
                            self.layer_norm_eps, self.hidden_act)  # fmt: skip

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def hf_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The constructor's arguments from an HF vision config dict; optional keys fall
        back to this class's defaults (HF's for the family)."""
        d = {f.name: f.default for f in dataclasses.fields(cls)}
        return dict(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            image_size=config["image_size"],
            patch_size=config["patch_size"],
            num_channels=config.get("num_channels", d["num_channels"]),
            layer_norm_eps=config.get("layer_norm_eps", d["layer_norm_eps"]),
            hidden_act=config.get("hidden_act", d["hidden_act"]),
        )


_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
_LAYER_NORMS = ("layer_norm1", "layer_norm2")


class TensorReader:
    """Reads HF tensors by key with their expected shape, remembering which were used, so
    a converter can refuse the tensors it never read. ``what`` names the checkpoint part
    in the errors."""

    def __init__(self, tensors: dict[str, np.ndarray], what: str):
        self.tensors, self.what, self.used = tensors, what, set()

    def get(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as numpy; ValueError when missing or of another shape."""
        if key not in self.tensors:
            raise ValueError(f"{self.what} checkpoint is missing tensor {key!r}")
        self.used.add(key)
        x = np.asarray(self.tensors[key])
        if x.shape != shape:
            raise ValueError(
                f"shape mismatch for {key!r}: checkpoint {x.shape}, config implies {shape}"
            )
        return x

    def norm(self, prefix: str, size: int) -> dict[str, np.ndarray]:
        """A LayerNorm's {"scale", "bias"}."""
        return {"scale": self.get(f"{prefix}.weight", (size,)),
                "bias": self.get(f"{prefix}.bias", (size,))}  # fmt: skip

    def refuse_unused(self, ignored: Callable[[str], bool] = lambda k: False) -> None:
        """ValueError naming every tensor neither read nor ``ignored``."""
        extra = sorted(k for k in self.tensors if k not in self.used and not ignored(k))
        if extra:
            raise ValueError(f"{self.what} checkpoint has tensors the config does not use: {extra}")


def convert_encoder_layers(shape: EncoderShape, num_layers: int, reader: TensorReader
                           ) -> Params:  # fmt: skip
    """``encoder.layers.{i}.*`` (HF Linear weights [out, in]) -> one pytree whose leaves
    are stacked on a leading layer axis (for ``lax.scan``); kernels stored [in, out]."""
    h, f = shape.hidden_size, shape.intermediate_size
    sizes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
             "self_attn.out_proj": (h, h), "mlp.fc1": (f, h), "mlp.fc2": (h, f)}
    layers = []
    for i in range(num_layers):
        pre = f"encoder.layers.{i}"
        layer: dict[str, Any] = {}
        for name in _LAYER_LINEARS:
            out_f, in_f = sizes[name]
            layer[name.split(".")[1]] = {
                "kernel": reader.get(f"{pre}.{name}.weight", (out_f, in_f)).T,
                "bias": reader.get(f"{pre}.{name}.bias", (out_f,)),
            }
        for name in _LAYER_NORMS:
            layer[name] = reader.norm(f"{pre}.{name}", h)
        layers.append(layer)
    return jax.tree.map(lambda *xs: np.stack(xs), *layers)


def cast(tree: Any, dtype: Any) -> Any:
    """Every leaf as a jnp array of ``dtype``."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def layer_norm(x: jax.Array, p: dict[str, jax.Array], eps: float) -> jax.Array:
    """LayerNorm over the last axis; statistics in fp32 (as HF's under autocast); the
    result in x's dtype."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """x @ kernel (+ bias when the params have one)."""
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def patchify(pixel_values: jax.Array, patch_size: int) -> jax.Array:
    """[B, C, H, W] -> [B, (H/p)*(W/p), C*p*p], patches row-major and each patch flattened
    (C, p, p) as the conv weight is, so patches @ W.reshape(h, -1).T equals the conv."""
    b, c, hh, ww = pixel_values.shape
    p = patch_size
    x = pixel_values.reshape(b, c, hh // p, p, ww // p, p)
    x = x.transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hh // p) * (ww // p), c * p * p)


def encoder_layer(x: jax.Array, p: Params, shape: EncoderShape) -> jax.Array:
    """One pre-norm encoder layer: [B, N, hidden] -> [B, N, hidden]."""
    b, n, h = x.shape
    heads, d = shape.num_heads, shape.head_dim
    y = layer_norm(x, p["layer_norm1"], shape.layer_norm_eps)
    split = lambda t: t.reshape(b, n, heads, d)
    q = split(dense(y, p["q_proj"]))
    k = split(dense(y, p["k_proj"]))
    v = split(dense(y, p["v_proj"]))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * d**-0.5
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)  # no mask: every patch sees all
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, h)
    x = x + dense(attn, p["out_proj"])
    y = layer_norm(x, p["layer_norm2"], shape.layer_norm_eps)
    y = dense(ACTIVATIONS[shape.hidden_act](dense(y, p["fc1"])), p["fc2"])
    return x + y


def encoder(x: jax.Array, layers: Params, shape: EncoderShape) -> jax.Array:
    """The stacked layers over x [B, N, hidden] -> [num_layers, B, N, hidden]: every
    layer's output (HF's ``hidden_states[1:]``)."""

    def step(carry: jax.Array, layer: Params) -> tuple[jax.Array, jax.Array]:
        out = encoder_layer(carry, layer, shape)
        return out, out

    return jax.lax.scan(step, x, layers)[1]


def encoder_last(x: jax.Array, layers: Params, shape: EncoderShape) -> jax.Array:
    """The stacked layers over x [B, N, hidden] -> the last layer's output [B, N, hidden]
    (``encoder(...)[-1]`` without keeping the others)."""

    def step(carry: jax.Array, layer: Params) -> tuple[jax.Array, None]:
        return encoder_layer(carry, layer, shape), None

    return jax.lax.scan(step, x, layers)[0]
