"""Image chat: requests with 1-4 images plus ShareGPT-like text, in a vision family's tokens.

An image becomes prompt tokens by its family's processor rule (docs/multimodal.md,
docs/workloads.md "Image chat"); the rules here are pure arithmetic, checked against
transformers' image processors by tests/test_image_chat_workload.py:

- ``llava-1.5``: 576 tokens per image, whatever its size (CLIP ViT-L/14 at 336 px:
  24 x 24 patches, the class token dropped; ``LlavaProcessor`` expands one ``<image>``).
- ``idefics3`` (Idefics3-8B-Llama3) and ``smolvlm`` (SmolVLM-Instruct): the image's
  longest edge is rescaled to ``longest_edge`` (4 tiles; up or down, aspect kept), cut
  into tiles of ``tile`` px (rows x cols, ``Idefics3ImageProcessor``), each tile
  ``image_seq_len`` tokens (169 = (364 / 14)^2 / 2^2; SmolVLM 81 = (384 / 14)^2 / 3^2)
  plus a global view; the processor's text around them (``Idefics3Processor.
  replace_image_token``: a ``<fake_token_around_image>`` and a ``<row_r_col_c>`` per tile,
  a newline per row, then a newline, ``<fake_token_around_image><global-img>`` + the
  global view's tokens + ``<fake_token_around_image>``), each special token and newline
  counted as one token. An image no larger than one tile is not split: its tokens + 3.
- ``qwen2-vl``: ``smart_resize`` to multiples of 28 px with min_pixels 56 x 56 and
  max_pixels 28 x 28 x 1280 (transformers' defaults), one token per 28 x 28 px (14 px
  patches merged 2 x 2), plus ``<|vision_start|>`` and ``<|vision_end|>``.

Image sizes (an assumption: no public size distribution of chat images was at hand):
uniform over ``IMAGE_SIZES``, a menu of phone photos, screenshots, web images and
squares. Text: ShareGPT-like (prompt, output) pairs (``lengths.sample_lengths``); a
request's prompt = text prompt + its images' tokens; its output is cut so that prompt +
output <= ``max_len`` (at least 1 token); an image that would leave no room for one
output token is dropped with the ones after it, so a request may carry fewer images than
drawn (never for llava-1.5 at 4,096 tokens: 4 x 576 + a 1,024-token text fit; often for
idefics3, whose processor upscales every image to 12-16 tiles, 2,228-2,913 tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pagedjax.workloads.arrivals import arrival_times, arrivals_until
from pagedjax.workloads.lengths import sample_lengths
from pagedjax.workloads.record import Workload

# (width, height) in px.
IMAGE_SIZES: tuple[tuple[int, int], ...] = (
    (4032, 3024),  # phone photo, landscape
    (3024, 4032),  # phone photo, portrait
    (1920, 1080),  # screenshot
    (1280, 720),
    (1024, 768),  # web image
    (800, 600),
    (640, 480),
    (1080, 1080),  # square post
    (512, 512),
)


@dataclass(frozen=True)
class VisionFamily:
    """One family's image-token rule (module docstring). kind: "fixed", "tiles", "grid"."""

    name: str
    kind: str
    tokens: int = 0  # fixed: tokens per image; tiles: image_seq_len per tile
    tile: int = 0  # tiles: tile edge (px)
    longest_edge: int = 0  # tiles: the rescaled longest edge (px)
    factor: int = 28  # grid: px per token edge
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    extra_tokens: int = 0  # grid: tokens around the image

    def image_tokens(self, width: int, height: int) -> int:
        """Prompt tokens of one width x height image."""
        if width < 1 or height < 1:
            raise ValueError(f"image size must be >= 1 px, got {width} x {height}")
        if self.kind == "fixed":
            return self.tokens
        if self.kind == "tiles":
            rows, cols = idefics3_tiles(height, width, self.longest_edge, self.tile)
            if rows == cols == 0:
                return self.tokens + 3
            return rows * cols * (self.tokens + 2) + rows + 1 + 3 + self.tokens
        h, w = qwen2vl_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return (h // self.factor) * (w // self.factor) + self.extra_tokens


FAMILIES: dict[str, VisionFamily] = {
    "llava-1.5": VisionFamily("llava-1.5", "fixed", tokens=576),
    "idefics3": VisionFamily("idefics3", "tiles", tokens=169, tile=364, longest_edge=4 * 364),
    "smolvlm": VisionFamily("smolvlm", "tiles", tokens=81, tile=384, longest_edge=4 * 384),
    "qwen2-vl": VisionFamily("qwen2-vl", "grid", extra_tokens=2),
}


def vision_family(name: str) -> VisionFamily:
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def idefics3_tiles(height: int, width: int, longest_edge: int, tile: int) -> tuple[int, int]:
    """(rows, cols) of Idefics3's image splitting; (0, 0) when the image is not split
    (``Idefics3ImageProcessor.get_number_of_image_patches``)."""
    aspect = width / height
    if width >= height:  # _resize_output_size_rescale_to_max_len
        width = longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    # (_resize_output_size_scale_below_upper_bound: 4096 px, never reached from <= 4 tiles.)
    rh = math.ceil(height / tile) * tile
    rw = math.ceil(width / tile) * tile
    if rh > tile or rw > tile:
        return math.ceil(rh / tile), math.ceil(rw / tile)
    return 0, 0


def qwen2vl_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: (height, width) multiples of ``factor`` with the
    pixel count inside [min_pixels, max_pixels], aspect kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_chat(
    family: str,
    rate: float,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    images: tuple[int, int] = (1, 4),
    max_len: int = 4096,
    spread_scale: float = 1.0,
) -> Workload:
    """Image-chat requests: Poisson arrivals at ``rate`` (exactly one of num_requests and
    duration_s), each with a uniform number of images in ``images`` (inclusive), image
    sizes uniform over IMAGE_SIZES, ShareGPT-like text (module docstring).

    Returns a Workload named "image_chat:<family>" with source_len = max_len (its lengths
    are already in the model's context; do not rescale them).
    """
    fam = vision_family(family)
    lo, hi = images
    if not 1 <= lo <= hi:
        raise ValueError(f"images must be (lo, hi) with 1 <= lo <= hi, got {images}")
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    len_seed, arr_seed, img_seed = np.random.SeedSequence(seed).spawn(3)
    arr_rng = np.random.default_rng(arr_seed)
    if duration_s is not None:
        times = arrivals_until(duration_s, rate, arr_rng)
    else:
        times = arrival_times(num_requests, rate, arr_rng)
    n = len(times)
    text, output = sample_lengths("sharegpt", n, np.random.default_rng(len_seed), spread_scale)
    img_rng = np.random.default_rng(img_seed)
    count = img_rng.integers(lo, hi + 1, n)
    sizes = img_rng.integers(0, len(IMAGE_SIZES), (n, hi))
    per_size = np.array([fam.image_tokens(w, h) for w, h in IMAGE_SIZES], np.int64)
    prompt = np.empty(n, np.int64)
    for i in range(n):
        p = int(text[i])
        for k in range(int(count[i])):  # as many images as fit with >= 1 output token
            t = int(per_size[sizes[i, k]])
            if p + t >= max_len:
                break
            p += t
        prompt[i] = p
    out = np.clip(output, 1, max_len - prompt)
    return Workload(times, prompt, out, source_len=max_len, name=f"image_chat:{family}")
