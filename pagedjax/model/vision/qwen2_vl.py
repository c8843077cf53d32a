"""Qwen2-VL: the vision tower (transformers' ``Qwen2VisionTransformerPretrainedModel``),
the checkpoint's tensor split, image preprocessing through ``Qwen2VLImageProcessorPil``,
the placeholder expansion of ``Qwen2VLProcessor`` and the 3-D rotary positions of
``Qwen2VLModel.get_rope_index`` (M-RoPE), as pure functions.

An image is resized (``smart_resize``: both sides multiples of patch * merge, the area
within the processor's [shortest_edge, longest_edge] pixels) and cut into a grid of
grid_h x grid_w patches of (temporal_patch_size, patch, patch) (the image repeated over
the temporal axis: grid_t = 1), listed by the processor in merge-window order (each
merge x merge window's patches consecutive). The tower:

  patch embed   a bias-free Conv3d with stride = kernel, as a matmul over flat patches
  blocks        LayerNorm -> self-attention (fused qkv, 2-D rotary: the first half of the
                rotated dims by the patch's row, the second by its column) -> residual;
                LayerNorm -> fc1 -> act -> fc2 -> residual. Attention is full within an
                image and never across images (HF's cu_seqlens): here each image is its
                own batch row, images of one grid batched together.
  merger        LayerNorm (ln_q), each merge window's merge^2 patches concatenated,
                Linear -> GELU -> Linear to the language model's width.

so an image gives grid_h * grid_w / merge^2 features, and its one ``<|image_pad|>`` in the
prompt becomes that many copies (``Qwen2VLProcessor.replace_image_token``; the prompt
writes ``<|vision_start|><|image_pad|><|vision_end|>``).

M-RoPE (``mrope_positions``): text tokens get one position for all three rows, counting
on from the previous token; an image's tokens get (start, start + row, start + col) with
start the next text position, and the text after it continues at start + max(rows,
cols). A prompt's ``delta`` (last position + 1 - length) shifts every later token (the
decode steps): position = index + delta in all three rows.

Not built: video (``pixel_values_videos``, grid_t > 1), Qwen2.5-VL's windowed attention.
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
from pagedjax.model.vision.vit import ACTIVATIONS, TensorReader, cast, dense, layer_norm

Params = Any

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
# What the chat template writes for one image part (and a front end writes for it).
IMAGE_PLACEHOLDER = f"{VISION_START}{IMAGE_PAD}{VISION_END}"
_NORM_EPS = 1e-6  # the tower's and the merger's LayerNorm eps (hard-coded in HF)


@dataclasses.dataclass(frozen=True)
class Qwen2VisionArch:
    """The HF ``Qwen2VLVisionConfig`` fields the tower needs (hashable: static under jit)."""

    depth: int
    embed_dim: int
    hidden_size: int  # the merger's output: the language model's width
    num_heads: int
    mlp_ratio: float = 4.0
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise ValueError(f"embed_dim {self.embed_dim} / {self.num_heads} heads must be a"
                             " multiple of 4 (the 2-D rotary splits each head in quarters)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def mlp_hidden(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    @property
    def merge_in(self) -> int:
        return self.embed_dim * self.spatial_merge_size**2

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> Qwen2VisionArch:
        """From a complete ``vision_config`` dict (``complete_qwen2_vl_config``)."""
        for key in ("patch_size", "temporal_patch_size"):
            if not isinstance(c.get(key, 1), int):
                raise ValueError(f"vision_config.{key} {c[key]!r}: only an int is built")
        theta = (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(depth=c["depth"], embed_dim=c["embed_dim"], hidden_size=c["hidden_size"],
                   num_heads=c["num_heads"], mlp_ratio=c["mlp_ratio"],
                   patch_size=c["patch_size"], temporal_patch_size=c["temporal_patch_size"],
                   spatial_merge_size=c["spatial_merge_size"], in_channels=c["in_channels"],
                   hidden_act=c["hidden_act"], rope_theta=float(theta))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Qwen2VLArch:
    """The vision side of a Qwen2-VL checkpoint (the text side is the decoder's ModelArch
    with ``mrope_section``). num_image_tokens: the most tokens one image may take under
    the checkpoint's image processor (the encoder cache's rows per entry; an image takes
    grid_h * grid_w / merge^2 <= it)."""

    vision: Qwen2VisionArch
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    num_image_tokens: int

    @classmethod
    def from_hf(cls, config: dict[str, Any], num_image_tokens: int) -> Qwen2VLArch:
        return cls(Qwen2VisionArch.from_hf(config["vision_config"]),
                   int(config["image_token_id"]), int(config["vision_start_token_id"]),
                   int(config["vision_end_token_id"]), num_image_tokens)  # fmt: skip


def complete_qwen2_vl_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers reads it (``Qwen2VLConfig.from_dict``: sub-config
    defaults, the old flat layout with the text fields at the top, the old
    ``rope_scaling: {"type": "mrope"}``)."""
    from transformers import CONFIG_MAPPING

    if config.get("model_type") != "qwen2_vl":
        raise ValueError(f"not a Qwen2-VL config: model_type {config.get('model_type')!r}")
    return CONFIG_MAPPING["qwen2_vl"].from_dict(config).to_dict()


def text_arch_from_config(config: dict[str, Any]) -> ModelArch:
    """The language model's ModelArch (a Qwen2 decoder with ``mrope_section``) from a
    complete config (``complete_qwen2_vl_config``); the top-level ``tie_word_embeddings``
    ties lm_head, as in transformers 5."""
    text = dict(config["text_config"])
    section = (text.get("rope_parameters") or {}).get("mrope_section")
    if section is None:
        raise ValueError("the Qwen2-VL text_config has no rope_parameters.mrope_section")
    text.update(model_type="qwen2", tie_word_embeddings=bool(config.get("tie_word_embeddings")))
    text.pop("architectures", None)
    arch = arch_from_hf_config(text)
    return dataclasses.replace(arch, mrope_section=tuple(int(s) for s in section))


def split_qwen2_vl_tensors(
    tensors: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A Qwen2VLForConditionalGeneration checkpoint's tensors -> (vision tower, language
    model as the decoder loader's ``model.*`` / ``lm_head.*``). Both layouts: the hub's
    (``visual.*``, ``model.*``; what transformers 5 writes) and the module tree's
    (``model.visual.*``, ``model.language_model.*``). Anything else: ValueError."""
    vision, text = {}, {}
    for k, x in tensors.items():
        if k.startswith(("visual.", "model.visual.")):
            vision[k.split("visual.", 1)[1]] = x
        elif k.startswith("model.language_model."):
            text["model." + k[len("model.language_model."):]] = x
        elif k.startswith(("model.", "lm_head.")):
            text[k] = x
        else:
            raise ValueError(f"Qwen2-VL checkpoint has an unexpected tensor {k!r}")
    return vision, text


def convert_vision_tensors(arch: Qwen2VisionArch, tensors: dict[str, np.ndarray],
                           dtype: Any = jnp.float32) -> Params:  # fmt: skip
    """The tower's HF tensors (``visual.`` stripped) -> params: ``patch_embed`` [patch_dim,
    embed], ``blocks`` (leaves stacked over the depth for ``lax.scan``; kernels [in,
    out]), ``merger``. Missing / mis-shaped / unused tensors: ValueError naming them."""
    r = TensorReader(tensors, "Qwen2-VL vision")
    e, f, m = arch.embed_dim, arch.mlp_hidden, arch.merge_in
    conv = r.get("patch_embed.proj.weight", (e, arch.in_channels, arch.temporal_patch_size,
                                             arch.patch_size, arch.patch_size))  # fmt: skip

    def linear(key: str, out_f: int, in_f: int) -> dict[str, np.ndarray]:
        return {"kernel": r.get(f"{key}.weight", (out_f, in_f)).T,
                "bias": r.get(f"{key}.bias", (out_f,))}  # fmt: skip

    blocks = []
    for i in range(arch.depth):
        p = f"blocks.{i}"
        blocks.append({"norm1": r.norm(f"{p}.norm1", e), "norm2": r.norm(f"{p}.norm2", e),
                       "qkv": linear(f"{p}.attn.qkv", 3 * e, e),
                       "proj": linear(f"{p}.attn.proj", e, e),
                       "fc1": linear(f"{p}.mlp.fc1", f, e), "fc2": linear(f"{p}.mlp.fc2", e, f)})
    merger = {"ln_q": r.norm("merger.ln_q", e), "fc1": linear("merger.mlp.0", m, m),
              "fc2": linear("merger.mlp.2", arch.hidden_size, m)}  # fmt: skip
    r.refuse_unused()
    params = {"patch_embed": conv.reshape(e, -1).T, "merger": merger,
              "blocks": jax.tree.map(lambda *xs: np.stack(xs), *blocks)}  # fmt: skip
    return cast(params, dtype)


def vision_positions(grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """int32[grid_h * grid_w, 2]: each patch's (row, col) in the processor's merge-window
    order (HF's ``get_vision_position_ids`` for one image)."""
    h, w = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    order = lambda a: a.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([order(h), order(w)], -1).astype(np.int32)


def _rotary(grid: tuple[int, int], arch: Qwen2VisionArch) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) float32 [N, head_dim] of the 2-D rotary for one image's patches:
    frequencies of head_dim / 4 over the row then the column, the pair repeated (HF's
    ``Qwen2VLVisionRotaryEmbedding``)."""
    spatial = arch.head_dim // 2
    exponent = np.arange(0, spatial, 2, dtype=np.int64).astype(np.float32) / np.float32(spatial)
    inv_freq = (np.float32(1.0) / np.float32(arch.rope_theta) ** exponent).astype(np.float32)
    pos = jnp.asarray(vision_positions(*grid, arch.spatial_merge_size), jnp.float32)
    freqs = pos[:, :, None] * jnp.asarray(inv_freq)  # [N, 2, head_dim / 4]
    hw = freqs.reshape(pos.shape[0], -1)  # row frequencies then column frequencies
    full = jnp.concatenate([hw, hw], -1)
    return jnp.cos(full), jnp.sin(full)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, N, heads, d] rotated (rotate-half) in fp32, back in x's dtype."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    half = jnp.concatenate([-x2, x1], -1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return (xf * c + half * s).astype(x.dtype)


def _block(x: jax.Array, p: Params, cos: jax.Array, sin: jax.Array,
           arch: Qwen2VisionArch) -> jax.Array:  # fmt: skip
    """One ``Qwen2VLVisionBlock`` over x [B, N, embed] (full attention within each row)."""
    b, n, e = x.shape
    heads, d = arch.num_heads, arch.head_dim
    y = layer_norm(x, p["norm1"], _NORM_EPS)
    qkv = dense(y, p["qkv"]).reshape(b, n, 3, heads, d)
    q, k, v = _rotate(qkv[:, :, 0], cos, sin), _rotate(qkv[:, :, 1], cos, sin), qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * d**-0.5
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, e)
    x = x + dense(attn, p["proj"])
    y = layer_norm(x, p["norm2"], _NORM_EPS)
    return x + dense(ACTIVATIONS[arch.hidden_act](dense(y, p["fc1"])), p["fc2"])


def vision_hidden(params: Params, patches: jax.Array, grid: tuple[int, int],
                  arch: Qwen2VisionArch) -> jax.Array:  # fmt: skip
    """Patches [B, grid_h * grid_w, patch_dim] (B images of one grid, the processor's
    order) -> the last block's output [B, N, embed] (HF's ``last_hidden_state``)."""
    x = patches.astype(params["patch_embed"].dtype) @ params["patch_embed"]
    cos, sin = _rotary(grid, arch)

    def step(carry: jax.Array, layer: Params) -> tuple[jax.Array, None]:
        return _block(carry, layer, cos, sin, arch), None

    return jax.lax.scan(step, x, params["blocks"])[0]


def merge(params: Params, hidden: jax.Array, arch: Qwen2VisionArch) -> jax.Array:
    """``PatchMerger``: [B, N, embed] -> [B, N / merge^2, hidden_size]."""
    b, n, _ = hidden.shape
    y = layer_norm(hidden, params["merger"]["ln_q"], _NORM_EPS)
    y = y.reshape(b, n // arch.spatial_merge_size**2, arch.merge_in)
    y = jax.nn.gelu(dense(y, params["merger"]["fc1"]), approximate=False)
    return dense(y, params["merger"]["fc2"])


def image_features(params: Params, patches: jax.Array, grid: tuple[int, int],
                   arch: Qwen2VisionArch) -> jax.Array:  # fmt: skip
    """Patches [B, grid_h * grid_w, patch_dim] -> features [B, grid_h * grid_w / merge^2,
    hidden_size]: ``get_image_features`` per image. Jittable with grid and arch static
    (one compilation per image grid)."""
    return merge(params, vision_hidden(params, patches, grid, arch), arch)


def load_image_processor(directory: Path, arch: Qwen2VisionArch) -> Any:
    """The checkpoint's ``Qwen2VLImageProcessorPil`` (preprocessor_config.json; the PIL
    backend: transformers 5 needs no torchvision for it), else one with HF's defaults at
    the tower's patch / merge sizes. Its patch, temporal patch and merge sizes must be
    the tower's: ValueError otherwise."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if (directory / "preprocessor_config.json").is_file():
        proc = Qwen2VLImageProcessorPil.from_pretrained(str(directory))
    else:
        proc = Qwen2VLImageProcessorPil(patch_size=arch.patch_size,
                                        merge_size=arch.spatial_merge_size,
                                        temporal_patch_size=arch.temporal_patch_size)  # fmt: skip
    got = (proc.patch_size, proc.temporal_patch_size, proc.merge_size)
    want = (arch.patch_size, arch.temporal_patch_size, arch.spatial_merge_size)
    if got != want:
        raise ValueError(f"the image processor's (patch, temporal patch, merge) sizes {got} are"
                         f" not the vision tower's {want}")  # fmt: skip
    return proc


def max_image_tokens(processor: Any) -> int:
    """The most tokens one image can take under ``processor``: ``smart_resize`` keeps the
    area within size["longest_edge"] pixels (the minimum side of one merge window
    aside), with both sides multiples of patch * merge."""
    factor = processor.patch_size * processor.merge_size
    return max(1, processor.size["longest_edge"] // factor**2)


def image_prompt_info(directory: str | Path) -> tuple[str, int]:
    """(the chat placeholder text of one image, the most tokens its ``<|image_pad|>``
    becomes) of a checkpoint directory, without loading the model."""
    config = complete_qwen2_vl_config(json.loads((Path(directory) / "config.json").read_text()))
    vision = Qwen2VisionArch.from_hf(config["vision_config"])
    return IMAGE_PLACEHOLDER, max_image_tokens(load_image_processor(Path(directory), vision))


def preprocess_image(processor: Any, image: Any, arch: Qwen2VLArch) -> tuple[np.ndarray, int, int]:
    """One RGB PIL image -> (patches float32 [grid_h * grid_w, patch_dim] in the
    processor's order, grid_h, grid_w). ValueError when it would take more than
    ``arch.num_image_tokens`` tokens (an extreme aspect ratio) or is not one frame."""
    out = processor(images=[image], return_tensors="np")
    patches = np.asarray(out["pixel_values"], np.float32)
    t, gh, gw = (int(v) for v in np.asarray(out["image_grid_thw"])[0])
    m = arch.vision.spatial_merge_size
    if t != 1 or patches.shape != (gh * gw, arch.vision.patch_dim):
        raise ValueError(f"the image processor gave {patches.shape} patches for grid {(t, gh, gw)}")
    if gh * gw // m**2 > arch.num_image_tokens:
        raise ValueError(f"the image takes {gh * gw // m**2} tokens ({gh} x {gw} patches), over"
                         f" the {arch.num_image_tokens} the processor's max pixels allow")
    return patches, gh, gw


def mrope_positions(length: int, images: list[tuple[int, int, int]]) -> tuple[np.ndarray, int]:
    """(int32[3, length] M-RoPE positions, delta) of a prompt of ``length`` tokens whose
    images are ``(offset, rows, cols)``: each image's run of rows * cols tokens starts
    at offset (after the merge: rows = grid_h / merge), in prompt order, runs disjoint.
    transformers' ``get_rope_index`` for one unpadded sequence: text counts on from the
    last position; an image's tokens are (s, s + r, s + c) for s the next text position;
    text after it resumes at s + max(rows, cols). delta = last position + 1 - length:
    token i >= length (a generated one) is at i + delta in all three rows."""
    pos = np.zeros((3, length), np.int64)
    cur, i = 0, 0
    for offset, rows, cols in sorted(images):
        if offset < i or offset + rows * cols > length:
            raise ValueError(f"image run at {offset} (+{rows * cols}) overlaps or overruns")
        pos[:, i:offset] = cur + np.arange(offset - i)
        cur += offset - i
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        run = slice(offset, offset + rows * cols)
        pos[0, run], pos[1, run], pos[2, run] = cur, cur + r.ravel(), cur + c.ravel()
        cur += max(rows, cols)
        i = offset + rows * cols
    pos[:, i:] = cur + np.arange(length - i)
    delta = int(pos.max()) + 1 - length if length else 0
    return pos.astype(np.int32), delta


def load_qwen2_vl_checkpoint(
    directory: str | Path, dtype: Any = jnp.float32
) -> tuple[ModelArch, Params, Qwen2VLArch, Params, Any]:
    """A Qwen2VLForConditionalGeneration directory (config.json, safetensors,
    preprocessor_config.json) -> (text ModelArch with mrope_section, text params,
    Qwen2VLArch, vision params, the image processor), every tensor used exactly once
    (ValueError otherwise)."""
    from pagedjax.model.loader import checkpoint_files, convert_hf_tensors
    from pagedjax.model.safetensors_io import load_tensors

    directory = Path(directory)
    config = complete_qwen2_vl_config(json.loads((directory / "config.json").read_text()))
    vision_arch = Qwen2VisionArch.from_hf(config["vision_config"])
    text_arch = text_arch_from_config(config)
    if vision_arch.hidden_size != text_arch.hidden_size:
        raise ValueError(f"vision_config.hidden_size {vision_arch.hidden_size} is not the text"
                         f" model's {text_arch.hidden_size}")  # fmt: skip
    processor = load_image_processor(directory, vision_arch)
    arch = Qwen2VLArch.from_hf(config, max_image_tokens(processor))
    tensors: dict[str, np.ndarray] = {}
    for f in checkpoint_files(directory):
        tensors.update(load_tensors(f))
    vision, text = split_qwen2_vl_tensors(tensors)
    return (text_arch, convert_hf_tensors(text_arch, text, dtype), arch,
            convert_vision_tensors(vision_arch, vision, dtype), processor)  # fmt: skip


__all__ = [
    "IMAGE_PAD",
    "IMAGE_PLACEHOLDER",
    "Qwen2VLArch",
    "Qwen2VisionArch",
    "complete_qwen2_vl_config",
    "convert_vision_tensors",
    "image_features",
    "image_prompt_info",
    "load_image_processor",
    "load_qwen2_vl_checkpoint",
    "max_image_tokens",
    "mrope_positions",
    "preprocess_image",
    "split_qwen2_vl_tensors",
    "text_arch_from_config",
    "vision_hidden",
    "vision_positions",
]
