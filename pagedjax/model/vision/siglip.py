"""SigLIP vision tower as pure functions over a params pytree, equal to transformers'
``Idefics3VisionTransformer`` (SmolVLM / Idefics3's tower) and ``SiglipVisionModel``'s
``vision_model`` on full, unpadded images.

Contract: ``siglip_hidden_states(params, pixel_values, arch)`` with pixel_values
[B, 3, image_size, image_size] (NCHW, as the image processors return) gives
[num_layers + 1, B, num_patches, hidden]: index 0 the embeddings (patch conv with bias +
position embeddings; no CLS token, no pre-layernorm), index i the output of encoder
layer i; ``siglip_last_hidden_state`` gives the last layer's output after
``post_layernorm`` [B, num_patches, hidden] (HF's ``last_hidden_state``, what Idefics3's
connector reads). Compute runs in the params' dtype; LayerNorm statistics and softmax
in fp32. The encoder stack is vit.py's (shared with CLIP).

Not built: images smaller than image_size (Idefics3's NaViT-style variable resolution:
a ``patch_attention_mask`` with padded patches, fractional position buckets, masked
attention). ``check_full_image`` refuses such a pixel mask with a ValueError. For a full
image HF's position buckets are, in exact arithmetic, patch i of the row-major grid ->
position i (what SiglipVisionEmbeddings uses); this module uses exactly that. HF computes
the buckets in float32 (``torch.bucketize`` over ``torch.arange`` boundaries) and on some
grid sizes gets off-by-one buckets whose values depend on the platform's float rounding
(on this x86 CPU: 19, 25, 29, 31, ... patches a side); the grids of released
checkpoints (26: Idefics3-8B, 27: SmolVLM 384 px / patch 14, 32: SmolVLM 512 px /
patch 16) give exactly the identity (tests/test_vision_siglip.py pins it).

The pooling head of ``SiglipVisionModel`` (``head.*``, attention pooling) gives a pooled
vector no VLM here reads: its tensors are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
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
    encoder_last,
    layer_norm,
    patchify,
)

Params = Any  # nested dict of arrays

# SiglipVisionConfig and Idefics3VisionConfig share every field that changes the forward.
VISION_MODEL_TYPES = ("siglip_vision_model", "idefics3_vision")


@dataclasses.dataclass(frozen=True)
class SiglipVisionArch(TowerArch):
    """The shape of a SigLIP vision tower (HF SiglipVisionConfig / Idefics3VisionConfig's
    fields that matter; HF's defaults)."""

    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> SiglipVisionArch:
        """From a SiglipVisionConfig / Idefics3VisionConfig dict (``vision_config`` of a
        config.json, completed with HF's defaults). A non-square image_size or patch_size
        (lists) is refused."""
        model_type = config.get("model_type", "siglip_vision_model")
        if model_type not in VISION_MODEL_TYPES:
            raise ValueError(f"not a SigLIP vision config: model_type {model_type!r}")
        for key in ("image_size", "patch_size"):
            if not isinstance(config[key], int):
                raise ValueError(f"vision_config.{key} {config[key]!r}: only square (an int)"
                                 " is built")  # fmt: skip
        return cls(**cls.hf_fields(config))


def convert_siglip_tensors(
    arch: SiglipVisionArch, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32
) -> Params:
    """HF tensors of the tower (keys starting ``embeddings.``, ``encoder.layers.{i}.``,
    ``post_layernorm.``; callers strip ``model.vision_model.`` or ``vision_model.``) ->
    params. The patch conv becomes a [C*p*p, hidden] matrix plus its bias; linear kernels
    [in, out], layers stacked for ``lax.scan``. Raises ValueError naming missing tensors,
    shape mismatches or unexpected tensors (``head.*``, SiglipVisionModel's pooling head,
    and saved ``position_ids`` buffers are ignored)."""
    h, p, c = arch.hidden_size, arch.patch_size, arch.num_channels
    reader = TensorReader(tensors, "SigLIP")
    layers = convert_encoder_layers(arch.encoder_shape, arch.num_layers, reader)
    conv = reader.get("embeddings.patch_embedding.weight", (h, c, p, p))
    params = {
        "patch_embedding": {"kernel": conv.reshape(h, c * p * p).T,
                            "bias": reader.get("embeddings.patch_embedding.bias", (h,))},
        "position_embedding": reader.get(
            "embeddings.position_embedding.weight", (arch.num_patches, h)
        ),
        "layers": layers,
        "post_layernorm": reader.norm("post_layernorm", h),
    }
    reader.refuse_unused(lambda k: k.startswith("head.") or k.endswith("position_ids"))
    return cast(params, dtype)


def check_full_image(pixel_attention_mask: np.ndarray | None, patch_size: int) -> None:
    """ValueError unless every patch of every image holds at least one valid pixel (HF's
    patch mask, ``get_image_features``: a patch is valid when any of its pixels is).
    pixel_attention_mask: [B, H, W] (1 = valid) as Idefics3's image processor returns it,
    or None (every pixel valid)."""
    if pixel_attention_mask is None:
        return
    m = np.asarray(pixel_attention_mask).astype(bool)
    b, hh, ww = m.shape
    p = patch_size
    patches = m[:, : hh // p * p, : ww // p * p].reshape(b, hh // p, p, ww // p, p).any((2, 4))
    if not patches.all():
        raise ValueError(
            "images with padded patches (a pixel_attention_mask that is not all ones) are not"
            " built: each image must fill the vision tower's image_size x image_size"
        )


def siglip_embeddings(params: Params, pixel_values: jax.Array, arch: SiglipVisionArch
                      ) -> jax.Array:  # fmt: skip
    """[B, C, S, S] -> [B, num_patches, hidden]: patch conv (with bias) + position
    embedding of each patch's row-major index."""
    want = (arch.num_channels, arch.image_size, arch.image_size)
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != want:
        raise ValueError(
            f"pixel_values must be [B, {want[0]}, {want[1]}, {want[2]}], got {pixel_values.shape}"
        )
    pe = params["patch_embedding"]
    patches = patchify(pixel_values.astype(pe["kernel"].dtype), arch.patch_size)
    return patches @ pe["kernel"] + pe["bias"] + params["position_embedding"]


def siglip_hidden_states(params: Params, pixel_values: jax.Array, arch: SiglipVisionArch
                         ) -> jax.Array:  # fmt: skip
    """[num_layers + 1, B, num_patches, hidden]: the embeddings, then every encoder
    layer's output (HF's ``hidden_states``), before post_layernorm."""
    x = siglip_embeddings(params, pixel_values, arch)
    return jnp.concatenate([x[None], encoder(x, params["layers"], arch.encoder_shape)])


def siglip_last_hidden_state(params: Params, pixel_values: jax.Array, arch: SiglipVisionArch
                             ) -> jax.Array:  # fmt: skip
    """[B, num_patches, hidden]: the last layer's output after post_layernorm (HF's
    ``last_hidden_state``)."""
    x = siglip_embeddings(params, pixel_values, arch)
    x = encoder_last(x, params["layers"], arch.encoder_shape)
    return layer_norm(x, params["post_layernorm"], arch.layer_norm_eps)
