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
The encoder stack itself is vit.py's (shared with SigLIP, siglip.py); this module holds
CLIP's embeddings (CLS token, bias-free patch conv, pre_layrnorm) and LLaVA's selection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.vision.vit import (
    TensorReader,
    TowerArch,
    cast,
    convert_encoder_layers,
    encoder,
    layer_norm,
    patchify,
)

Params = Any  # nested dict of arrays


@dataclasses.dataclass(frozen=True)
class CLIPVisionArch(TowerArch):
    """The shape of a CLIP vision tower (HF CLIPVisionConfig's fields that matter)."""

    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> CLIPVisionArch:
        """From a CLIPVisionConfig dict (``vision_config`` of a LLaVA config.json); HF's other
        keys (dropout, initializer ranges, projection_dim) do not change the forward."""
        if config.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"not a CLIP vision config: model_type {config.get('model_type')!r}")
        return cls(**cls.hf_fields(config))


def convert_clip_tensors(
    arch: CLIPVisionArch, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32
) -> Params:
    """HF CLIPVisionModel tensors (keys starting ``embeddings.``, ``pre_layrnorm.``,
    ``encoder.layers.{i}.``, ``post_layernorm.``; callers strip ``vision_model.`` and
    outer prefixes) -> params. Linear kernels are stored [in, out]; the patch conv as a
    [C*p*p, hidden] matrix (a stride-p conv without bias is a matmul over patches).
    Raises ValueError naming missing tensors, shape mismatches or unexpected tensors."""
    h, p, c = arch.hidden_size, arch.patch_size, arch.num_channels
    reader = TensorReader(tensors, "CLIP")
    layers = convert_encoder_layers(arch.encoder_shape, arch.num_layers, reader)
    conv = reader.get("embeddings.patch_embedding.weight", (h, c, p, p))
    params = {
        "patch_embedding": conv.reshape(h, c * p * p).T,
        "class_embedding": reader.get("embeddings.class_embedding", (h,)),
        "position_embedding": reader.get(
            "embeddings.position_embedding.weight", (arch.num_patches + 1, h)
        ),
        "pre_layrnorm": reader.norm("pre_layrnorm", h),
        "layers": layers,  # stacked on a leading layer axis for lax.scan
    }
    # position_ids is a non-persistent buffer in new HF but saved by old checkpoints.
    reader.refuse_unused(lambda k: k.startswith("post_layernorm.") or k.endswith("position_ids"))
    return cast(params, dtype)


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


def clip_hidden_states(params: Params, pixel_values: jax.Array, arch: CLIPVisionArch) -> jax.Array:
    """[num_layers + 1, B, num_patches + 1, hidden]: HF's ``hidden_states`` tuple, stacked."""
    x = layer_norm(clip_embeddings(params, pixel_values, arch), params["pre_layrnorm"],
                   arch.layer_norm_eps)
    outs = encoder(x, params["layers"], arch.encoder_shape)
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
