"""A checkpoint's vision side for the engine, by family: which multi-modal families a
directory may hold (config.json's ``model_type``: "llava", "idefics3", "qwen2_vl"), how
each loads (text model + vision tower + connector, model/vision/), and ``VisionModel``, the one
interface the engine's image path (multimodal.py) uses whatever the family: the jitted
encoder over tiles and ``prepare`` (preprocessing + the placeholder's replacement ids,
bound to the checkpoint's image processor and tokenizer at load).

Families: LLaVA (CLIP tower, projector; an image is one tile, its placeholder repeated
``num_image_tokens`` times, as ``LlavaProcessor``); Idefics3 / SmolVLM (SigLIP tower,
pixel-shuffle connector; an image is its split tiles then the global tile, or the
global tile alone, and the text ``Idefics3Processor`` writes for it, tokenized with the
model's tokenizer); Qwen2-VL (a ViT with 2-D rotary and a patch merger; an image is
one tile of patches at its own grid, its ``<|image_pad|>`` repeated grid_h * grid_w /
merge^2 times, and the language model takes M-RoPE positions: engine/mrope.py).
docs/multimodal.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import ModelConfig
from pagedjax.engine.host_arrays import upload
from pagedjax.engine.loading import load_model, resolve_dtype
from pagedjax.model import ModelArch
from pagedjax.model.vision import idefics3, llava, qwen2_vl
from pagedjax.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

Params = Any


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedImage:
    """One image after its family's preprocessing: tiles float32 [k, 3, S, S] (k = 1 for
    LLaVA; Idefics3's split tiles then the global one; Qwen2-VL: [1, grid_h, grid_w,
    patch_dim], its patches) and replacement, the token ids that replace its
    placeholder: k runs of ``tile_tokens`` image tokens (``num_image_tokens`` but for
    Qwen2-VL), tile order, with whatever the family's processor writes around them."""

    tiles: np.ndarray
    replacement: tuple[int, ...]


class VisionModel:
    """A checkpoint's vision side for the engine, whatever the family: ``arch`` (hashable,
    static under jit; ``image_token_id``, ``num_image_tokens`` per tile), the tower and
    connector params, the constructor's ``features(vision, connector, tiles [B, 3, S, S],
    arch) -> [B, N, H]`` (the family's pure ``image_features``) and ``prepare(images) ->
    list[PreparedImage]`` (preprocessing and placeholder replacement; the family's
    processor, bound at load). ``warm_shapes``: the tile shapes the warm-up compiles the
    encoder for (LLaVA, Idefics3: the one tile size; Qwen2-VL: see its class).

    The encoder runs as one jitted program per (tile count bucket, tile shape, encoder
    cache capacity): the tiles' features written into the encoder cache's rows
    (``encode_into``), so the step path runs no eager operation (each would compile per
    shape). ``trace_count`` counts its traces (= programs compiled) by that key, as
    ``ModelRunner.trace_count`` does for the step."""

    def __init__(self, arch: Any, vision: Params, connector: Params,
                 features: Callable[..., jax.Array],
                 prepare: Callable[[list[Any]], list[PreparedImage]],
                 warm_shapes: tuple[tuple[int, ...], ...] = ()):  # fmt: skip
        self.arch, self.vision, self.connector = arch, vision, connector
        self.prepare = prepare
        self.warm_shapes = warm_shapes
        self.dtype = jax.tree.leaves(connector)[0].dtype
        self._features = features
        self.trace_count: dict[tuple[int, ...], int] = {}
        self._width: int | None = None  # encode_tiles' feature width
        # A bound method: traced per engine (its own trace count), like the runner's step.
        self._program = jax.jit(self._encode_store)

    @property
    def num_image_tokens(self) -> int:
        return self.arch.num_image_tokens

    @property
    def image_token_id(self) -> int:
        return self.arch.image_token_id

    # Placeholders per image come in runs of this many (expand_placeholders' check of an
    # already expanded prompt); every tile takes num_image_tokens of them.
    @property
    def run_unit(self) -> int:
        return self.num_image_tokens

    mrope = False  # whether the language model takes M-RoPE positions (rope_positions)

    def tile_tokens(self, tile: np.ndarray) -> int:
        """Placeholder tokens (= feature rows) of one tile."""
        return self.num_image_tokens

    def rope_positions(self, length: int, images: list[Any]) -> tuple[np.ndarray, int]:
        raise NotImplementedError("only M-RoPE models (mrope True) have 3-D positions")

    def features(self, params: tuple[Params, Params], pixels: jax.Array) -> jax.Array:
        """Traced: (tower, connector) params, tiles [B, *tile shape] -> features [B, rows,
        H], rows <= N."""
        return self._features(*params, pixels, arch=self.arch)

    def _encode_store(self, params: tuple[Params, Params], pixels: jax.Array, cache: jax.Array,
                      slots: jax.Array) -> jax.Array:  # fmt: skip
        """cache [C, N, H] with cache[slots[i]] := features of tile i (rows past a tile's
        feature count zero; slots past C, the padding tiles, write nothing)."""
        key = (*pixels.shape, cache.shape[0])  # runs at trace time only
        self.trace_count[key] = self.trace_count.get(key, 0) + 1
        feats = self.features(params, pixels)
        feats = jnp.pad(feats, ((0, 0), (0, cache.shape[1] - feats.shape[1]), (0, 0)))
        # Not donated (a copy of [C, N, H] per call, as the separate write before): the
        # step that read the cache may still be in flight.
        return cache.at[slots].set(feats.astype(cache.dtype), mode="drop")

    def encode_into(self, cache: jax.Array, slots: list[int], tiles: list[np.ndarray]
                    ) -> jax.Array:  # fmt: skip
        """cache [C, N, H] with each tile's features in its slot (``slots[i]`` for
        ``tiles[i]``, each as ``PreparedImage.tiles[k]``): one program call per tile
        shape (Qwen2-VL's grids; one for the other families), the count padded to a
        power of two (padding tiles write nothing). The encoder cache's call."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, t in enumerate(tiles):
            by_shape.setdefault(t.shape, []).append(i)
        for idx in by_shape.values():
            pixels = _pad_count(np.stack([tiles[i] for i in idx]))
            dest = np.full(pixels.shape[0], cache.shape[0], np.int32)
            dest[: len(idx)] = [slots[i] for i in idx]
            cache = self._program((self.vision, self.connector), upload(pixels), cache,
                                  upload(dest))  # fmt: skip
        return cache

    def encode_tiles(self, tiles: list[np.ndarray]) -> jax.Array:
        """Tiles -> their features [len(tiles), N, H] in order (rows past a tile's count
        zero), through ``encode_into`` on a fresh cache of len(tiles) entries: for
        callers outside the engine (tests, tools); the engine writes into its cache."""
        if self._width is None:  # the features' width, traced once (not compiled)
            one = jax.ShapeDtypeStruct((1, *tiles[0].shape), np.float32)
            self._width = jax.eval_shape(self.features, (self.vision, self.connector),
                                         one).shape[-1]  # fmt: skip
        cache = jnp.zeros((len(tiles), self.num_image_tokens, self._width), self.dtype)
        return self.encode_into(cache, list(range(len(tiles))), tiles)

    def compile_encoder(self, cache: jax.Array, count: int, shape: tuple[int, ...]) -> None:
        """Compile ahead of time (not run) the encoder program of ``count`` tiles (a power
        of two) of ``shape`` into a cache like ``cache``: later calls with those shapes
        neither trace nor compile (jit's cache holds it). The warm-up's call."""
        pixels = upload(np.zeros((count, *shape), np.float32))
        dest = upload(np.full(count, cache.shape[0], np.int32))
        self._program.lower((self.vision, self.connector), pixels, cache, dest).compile()


def _pad_count(x: np.ndarray) -> np.ndarray:
    """x [B, ...] with zero rows appended up to a power-of-two count (few compilations)."""
    b = x.shape[0]
    padded = 1 << max(0, (b - 1).bit_length())
    if padded == b:
        return x
    return np.concatenate([x, np.zeros((padded - b, *x.shape[1:]), x.dtype)])


class Qwen2VLVisionModel(VisionModel):
    """Qwen2-VL's vision side: an image is one tile of patches [grid_h, grid_w,
    patch_dim] taking grid_h * grid_w / merge^2 tokens (per image, up to
    ``num_image_tokens``, the encoder cache's rows per entry: shorter images leave rows
    unused); the encoder is compiled per grid (images of one grid batched, the count
    padded to a power of two); the language model takes M-RoPE positions
    (``qwen2_vl.mrope_positions``). ``warm_shapes``: the grid of the processor's largest
    square image (its max pixels), the one grid the warm-up compiles: every image size
    and aspect ratio between the processor's min and max pixels has a grid of its own
    (hundreds), so the others compile on first use."""

    mrope = True

    @property
    def run_unit(self) -> int:
        return 1  # images take any number of tokens

    def tile_tokens(self, tile: np.ndarray) -> int:
        return tile.shape[0] * tile.shape[1] // self.arch.vision.spatial_merge_size**2

    def rope_positions(self, length: int, images: list[Any]) -> tuple[np.ndarray, int]:
        """(int32[3, length], delta) of a prompt whose image tiles are ``images``
        (multimodal.ImageInput: offset, pixel_values of the image's grid)."""
        m = self.arch.vision.spatial_merge_size
        grids = [(img.offset, img.pixel_values.shape[0] // m, img.pixel_values.shape[1] // m)
                 for img in images]  # fmt: skip
        return qwen2_vl.mrope_positions(length, grids)

    def features(self, params: tuple[Params, Params], pixels: jax.Array) -> jax.Array:
        """Traced: patches [B, grid_h, grid_w, patch_dim] -> [B, grid_h * grid_w / merge^2,
        H] (params[0], the tower, holds the merger)."""
        b, gh, gw, d = pixels.shape
        return self._features(params[0], pixels.reshape(b, gh * gw, d), grid=(gh, gw),
                              arch=self.arch.vision)  # fmt: skip


def _llava_model(path: Path, dtype: Any, tokenizer: Tokenizer
                 ) -> tuple[ModelArch, Params, VisionModel]:  # fmt: skip
    """A LLaVA directory: CLIP tower + projector; each image one tile, its placeholder
    repeated num_image_tokens times (LlavaProcessor)."""
    arch, params, larch, vision, projector = llava.load_llava_checkpoint(path, dtype)
    processor = _clip_image_processor(path, larch)
    s, n, tok = larch.vision.image_size, larch.num_image_tokens, larch.image_token_id

    def prepare(images: list[Any]) -> list[PreparedImage]:
        out = processor(images=images, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], np.float32)
        if pixels.shape[1:] != (3, s, s):
            raise ValueError(f"the image processor gave pixel_values {pixels.shape[1:]}, the"
                             f" vision tower takes (3, {s}, {s})")  # fmt: skip
        return [PreparedImage(px[None], (tok,) * n) for px in pixels]

    return arch, params, VisionModel(larch, vision, projector, llava.image_features, prepare,
                                     warm_shapes=((3, s, s),))  # fmt: skip


def _clip_image_processor(directory: Path, arch: llava.LlavaArch) -> Any:
    """The checkpoint's CLIPImageProcessor (preprocessor_config.json), else one for the
    tower's image size with CLIP's default mean / std (logged: the checkpoint should
    ship its processor)."""
    from transformers import CLIPImageProcessor

    if (directory / "preprocessor_config.json").is_file():
        return CLIPImageProcessor.from_pretrained(str(directory))
    s = arch.vision.image_size
    log.warning("%s has no preprocessor_config.json: CLIP's default preprocessing at %d px",
                directory, s)
    return CLIPImageProcessor(size={"shortest_edge": s}, crop_size={"height": s, "width": s})


def _idefics3_model(path: Path, dtype: Any, tokenizer: Tokenizer
                    ) -> tuple[ModelArch, Params, VisionModel]:  # fmt: skip
    """An Idefics3 / SmolVLM directory: SigLIP tower + connector; each image's tiles (one
    without splitting) and the text Idefics3Processor writes for it, tokenized with the
    model's tokenizer (once per tile grid)."""
    arch, params, iarch, vision, connector = idefics3.load_idefics3_checkpoint(path, dtype)
    processor = idefics3.load_image_processor(path, iarch)
    n, tok = iarch.num_image_tokens, iarch.image_token_id
    replacements: dict[tuple[int, int], tuple[int, ...]] = {}

    def replacement(rows: int, cols: int, tiles: int) -> tuple[int, ...]:
        if (rows, cols) not in replacements:
            text = idefics3.image_prompt_text(rows, cols, n)
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if sum(t == tok for t in ids) != tiles * n:
                raise ValueError(f"the tokenizer does not encode {idefics3.IMAGE_TOKEN!r} as"
                                 f" the image token {tok}")  # fmt: skip
            replacements[rows, cols] = ids
        return replacements[rows, cols]

    def prepare(images: list[Any]) -> list[PreparedImage]:
        out = []
        for img in images:
            tiles, rows, cols = idefics3.preprocess_image(processor, img, iarch)
            out.append(PreparedImage(tiles, replacement(rows, cols, len(tiles))))
        return out

    s = iarch.vision.image_size  # every tile, split or global, is the tower's square
    return arch, params, VisionModel(iarch, vision, connector, idefics3.image_features, prepare,
                                     warm_shapes=((3, s, s),))  # fmt: skip


def _qwen2_vl_model(path: Path, dtype: Any, tokenizer: Tokenizer
                    ) -> tuple[ModelArch, Params, VisionModel]:  # fmt: skip
    """A Qwen2-VL directory: its ViT with 2-D rotary and the patch merger; each image one
    tile of patches, its ``<|image_pad|>`` repeated grid_h * grid_w / merge^2 times
    (Qwen2VLProcessor); the text model a Qwen2 decoder with M-RoPE."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    arch, params, qarch, vision, processor = qwen2_vl.load_qwen2_vl_checkpoint(path, dtype)
    m, tok = qarch.vision.spatial_merge_size, qarch.image_token_id

    def prepare(images: list[Any]) -> list[PreparedImage]:
        out = []
        for img in images:
            patches, gh, gw = qwen2_vl.preprocess_image(processor, img, qarch)
            tile = patches.reshape(1, gh, gw, -1)  # the shape carries the grid
            out.append(PreparedImage(tile, (tok,) * (gh * gw // m**2)))
        return out

    # The warm-up's grid: the processor's own resize (smart_resize, without preprocessing
    # an image of max pixels) of its largest square image.
    p, size = qarch.vision.patch_size, processor.size
    side = math.isqrt(size["longest_edge"])
    h, w = smart_resize(side, side, factor=p * m, min_pixels=size["shortest_edge"],
                        max_pixels=size["longest_edge"])  # fmt: skip
    model = Qwen2VLVisionModel(qarch, vision, vision["merger"], qwen2_vl.image_features,
                               prepare, warm_shapes=((h // p, w // p, qarch.vision.patch_dim),))
    return arch, params, model


# config.json's model_type -> the loader of that multi-modal family.
_FAMILIES = {"llava": _llava_model, "idefics3": _idefics3_model, "qwen2_vl": _qwen2_vl_model}


def multimodal_model_type(directory: str | Path) -> str | None:
    """The directory's config.json model_type when it is a multi-modal family built here
    ("llava", "idefics3", "qwen2_vl"), else None (a text model, a preset name, a missing file)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    model_type = json.loads(path.read_text()).get("model_type")
    return model_type if model_type in _FAMILIES else None


def image_prompt_info(directory: str | Path, tokenizer: Tokenizer) -> tuple[str, int] | None:
    """(placeholder text, the most tokens one image expands to) of a multi-modal
    checkpoint directory, for a front end that writes placeholders into chat text and
    budgets prompt lengths without loading the model (LLM.chat, the API process); None
    for any other model. LLaVA: its image token's text, num_image_tokens. Idefics3:
    "<image>", the largest tile grid's expansion under the directory's processor.
    Qwen2-VL: "<|vision_start|><|image_pad|><|vision_end|>", the most image tokens its
    processor's max pixels allow (the pad's expansion)."""
    model_type = multimodal_model_type(directory)
    if model_type == "llava":
        return llava.image_prompt_info(directory, tokenizer)
    if model_type == "idefics3":
        path = Path(directory)
        config = json.loads((path / "config.json").read_text())
        arch = idefics3.Idefics3Arch.from_hf(idefics3.complete_idefics3_config(config))
        processor = idefics3.load_image_processor(path, arch)
        return idefics3.IMAGE_TOKEN, idefics3.max_image_prompt_tokens(processor, arch, tokenizer)
    if model_type == "qwen2_vl":
        return qwen2_vl.image_prompt_info(directory)
    return None


def load_multimodal_model(mc: ModelConfig) -> tuple[ModelArch, Params, Tokenizer, VisionModel]:
    """(text arch, text params, tokenizer, VisionModel) of a multi-modal checkpoint
    directory (``multimodal_model_type``). Random weights (load_format "dummy") and
    quantization are not built for it: ValueError."""
    path = Path(mc.model)
    model_type = multimodal_model_type(path)
    if model_type is None:
        raise ValueError(f"{path} is not a multi-modal checkpoint built here ({sorted(_FAMILIES)})")
    if mc.load_format == "dummy":
        raise ValueError(f"load_format='dummy' is not built for {model_type} checkpoints")
    if mc.quantization is not None:
        raise ValueError(f"quantization={mc.quantization!r} is not built for {model_type}"
                         " checkpoints")  # fmt: skip
    dtype = resolve_dtype(mc.dtype, path, jax.devices()[0].platform)
    tokenizer = load_tokenizer(mc.tokenizer or path)
    arch, params, vision = _FAMILIES[model_type](path, dtype, tokenizer)
    return arch, params, tokenizer, vision


def load_engine_model(mc: ModelConfig) -> tuple[ModelArch, Params, Tokenizer, VisionModel | None]:
    """``LLMEngine.from_config``'s loader: a LLaVA or Idefics3 directory through
    ``load_multimodal_model``, any other model through ``loading.load_model`` (no
    vision model)."""
    if multimodal_model_type(mc.model) is not None:
        return load_multimodal_model(mc)
    arch, params, tokenizer, _ = load_model(mc)
    return arch, params, tokenizer, None


__all__ = [
    "PreparedImage",
    "VisionModel",
    "image_prompt_info",
    "load_engine_model",
    "load_multimodal_model",
    "multimodal_model_type",
]
