"""Images through the engine (LLaVA, Idefics3 / SmolVLM, Qwen2-VL): prompt expansion,
identity ids, the encoder cache, and for M-RoPE models (Qwen2-VL) the prompt's 3-D
rotary positions (engine/mrope.py).

vLLM's input form, ``{"prompt": "USER: <image>\\n... ASSISTANT:", "multi_modal_data":
{"image": img or [img, ...]}}``, becomes a request in three host steps at add_request
(``MultiModalRunner.prepare``) and one per model step (``MultiModalRunner.step_inputs``);
docs/multimodal.md gives the design and what is not built.

1. **Expansion.** Each image placeholder token of the tokenized prompt becomes the
   image's replacement ids (``PreparedImage``; what the family's transformers processor
   does to the text: LLaVA ``num_image_tokens`` copies of the placeholder, Idefics3 its
   tiles' runs of ``<image>`` between ``<fake_token_around_image>`` and row / column
   tags), so every later length (max_model_len, blocks, the scheduler's budget) sees the
   final count. A prompt already expanded (token ids from a client that expanded it) is
   accepted as it is. The count must match the images given: ValueError otherwise, as
   for more images than ``limit_mm_per_prompt`` or images sent to a text-only model.
   An image is one or more *tiles* (Idefics3's image splitting; LLaVA, Qwen2-VL: one);
   each tile is one run of ``tile_tokens`` placeholders (``num_image_tokens``; for
   Qwen2-VL its grid's, at most ``num_image_tokens``) and one encoder-cache entry.
2. **Identity ids.** The placeholder copies are the same id for every image, so the
   prefix cache (host hashes and the device's stored-token verification,
   memory/prefix_cache.py) would hand one image's KV to another. The request's
   ``prompt_token_ids`` therefore hold, at placeholder positions, negative ids derived
   from the image's content hash and the position inside the image (``identity_ids``):
   never a vocabulary id, equal only for equal pixels. The token buffer, the chained
   block hashes and the device verification see them unchanged (no change to the
   prefix cache or engine/block_hashes.py); outputs report the real ids.
3. **Preprocessing and hashing.** Images go through the checkpoint's image processor
   (PIL backend) once; the key of a tile is blake2b-64 of its pixel_values, so two
   encodings of the same pixels share features and KV.
4. **Per step.** The rows of the step's batch that prefill image positions (any slice
   of an image: chunked prefill may split it) name, per token, an encoder-cache entry
   and a row of it; images not in the cache are encoded first, batched (count padded
   to a power of two, so few programs compile). The model step gathers those rows in
   place of the identity ids' embeddings (model_runner.forward_sample's ``mm``).

Encoder cache (``EncoderCache``): a device array [C, N, H] of C images' projected
features plus a host LRU map key -> entry. It is a cache, never the only copy: a request
keeps its pixel_values until it finishes, so an image evicted between two chunks of its
prompt, or needed again by a recompute after preemption, is encoded again. C comes from
``MultiModalConfig.encoder_cache_size`` (rows, vLLM's unit); a step that needs more
images at once than fit grows the array (logged) instead of failing.

The families (which checkpoints, how they load, ``VisionModel``: the encoder and each
family's ``prepare``) are vision_models.py's; this module is the request path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pagedjax.config import MultiModalConfig
from pagedjax.engine.host_arrays import upload
from pagedjax.engine.mrope import RopeDeltas, step_positions
from pagedjax.engine.vision_models import VisionModel, load_engine_model  # (re-exported)
from pagedjax.model import ModelArch
from pagedjax.model.vision.preprocess import load_image

log = logging.getLogger(__name__)

Params = Any

# Identity ids lie in [-(2**31 - 1), -2]: negative (never a vocabulary id) and never -1,
# the prefix cache's and the token buffer's padding value.
_ID_SPAN = 2**31 - 2


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One tile of a prompt's image (an image, for LLaVA): key (64-bit content hash of
    its pixel_values), its placeholder run [offset, offset + length) in the expanded
    prompt, and its preprocessed pixel_values (kept until the request finishes): float32
    [3, S, S], or Qwen2-VL's patches [grid_h, grid_w, patch_dim] (the shape is the grid;
    length = grid_h * grid_w / merge^2, per image)."""

    key: int
    offset: int
    length: int
    pixel_values: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class MultiModalPrompt:
    """A prompt with images: token_ids, the real expanded ids (what outputs report);
    cache_ids, the same with identity ids at placeholder positions (what the engine
    stores, hashes and verifies); images: every image's tiles, in prompt order.
    M-RoPE models (Qwen2-VL, engine/mrope.py): rope_positions int32[3, len(token_ids)],
    rope_delta the offset of every token after the prompt; None / 0 otherwise."""

    token_ids: list[int]
    cache_ids: list[int]
    images: tuple[ImageInput, ...]
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 (wrapping arithmetic): a bijection that spreads
    every input bit over the output, so consecutive offsets give unrelated ids."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def identity_ids(key: int, length: int) -> np.ndarray:
    """int64[length]: the identity ids of an image's placeholder positions 0..length-1,
    in [-(2**31 - 1), -2] (int32-safe). Position i's id mixes the 64-bit key with i, so
    a block of 16 positions carries ~16 x 31 bits of the key (the device verification
    compares them all), not 31."""
    with np.errstate(over="ignore"):
        x = np.uint64(key) + np.arange(length, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return -(2 + (_mix64(x) % np.uint64(_ID_SPAN)).astype(np.int64))


def image_key(pixel_values: np.ndarray) -> int:
    """64-bit content hash of one image's preprocessed pixels (shape and bytes)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(pixel_values.shape).encode())
    h.update(np.ascontiguousarray(pixel_values, np.float32).tobytes())
    return int.from_bytes(h.digest(), "little")


def images_of(multi_modal_data: Any) -> list[Any]:
    """vLLM's ``multi_modal_data`` -> RGB PIL images. {"image": a PIL image, encoded
    bytes, or a list of them}; ValueError for another modality, another item type, or
    bytes that do not decode (preprocess.load_image)."""
    from PIL import Image

    if not isinstance(multi_modal_data, dict):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': img}}, got"
                         f" {type(multi_modal_data).__name__}")  # fmt: skip
    other = sorted(set(multi_modal_data) - {"image"})
    if other:
        raise ValueError(f"multi_modal_data: modality {other[0]!r} is not supported (images only)")
    items = multi_modal_data.get("image", [])
    if not isinstance(items, list | tuple):
        items = [items]
    out = []
    for i, item in enumerate(items):
        if isinstance(item, bytes | bytearray):
            item = load_image(bytes(item))
        if not isinstance(item, Image.Image):
            raise ValueError(f"multi_modal_data['image'][{i}]: expected a PIL image or image"
                             f" bytes, got {type(item).__name__}")  # fmt: skip
        out.append(item.convert("RGB"))
    return out


def expand_placeholders(ids: Sequence[int], token: int, replacements: Sequence[Sequence[int]],
                        n: int) -> list[int]:  # fmt: skip
    """ids with the k-th image placeholder ``token`` replaced by ``replacements[k]`` (the
    family processor's expansion), or ids unchanged when they are already expanded (as
    many placeholders as the replacements hold, in runs of multiples of n: one run per
    tile, adjacent tiles of LLaVA make one run). ValueError when they match neither."""
    ids = [int(t) for t in ids]
    count = sum(t == token for t in ids)
    if count == len(replacements):
        out: list[int] = []
        it = iter(replacements)
        for t in ids:
            out.extend(next(it) if t == token else [t])
        return out
    runs, run = [], 0
    for t in [*ids, None]:
        if t == token:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    want = sum(sum(t == token for t in r) for r in replacements)
    if replacements and count == want and all(r % n == 0 for r in runs):
        return ids
    raise ValueError(
        f"the prompt has {count} image placeholder token(s) (id {token}) for"
        f" {len(replacements)} image(s): write one placeholder per image"
    )


def split_mm(prompt: Any, runner: MultiModalRunner | None) -> tuple[Any, Any]:
    """(prompt without "multi_modal_data", that data or None). ValueError for images
    sent to a text-only model (runner None)."""
    if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
        return prompt, None
    prompt = dict(prompt)
    data = prompt.pop("multi_modal_data")
    if runner is None and data:
        raise ValueError("this model takes no images (multi_modal_data given to a text-only"
                         " model)")  # fmt: skip
    return prompt, data


def check_engine(config: Any, arch: ModelArch) -> None:
    """ValueError for engine options not built together with images."""
    if arch.family != "llama":
        raise ValueError(f"images need a Llama-family language model, not {arch.family!r}")
    if arch.mrope_section is not None and config.lora is not None:
        raise ValueError("enable_lora with an M-RoPE model (Qwen2-VL) is not built yet")
    if config.speculative is not None:
        raise ValueError("speculative decoding with a multi-modal model is not built yet")
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size > 1 with a multi-modal model is not built yet")
    if config.parallel.pipeline_parallel_size > 1:
        raise ValueError("pipeline_parallel_size > 1 with a multi-modal model is not built yet")
    if config.cache.kv_scales == "calibrate":
        raise ValueError("kv_scales='calibrate' with a multi-modal model is not built yet")


class EncoderCache:
    """Projected image features on device, by image key, least recently used evicted
    (see the module docstring). ``cache``: [C, N, H] in the model dtype."""

    def __init__(self, capacity: int, num_rows: int, hidden: int, dtype: Any):
        self.cache = jnp.zeros((capacity, num_rows, hidden), dtype)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # key -> slot, LRU first
        self._free = list(range(capacity))
        self.hits = self.encoded = self.evicted = self.grown = 0
        self.encoded_tokens = 0  # image tokens encoded (the encoder budget's unit)
        self.encoder_seconds = 0.0

    @property
    def capacity(self) -> int:
        return int(self.cache.shape[0])

    def __contains__(self, key: int) -> bool:
        return key in self._slot_of

    def ensure(self, images: Sequence[ImageInput], vision: VisionModel) -> dict[int, int]:
        """Entry slot of each image's key, encoding those not cached (one batched call);
        entries the images need are never evicted to make room for each other."""
        wanted: dict[int, ImageInput] = {}
        for img in images:
            wanted.setdefault(img.key, img)
        missing = []
        for key, img in wanted.items():
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
                self.hits += 1
            else:
                missing.append(img)
        if missing:
            self._make_room(len(missing), set(wanted))
            slots = [self._free.pop() for _ in missing]
            t0 = time.perf_counter()
            self.cache = vision.encode_into(self.cache, slots,
                                            [img.pixel_values for img in missing])  # fmt: skip
            self.cache.block_until_ready()  # the encoder's time, not the next step's
            self.encoder_seconds += time.perf_counter() - t0
            self.encoded += len(missing)
            self.encoded_tokens += sum(img.length for img in missing)
            for img, slot in zip(missing, slots, strict=True):
                self._slot_of[img.key] = slot
        return {key: self._slot_of[key] for key in wanted}

    def _make_room(self, n: int, keep: set[int]) -> None:
        for key in list(self._slot_of):
            if len(self._free) >= n:
                return
            if key not in keep:
                self._free.append(self._slot_of.pop(key))
                self.evicted += 1
        if len(self._free) < n:  # this step needs more images at once than fit: grow
            extra = n - len(self._free)
            c = self.capacity
            log.warning("encoder cache grows from %d to %d images (one step needs them all)",
                        c, c + extra)
            pad = jnp.zeros((extra, *self.cache.shape[1:]), self.cache.dtype)
            self.cache = jnp.concatenate([self.cache, pad])
            self._free.extend(range(c, c + extra))
            self.grown += 1


class MultiModalRunner:
    """The engine's image path (module docstring): ``prepare`` at add_request,
    ``step_inputs`` per model step, ``stats`` for ``LLMEngine.stats``."""

    def __init__(self, vision: VisionModel, config: MultiModalConfig, token_budget: int,
                 hidden: int, max_seqs: int = 1):  # fmt: skip
        self.vision, self.config = vision, config
        n = vision.num_image_tokens
        rows = config.encoder_cache_size or max(token_budget, n)
        self.encoder_cache = EncoderCache(max(1, rows // n), n, hidden, vision.dtype)
        self.split_slices = 0  # steps' slices of an image shorter than the image (chunking)
        # M-RoPE (Qwen2-VL): each slot's rotary offset, the step's 3-D positions (mrope.py)
        self.rope_deltas = RopeDeltas(max_seqs) if vision.mrope else None
        # The encoder budget (admit): image tokens left this step; tokens encoded this step
        # (admission and the step itself) and the most in any step; requests held back.
        self._budget_left = 0
        self._step_tokens = 0
        self.max_step_encoder_tokens = 0
        self.held_passes = 0
        self._waits: dict[str, int] = {}  # request id -> passes held so far

    @classmethod
    def build(cls, vision: VisionModel | None, config: Any, arch: ModelArch
              ) -> MultiModalRunner | None:  # fmt: skip
        """The engine's runner (None without a vision model), after refusing the engine
        options not built with images (``check_engine``). config: the EngineConfig."""
        if vision is None:
            return None
        check_engine(config, arch)
        if vision.mrope != (arch.mrope_section is not None):
            raise ValueError("the vision model and the language model disagree on M-RoPE")
        return cls(vision, config.multimodal, config.scheduler.max_num_batched_tokens,
                   arch.hidden_size, config.scheduler.max_num_seqs)  # fmt: skip

    @property
    def image_token_id(self) -> int:
        return self.vision.image_token_id

    def prepare(self, ids: list[int], multi_modal_data: Any, params: Any = None
                ) -> MultiModalPrompt | None:  # fmt: skip
        """The request's MultiModalPrompt (None for a prompt without images or
        placeholders). Raises ValueError, changing nothing, on more images than
        limit_mm_per_prompt, a placeholder count that does not match the images,
        images that do not decode, or prompt_logprobs (params) with images."""
        images = images_of(multi_modal_data) if multi_modal_data is not None else []
        limit = self.config.limit("image")
        if len(images) > limit:
            raise ValueError(f"{len(images)} images in one prompt; limit_mm_per_prompt"
                             f" allows {limit}")  # fmt: skip
        tok = self.image_token_id
        if not images and tok not in ids:
            return None
        if params is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs with images is not built yet")
        prepared = self.vision.prepare(images) if images else []
        expanded = expand_placeholders(ids, tok, [p.replacement for p in prepared],
                                       self.vision.run_unit)  # fmt: skip
        cache_ids = np.asarray(expanded, np.int64)
        # Tile k (all images' tiles in prompt order) owns the next tile_tokens(tile)
        # placeholders (adjacent tiles make one run, as in transformers' merge).
        tiles = [t for p in prepared for t in p.tiles]
        inputs, cursor = [], 0
        for px in tiles:
            length = self.vision.tile_tokens(px)
            start = expanded.index(tok, cursor)
            if expanded[start : start + length].count(tok) != length:
                raise ValueError(f"an image's placeholder run at {start} is not {length} long")
            key = image_key(px)
            cache_ids[start : start + length] = identity_ids(key, length)
            inputs.append(ImageInput(key, start, length, px))
            cursor = start + length
        pos, delta = (self.vision.rope_positions(len(expanded), inputs) if self.vision.mrope
                      else (None, 0))  # fmt: skip
        return MultiModalPrompt(expanded, cache_ids.tolist(), tuple(inputs), pos, delta)

    def begin_pass(self) -> None:
        """A new admission pass (one per engine step): the encoder budget is full again."""
        self._end_step()
        self._budget_left = self.config.max_num_encoder_input_tokens or 0

    def _end_step(self) -> None:
        self.max_step_encoder_tokens = max(self.max_step_encoder_tokens, self._step_tokens)
        self._step_tokens = 0

    def admit(self, req: Any) -> bool:
        """Whether the queued request ``req`` may take a slot now (``admission``).

        Without a budget (``max_num_encoder_input_tokens`` None), or for a request without
        images, always. Else its tiles not in the encoder cache are encoded, in prompt
        order, while this step's budget lasts (the first tile of a step is encoded even
        when it alone exceeds the budget, so no image waits forever), and the request is
        admitted once none is missing: a request with many or large images is encoded
        over several steps while running requests keep decoding. Held tiles may be
        evicted by other images meanwhile; so that a request never waits forever, after
        as many passes as it had tiles missing at first (+ 1) it is admitted and its
        step encodes what is still missing."""
        mm = req.multi_modal
        if not self.config.max_num_encoder_input_tokens or mm is None:
            return True
        cache = self.encoder_cache
        missing = list({img.key: img for img in mm.images if img.key not in cache}.values())
        if not missing:
            self._waits.pop(req.request_id, None)
            return True
        waited = self._waits.setdefault(req.request_id, 0)
        if waited > len(mm.images):
            self._waits.pop(req.request_id)
            return True
        take = []
        for img in missing:
            if img.length > self._budget_left and (take or self._step_tokens):
                break
            take.append(img)
            self._budget_left -= img.length
        if take:
            cache.ensure(take, self.vision)
            self._step_tokens += sum(img.length for img in take)
        if len(take) == len(missing):
            self._waits.pop(req.request_id, None)
            return True
        self._waits[req.request_id] = waited + 1
        self.held_passes += 1
        return False

    def step_inputs(self, host: dict, owners: list, num_tokens: int) -> tuple | None:
        """The model step's ``mm`` argument (encoder cache, image_slot int32[T], image_row
        int32[T]) when the step prefills image positions, else None. host: the step's
        read-back batch (q_lens, start_pos per row); owners[r]: row r's (request,
        sequence); num_tokens: the step's padded token count T."""
        segments = []
        cu = 0
        for r, (req, _) in enumerate(owners):
            start, q = int(host["start_pos"][r]), int(host["q_lens"][r])
            mm = req.multi_modal
            for img in mm.images if mm is not None else ():
                lo, hi = max(start, img.offset), min(start + q, img.offset + img.length)
                if lo < hi:
                    segments.append((cu + lo - start, img, lo - img.offset, hi - lo))
            cu += q
        rope = None
        if self.rope_deltas is not None:  # M-RoPE: any prompt row of an image request
            if not segments and not any(
                o[0].multi_modal is not None and int(host["start_pos"][r])
                < len(o[0].multi_modal.token_ids) for r, o in enumerate(owners)
            ):  # fmt: skip
                return None  # decode rows and text: the per-slot deltas suffice
            rope = upload(step_positions(owners, host, num_tokens))
        elif not segments:
            return None
        self.split_slices += sum(count < img.length for _, img, _, count in segments)
        before = self.encoder_cache.encoded_tokens
        slots = self.encoder_cache.ensure([s[1] for s in segments], self.vision)
        self._step_tokens += self.encoder_cache.encoded_tokens - before
        self._end_step()
        image_slot = np.full(num_tokens, -1, np.int32)
        image_row = np.zeros(num_tokens, np.int32)
        for flat, img, first, count in segments:
            image_slot[flat : flat + count] = slots[img.key]
            image_row[flat : flat + count] = np.arange(first, first + count)
        mm = (self.encoder_cache.cache, *upload((image_slot, image_row)))
        return mm if rope is None else (*mm, rope)

    @property
    def encoder_compilations(self) -> int:
        """Image encoder programs compiled so far (their traces: ``VisionModel.trace_count``)."""
        return sum(self.vision.trace_count.values())

    def padding_inputs(self, num_tokens: int) -> tuple:
        """A step's ``mm`` argument that gathers no image row (every token's slot -1; an
        M-RoPE model's positions all 0), of the pytree, shapes, dtypes and placement
        ``step_inputs`` gives a step of ``num_tokens`` (padded) tokens: what the warm-up
        compiles the image step program on (engine/warmup.py)."""
        slot, row = np.full(num_tokens, -1, np.int32), np.zeros(num_tokens, np.int32)
        mm = (self.encoder_cache.cache, *upload((slot, row)))
        if self.rope_deltas is None:
            return mm
        return (*mm, upload(np.zeros((3, num_tokens), np.int32)))

    def stats(self) -> dict[str, float | int]:
        """mm_images_encoded: encoder runs' images; mm_encoder_cache_hits: images a step
        found cached; mm_encoder_cache_evictions; mm_encoder_seconds: encoder wall time
        (synchronized); mm_encoder_cache_images: the cache's capacity now;
        mm_split_image_slices: a step's part of an image that was not the whole image
        (chunked prefill cut the image); mm_max_step_encoder_tokens: the most image tokens
        encoded in one engine step (admission and the step itself); mm_admission_holds:
        admission passes a request waited for its images (the encoder budget)."""
        c = self.encoder_cache
        self._end_step()
        return dict(mm_images_encoded=c.encoded, mm_encoder_cache_hits=c.hits,
                    mm_encoder_cache_evictions=c.evicted, mm_encoder_seconds=c.encoder_seconds,
                    mm_encoder_cache_images=c.capacity,
                    mm_split_image_slices=self.split_slices,
                    mm_max_step_encoder_tokens=self.max_step_encoder_tokens,
                    mm_admission_holds=self.held_passes)  # fmt: skip

    def reset_stats(self) -> None:
        self.split_slices = self.max_step_encoder_tokens = self.held_passes = 0
        c = self.encoder_cache
        c.hits = c.encoded = c.evicted = c.grown = c.encoded_tokens = 0
        c.encoder_seconds = 0.0


__all__ = [
    "EncoderCache",
    "ImageInput",
    "MultiModalPrompt",
    "MultiModalRunner",
    "VisionModel",
    "check_engine",
    "expand_placeholders",
    "identity_ids",
    "image_key",
    "images_of",
    "load_engine_model",
    "split_mm",
]
