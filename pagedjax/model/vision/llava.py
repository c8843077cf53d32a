"""LLaVA glue: the multi-modal projector (as transformers' ``LlavaMultiModalProjector``),
the prompt's image-placeholder expansion (as ``LlavaProcessor``) and the merge of image
embeddings into token embeddings (as ``LlavaModel.forward``'s masked_scatter).

Why the merge is a separate pure function: in the paged engine the text embeddings and the
image features are produced at different times (the encoder may run once per image and be
cached by content hash, docs/multimodal.md); the merge only needs the token ids, the
embeddings and the features in prompt order.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.config import ModelArch, arch_from_hf_config
from pagedjax.model.vision.clip import (
    CLIPVisionArch,
    clip_hidden_states,
    convert_clip_tensors,
    select_features,
)

Params = Any

_PROJECTOR_ACTS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class LlavaArch:
    """The vision side of a LLaVA config (the text side is the decoder's ModelArch)."""

    vision: CLIPVisionArch
    text_hidden_size: int
    image_token_id: int
    vision_feature_layer: int | tuple[int, ...] = -2
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self) -> None:
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(
                "vision_feature_select_strategy must be 'default' or 'full', got "
                f"{self.vision_feature_select_strategy!r}"
            )
        if self.projector_hidden_act not in _PROJECTOR_ACTS:
            raise ValueError(f"unsupported projector_hidden_act {self.projector_hidden_act!r}")

    @property
    def feature_layers(self) -> list[int]:
        fl = self.vision_feature_layer
        return [fl] if isinstance(fl, int) else list(fl)

    @property
    def num_image_tokens(self) -> int:
        """Features (= placeholder tokens) per image: patches, plus CLS for "full"."""
        n = self.vision.num_patches
        return n + 1 if self.vision_feature_select_strategy == "full" else n

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlavaArch:
        """From a LlavaConfig dict (config.json). Old checkpoints name the placeholder
        ``image_token_index``, new ones ``image_token_id``."""
        if config.get("model_type") != "llava":
            raise ValueError(f"not a LLaVA config: model_type {config.get('model_type')!r}")
        token = config.get("image_token_id", config.get("image_token_index"))
        if token is None:
            raise ValueError("LLaVA config names no image_token_id / image_token_index")
        fl = config.get("vision_feature_layer", -2)
        return cls(
            vision=CLIPVisionArch.from_hf(config["vision_config"]),
            text_hidden_size=config["text_config"]["hidden_size"],
            image_token_id=int(token),
            vision_feature_layer=fl if isinstance(fl, int) else tuple(fl),
            vision_feature_select_strategy=config.get("vision_feature_select_strategy", "default"),
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
            projector_bias=config.get("multimodal_projector_bias", True),
        )


# Where each part lives in LLaVA checkpoints: llava-hf hub checkpoints have
# "vision_tower.vision_model.", transformers 4.52+ in memory "model.vision_tower.vision_model.",
# transformers 5 saves "vision_tower." (CLIPVisionModel's inner keys). Longest first.
_VISION_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.",
                    "model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def split_llava_tensors(
    tensors: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A LLaVA checkpoint's tensors -> (vision tower, projector, language model), each with
    its prefix stripped; the language model's keys keep ``model.``/``lm_head.`` so the
    decoder's loader (hf_keys.canonical_tensors) reads them as a Llama checkpoint."""
    vision, projector, text = {}, {}, {}
    for k, x in tensors.items():
        for pre in _VISION_PREFIXES:
            if k.startswith(pre):
                vision[k[len(pre):]] = x
                break
        else:
            for pre in _PROJECTOR_PREFIXES:
                if k.startswith(pre):
                    projector[k[len(pre):]] = x
                    break
            else:
                for pre, new in (("model.language_model.", "model."),
                                 ("language_model.model.", "model."),
                                 ("language_model.lm_head.", "lm_head.")):
                    if k.startswith(pre):
                        text[new + k[len(pre):]] = x
                        break
                else:
                    text[k] = x  # lm_head.weight in new checkpoints
    return vision, projector, text


def convert_projector_tensors(
    arch: LlavaArch, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32
) -> Params:
    """``linear_1`` / ``linear_2`` (HF [out, in]) -> {"linear_1": {"kernel" [in, out],
    "bias"}, ...}. Raises ValueError on missing / mis-shaped / unexpected tensors."""
    d_in = arch.vision.hidden_size * len(arch.feature_layers)
    d = arch.text_hidden_size
    want = {"linear_1.weight": (d, d_in), "linear_2.weight": (d, d)}
    if arch.projector_bias:
        want |= {"linear_1.bias": (d,), "linear_2.bias": (d,)}
    for k, shape in want.items():
        if k not in tensors:
            raise ValueError(f"projector checkpoint is missing tensor {k!r}")
        if tuple(tensors[k].shape) != shape:
            raise ValueError(f"shape mismatch for projector {k!r}: {tensors[k].shape} vs {shape}")
    extra = set(tensors) - set(want)
    if extra:
        raise ValueError(f"projector checkpoint has unexpected tensors: {sorted(extra)}")
    out = {}
    for name in ("linear_1", "linear_2"):
        out[name] = {"kernel": jnp.asarray(np.asarray(tensors[f"{name}.weight"]).T, dtype)}
        if arch.projector_bias:
            out[name]["bias"] = jnp.asarray(tensors[f"{name}.bias"], dtype)
    return out


def project(params: Params, features: jax.Array, arch: LlavaArch) -> jax.Array:
    """linear_1 -> act -> linear_2: [..., vision_hidden * layers] -> [..., text_hidden]."""
    def dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        y = x @ p["kernel"]
        return y + p["bias"] if "bias" in p else y

    act = _PROJECTOR_ACTS[arch.projector_hidden_act]
    return dense(act(dense(features.astype(params["linear_1"]["kernel"].dtype),
                           params["linear_1"])), params["linear_2"])


def image_features(
    vision_params: Params, projector_params: Params, pixel_values: jax.Array, arch: LlavaArch
) -> jax.Array:
    """[B, 3, S, S] pixels -> [B, num_image_tokens, text_hidden]: transformers'
    ``get_image_features`` for one fixed image size (no image_sizes splitting)."""
    hs = clip_hidden_states(vision_params, pixel_values, arch.vision)
    feats = select_features(hs, arch.vision_feature_layer, arch.vision_feature_select_strategy)
    return project(projector_params, feats, arch)


def load_llava_vision(
    arch: LlavaArch, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32
) -> tuple[Params, Params, dict[str, np.ndarray]]:
    """(vision params, projector params, language-model tensors for the decoder loader)."""
    vision, projector, text = split_llava_tensors(tensors)
    return (convert_clip_tensors(arch.vision, vision, dtype),
            convert_projector_tensors(arch, projector, dtype), text)


def expand_image_tokens(
    token_ids: Sequence[int], image_token_id: int, num_image_tokens: int
) -> list[int]:
    """Each single placeholder becomes num_image_tokens copies (LlavaProcessor does this on
    the text before tokenizing; here on ids, which gives the same ids because the
    placeholder is one special token). Prompts already expanded must not be expanded again:
    call it once, on the user's prompt."""
    out: list[int] = []
    for t in token_ids:
        out.extend([t] * num_image_tokens if t == image_token_id else [t])
    return out


def merge_image_embeddings(
    token_ids: jax.Array, inputs_embeds: jax.Array, image_embeds: jax.Array, image_token_id: int
) -> jax.Array:
    """token_ids [T] (int), inputs_embeds [T, H], image_embeds [N, H] (all images'
    features, flattened in prompt order) -> [T, H] with the k-th placeholder row replaced by
    image_embeds[k]. Jittable (static shapes); the count check (placeholders == N), which
    HF raises on, is done eagerly when the ids are concrete."""
    mask = token_ids == image_token_id
    if not isinstance(token_ids, jax.core.Tracer):
        n = int(jnp.sum(mask))
        if n != image_embeds.shape[0]:
            raise ValueError(
                f"image features and image tokens do not match: tokens {n}, features "
                f"{image_embeds.shape[0]}"
            )
    if image_embeds.shape[0] == 0:  # text-only prompt: nothing to gather from
        return inputs_embeds
    # k-th placeholder reads row k; other rows read a clipped index and are discarded.
    idx = jnp.cumsum(mask) - 1
    gathered = jnp.take(image_embeds.astype(inputs_embeds.dtype),
                        jnp.clip(idx, 0, image_embeds.shape[0] - 1), axis=0)
    return jnp.where(mask[:, None], gathered, inputs_embeds)


def complete_sub_config(sub: dict[str, Any], default_type: str) -> dict[str, Any]:
    """A LLaVA config's ``text_config`` / ``vision_config`` with transformers' defaults
    filled in: llava-hf checkpoints store only the keys that differ from the default
    config class (e.g. a text_config of just model_type, vocab_size and
    max_position_embeddings), which transformers completes when it loads them."""
    from transformers import CONFIG_MAPPING

    model_type = sub.get("model_type", default_type)
    return CONFIG_MAPPING[model_type](**{k: v for k, v in sub.items() if k != "model_type"}
                                      ).to_dict()


def is_llava_checkpoint(directory: str | Path) -> bool:
    """True for a directory whose config.json is a LlavaConfig (model_type "llava")."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return False
    return json.loads(path.read_text()).get("model_type") == "llava"


def load_llava_checkpoint(
    directory: str | Path, dtype: Any = jnp.float32
) -> tuple[ModelArch, Params, LlavaArch, Params, Params]:
    """A LlavaForConditionalGeneration checkpoint directory (config.json + safetensors,
    as transformers' save_pretrained writes it) -> (text ModelArch, text params, LlavaArch,
    vision params, projector params), every tensor used exactly once (missing, mis-shaped
    or unexpected tensors raise ValueError, as the text loader does). The language model
    must be of the Llama family (the only one with ``inputs_embeds``)."""
    from pagedjax.model.loader import checkpoint_files, convert_hf_tensors
    from pagedjax.model.safetensors_io import load_tensors

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    config = dict(config)
    config["text_config"] = complete_sub_config(config.get("text_config", {}), "llama")
    config["vision_config"] = complete_sub_config(config.get("vision_config", {}),
                                                  "clip_vision_model")
    arch = LlavaArch.from_hf(config)
    text_arch = arch_from_hf_config(config["text_config"])
    if text_arch.family != "llama":
        raise ValueError(f"LLaVA over a {text_arch.model_type!r} language model is not built"
                         " (inputs_embeds: Llama family only)")
    if text_arch.hidden_size != arch.text_hidden_size:
        raise ValueError("text_config.hidden_size disagrees with the projector's output")
    tensors: dict[str, np.ndarray] = {}
    for f in checkpoint_files(directory):
        tensors.update(load_tensors(f))
    vision, projector, text = load_llava_vision(arch, tensors, dtype)
    return text_arch, convert_hf_tensors(text_arch, text, dtype), arch, vision, projector


def merge_cached_rows(
    text_embeds: jax.Array, cache: jax.Array, image_slot: jax.Array, image_row: jax.Array
) -> jax.Array:
    """The paged engine's merge for one step: text_embeds [T, H]; cache [C, N, H], the
    encoder cache's features (C images of N rows); image_slot int32[T], the cache entry
    whose row ``image_row[t]`` goes to token t, -1 for text tokens. A step holds any
    slice of an image's placeholder run (chunked prefill), so the host names the row of
    each token rather than counting placeholders here. Jittable; [T, H] in text_embeds'
    dtype."""
    slot = jnp.clip(image_slot, 0, cache.shape[0] - 1)
    row = jnp.clip(image_row, 0, cache.shape[1] - 1)
    rows = cache[slot, row].astype(text_embeds.dtype)
    return jnp.where((image_slot >= 0)[:, None], rows, text_embeds)


def image_prompt_info(directory: str | Path, tokenizer: Any) -> tuple[str, int] | None:
    """(placeholder text, image tokens per image) of a LLaVA checkpoint directory, for a
    front end that writes placeholders into chat text and budgets prompt lengths without
    loading the model (an API process); None for any other model. tokenizer: the
    model's (pagedjax.tokenizer), whose special token for image_token_id is the text."""
    if not is_llava_checkpoint(directory):
        return None
    config = json.loads((Path(directory) / "config.json").read_text())
    config["vision_config"] = complete_sub_config(config.get("vision_config", {}),
                                                  "clip_vision_model")
    config.setdefault("text_config", {}).setdefault("hidden_size", 0)
    arch = LlavaArch.from_hf(config)
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        text = hf.convert_ids_to_tokens(arch.image_token_id)
    else:
        text = tokenizer.decode([arch.image_token_id], skip_special_tokens=False)
    return text, arch.num_image_tokens
