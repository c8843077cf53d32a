"""Idefics3 / SmolVLM glue: the config (``Idefics3Config``), the checkpoint's tensor
split, the connector (pixel shuffle + a bias-free linear, transformers'
``Idefics3Connector``), ``image_features`` (= ``Idefics3Model.get_image_features`` on
full tiles), the image preprocessing through the checkpoint's ``Idefics3ImageProcessor``
(PIL backend) and the prompt text that replaces one ``<image>`` (as
``Idefics3Processor.replace_image_token`` writes it).

An image becomes one or more *tiles*, each [3, S, S] with S the tower's image_size:
without image splitting (``do_image_splitting=False``) the whole image resized to S x S
(one "global" tile); with splitting, rows x cols crops of the image resized to a
multiple of S, then the global tile last. Each tile gives ``num_image_tokens`` (HF's
``image_seq_len`` = (S / patch)^2 / scale_factor^2) feature rows, and the prompt holds,
for each tile in the same order, a run of that many ``<image>`` tokens:

  no splitting:  <fake_token_around_image><global-img><image>*n<fake_token_around_image>
  rows x cols:   for each row: (<fake_token_around_image><row_r_col_c><image>*n) per
                 column, then "\\n"; then "\\n<fake_token_around_image><global-img>
                 <image>*n<fake_token_around_image>"

The language model is of the Llama family (SmolLM2 / Llama 3) and loads with the
decoder's loader from the ``model.text_model.*`` and ``lm_head.*`` tensors.

Not built: images whose tiles do not fill S x S (a pixel_attention_mask with padded
patches, siglip.py refuses it), Idefics2 (perceiver resampler), SmolVLM2's "smolvlm"
model_type, video.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.config import ModelArch, arch_from_hf_config
from pagedjax.model.vision.siglip import (
    SiglipVisionArch,
    check_full_image,
    convert_siglip_tensors,
    siglip_last_hidden_state,
)

Params = Any

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"


@dataclasses.dataclass(frozen=True)
class Idefics3Arch:
    """The vision side of an Idefics3 config (the text side is the decoder's ModelArch)."""

    vision: SiglipVisionArch
    text_hidden_size: int
    image_token_id: int
    scale_factor: int = 2

    def __post_init__(self) -> None:
        if self.scale_factor < 1 or self.vision.patches_per_side % self.scale_factor:
            raise ValueError(
                f"scale_factor {self.scale_factor} does not divide the tower's"
                f" {self.vision.patches_per_side} patches a side"
            )

    @property
    def num_image_tokens(self) -> int:
        """Feature rows (= ``<image>`` tokens) per tile: HF's ``image_seq_len``."""
        return self.vision.num_patches // self.scale_factor**2

    @property
    def connector_in(self) -> int:
        return self.vision.hidden_size * self.scale_factor**2

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Idefics3Arch:
        """From an Idefics3Config dict (config.json) whose ``vision_config`` and
        ``text_config`` are complete (``complete_idefics3_config``)."""
        if config.get("model_type") != "idefics3":
            raise ValueError(f"not an Idefics3 config: model_type {config.get('model_type')!r}")
        return cls(
            vision=SiglipVisionArch.from_hf(config["vision_config"]),
            text_hidden_size=config["text_config"]["hidden_size"],
            image_token_id=int(config.get("image_token_id", 128257)),  # HF's default
            scale_factor=int(config.get("scale_factor", 2)),
        )


def complete_idefics3_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers reads it (``Idefics3Config.from_dict``): checkpoints
    may store only the sub-config keys that differ from the defaults. The text model's
    ``tie_word_embeddings`` becomes the top-level flag (HF ties ``lm_head`` to the text
    embeddings by the top-level one); its ``architectures`` is dropped."""
    from transformers import CONFIG_MAPPING

    if config.get("model_type") != "idefics3":
        raise ValueError(f"not an Idefics3 config: model_type {config.get('model_type')!r}")
    full = CONFIG_MAPPING["idefics3"].from_dict(config).to_dict()
    full["text_config"]["tie_word_embeddings"] = bool(full.get("tie_word_embeddings", False))
    # The text model is built from its model_type (HF: AutoModel.from_config); SmolVLM's
    # text_config names a training-time class ("VLlama3ForCausalLM") no loader knows.
    full["text_config"].pop("architectures", None)
    return full


def split_idefics3_tensors(
    tensors: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """An Idefics3ForConditionalGeneration checkpoint's tensors -> (vision tower,
    connector, language model), prefixes stripped; the language model's keys become
    ``model.*`` / ``lm_head.*`` (a Llama checkpoint for the decoder's loader). A tensor
    under none of ``model.vision_model.``, ``model.connector.``, ``model.text_model.``,
    ``lm_head.`` is refused (ValueError)."""
    vision, connector, text = {}, {}, {}
    for k, x in tensors.items():
        if k.startswith("model.vision_model."):
            vision[k[len("model.vision_model."):]] = x
        elif k.startswith("model.connector."):
            connector[k[len("model.connector."):]] = x
        elif k.startswith("model.text_model."):
            text["model." + k[len("model.text_model."):]] = x
        elif k.startswith("lm_head."):
            text[k] = x
        else:
            raise ValueError(f"Idefics3 checkpoint has an unexpected tensor {k!r}")
    return vision, connector, text


def convert_connector_tensors(
    arch: Idefics3Arch, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32
) -> Params:
    """``modality_projection.proj.weight`` (HF [text_hidden, vision_hidden * s^2], no
    bias) -> {"kernel": [in, out]}. ValueError on a missing / mis-shaped / extra tensor."""
    key = "modality_projection.proj.weight"
    want = (arch.text_hidden_size, arch.connector_in)
    if key not in tensors:
        raise ValueError(f"Idefics3 connector is missing tensor {key!r}")
    if tuple(tensors[key].shape) != want:
        raise ValueError(f"shape mismatch for connector {key!r}: {tensors[key].shape} vs {want}")
    extra = sorted(set(tensors) - {key})
    if extra:
        raise ValueError(f"Idefics3 connector has unexpected tensors: {extra}")
    return {"kernel": jnp.asarray(np.asarray(tensors[key]).T, dtype)}


def pixel_shuffle(x: jax.Array, scale_factor: int) -> jax.Array:
    """[B, seq, D] (seq a square grid, row-major) -> [B, seq / s^2, D * s^2]: each s x s
    block of patches concatenated along features, exactly ``Idefics3Connector.
    pixel_shuffle`` (including its order of the block's patches)."""
    b, seq, d = x.shape
    s = scale_factor
    h = w = int(round(seq**0.5))
    if h * w != seq or h % s:
        raise ValueError(f"pixel_shuffle: {seq} patches is not a square grid divisible by {s}")
    x = x.reshape(b, h, w // s, d * s)
    x = x.transpose(0, 2, 1, 3)
    x = x.reshape(b, w // s, h // s, d * s * s)
    x = x.transpose(0, 2, 1, 3)
    return x.reshape(b, seq // (s * s), d * s * s)


def connect(params: Params, hidden: jax.Array, arch: Idefics3Arch) -> jax.Array:
    """The connector: [B, num_patches, vision_hidden] -> [B, num_image_tokens,
    text_hidden] (pixel shuffle, then the bias-free projection)."""
    x = pixel_shuffle(hidden.astype(params["kernel"].dtype), arch.scale_factor)
    return x @ params["kernel"]


def image_features(
    vision_params: Params, connector_params: Params, pixel_values: jax.Array, arch: Idefics3Arch
) -> jax.Array:
    """Tiles [B, 3, S, S] -> [B, num_image_tokens, text_hidden]: transformers'
    ``get_image_features`` for full tiles (SigLIP's post-layernormed last hidden state
    through the connector). Jittable with ``arch`` static."""
    hidden = siglip_last_hidden_state(vision_params, pixel_values, arch.vision)
    return connect(connector_params, hidden, arch)


def image_prompt_text(rows: int, cols: int, image_seq_len: int) -> str:
    """The text that replaces one ``<image>`` of a prompt, exactly
    ``Idefics3Processor.replace_image_token``: the global tile alone when rows == cols
    == 0 (no splitting), else the rows x cols tiles row by row and the global tile."""
    run = IMAGE_TOKEN * image_seq_len
    glob = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{run}{FAKE_IMAGE_TOKEN}"
    if rows == 0 and cols == 0:
        return glob
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}"
        text += "\n"
    return text + "\n" + glob


def max_image_prompt_tokens(processor: Any, arch: Idefics3Arch, tokenizer: Any) -> int:
    """The most tokens one ``<image>`` can expand to under ``processor`` (its largest
    tile grid: ceil(size / max_image_size) a side with splitting, else the global tile
    alone), tokenized with ``tokenizer`` (pagedjax.tokenizer): a front end's bound for
    prompt lengths before the image is preprocessed."""
    rows = cols = 0
    if processor.do_image_splitting:
        longest, tile = processor.size["longest_edge"], processor.max_image_size["longest_edge"]
        rows = cols = -(-longest // tile)
        if rows == 1:  # an image no larger than one tile is not split
            rows = cols = 0
    text = image_prompt_text(rows, cols, arch.num_image_tokens)
    return len(tokenizer.encode(text, add_special_tokens=False))


def preprocess_image(processor: Any, image: Any, arch: Idefics3Arch
                     ) -> tuple[np.ndarray, int, int]:  # fmt: skip
    """One RGB PIL image -> (tiles float32 [k, 3, S, S], rows, cols) through the
    checkpoint's Idefics3ImageProcessor (k = rows * cols + 1 with splitting, else 1 and
    rows = cols = 0). ValueError when a tile is not the tower's image_size square or has
    padded patches (not built, siglip.check_full_image)."""
    tile_size = arch.vision.image_size
    out = processor(images=[[image]], return_row_col_info=True, return_tensors="np")
    tiles = np.asarray(out["pixel_values"], np.float32)[0]
    rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
    if tiles.shape[1:] != (3, tile_size, tile_size):
        raise ValueError(f"the image processor gave tiles {tiles.shape[1:]}, the vision tower"
                         f" takes (3, {tile_size}, {tile_size}): max_image_size must equal"
                         " vision_config.image_size")  # fmt: skip
    want = rows * cols + 1 if rows or cols else 1
    if tiles.shape[0] != want:
        raise ValueError(f"the image processor gave {tiles.shape[0]} tiles for {rows} x {cols}")
    mask = out.get("pixel_attention_mask")
    check_full_image(None if mask is None else np.asarray(mask)[0], arch.vision.patch_size)
    return tiles, rows, cols


def load_image_processor(directory: Path, arch: Idefics3Arch) -> Any:
    """The checkpoint's Idefics3ImageProcessor (preprocessor_config.json; the PIL backend:
    torchvision is not installed), else one without splitting at the tower's size."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    if (directory / "preprocessor_config.json").is_file():
        return Idefics3ImageProcessorPil.from_pretrained(str(directory))
    s = arch.vision.image_size
    return Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": s},
                                     max_image_size={"longest_edge": s})  # fmt: skip


def load_idefics3_vision(
    arch: Idefics3Arch, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32
) -> tuple[Params, Params, dict[str, np.ndarray]]:
    """(vision params, connector params, language-model tensors for the decoder loader)."""
    vision, connector, text = split_idefics3_tensors(tensors)
    return (convert_siglip_tensors(arch.vision, vision, dtype),
            convert_connector_tensors(arch, connector, dtype), text)


def load_idefics3_checkpoint(
    directory: str | Path, dtype: Any = jnp.float32
) -> tuple[ModelArch, Params, Idefics3Arch, Params, Params]:
    """An Idefics3ForConditionalGeneration checkpoint directory (config.json +
    safetensors) -> (text ModelArch, text params, Idefics3Arch, vision params, connector
    params), every tensor used exactly once (ValueError otherwise). The language model
    must be of the Llama family (the only one with ``inputs_embeds``)."""
    from pagedjax.model.loader import checkpoint_files, convert_hf_tensors
    from pagedjax.model.safetensors_io import load_tensors

    directory = Path(directory)
    config = complete_idefics3_config(json.loads((directory / "config.json").read_text()))
    arch = Idefics3Arch.from_hf(config)
    text_arch = arch_from_hf_config(config["text_config"])
    if text_arch.family != "llama":
        raise ValueError(f"Idefics3 over a {text_arch.model_type!r} language model is not"
                         " built (inputs_embeds: Llama family only)")  # fmt: skip
    tensors: dict[str, np.ndarray] = {}
    for f in checkpoint_files(directory):
        tensors.update(load_tensors(f))
    vision, connector, text = load_idefics3_vision(arch, tensors, dtype)
    return text_arch, convert_hf_tensors(text_arch, text, dtype), arch, vision, connector
