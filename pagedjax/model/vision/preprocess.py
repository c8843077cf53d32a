"""Image bytes -> pixel_values through transformers' CLIPImageProcessor (PIL backend; no
torchvision), the exact preprocessing LLaVA checkpoints were trained with (resize shortest
edge, center crop, rescale, normalize)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def load_image(data: bytes) -> Any:
    """bytes -> RGB PIL image. Raises ValueError for bytes PIL cannot decode (corrupt or
    truncated) or a format outside SUPPORTED_FORMATS: a request error, not a server crash."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        fmt = img.format
        if fmt not in SUPPORTED_FORMATS:
            raise ValueError(f"unsupported image format {fmt!r}; supported: {SUPPORTED_FORMATS}")
        img.load()  # decode now: truncated data fails here, not later
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"cannot decode image ({len(data)} bytes): {e}") from e
    return img.convert("RGB")


def preprocess_images(images: list[bytes], processor: Any) -> np.ndarray:
    """Image bytes -> float32 pixel_values [B, 3, S, S] via ``processor`` (a
    CLIPImageProcessor, e.g. ``CLIPImageProcessor.from_pretrained(model_dir)``)."""
    pil = [load_image(b) for b in images]
    out = processor(images=pil, return_tensors="np")
    return np.asarray(out["pixel_values"], np.float32)
