"""Encoder time per image and prefill throughput with and without an image, on a LLaVA
checkpoint directory (docs/multimodal.md has the numbers and the command).

    python benchmarks/multimodal_prefill.py --model DIR [--reps 20]

DIR: a LlavaForConditionalGeneration checkpoint with its tokenizer (an "<image>" token)
and preprocessor_config.json, e.g. the tiny one tests/test_multimodal_engine.py writes
(``--write-tiny DIR`` writes that one first). Each measurement runs after one untimed
run of the same shapes (compiles excluded); prefix caching off, so every request
prefills its whole prompt; max_tokens=1, so the time is the prefill's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _image(seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (30, 40, 3), np.uint8))


def write_tiny(directory: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_multimodal_engine import llava

    class _Factory:
        def mktemp(self, _name: str) -> Path:
            directory.mkdir(parents=True, exist_ok=True)
            return directory

    llava.__wrapped__(_Factory())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--write-tiny", action="store_true", help="write the tiny test LLaVA first")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4, help="requests per timed generate call")
    args = ap.parse_args(argv)
    if args.write_tiny:
        write_tiny(Path(args.model))
    from pagedjax import LLM, SamplingParams

    llm = LLM(model=args.model, enable_prefix_caching=False, block_size=8,
              num_gpu_blocks_override=256, max_num_seqs=args.batch, max_model_len=256,
              max_num_batched_tokens=512, warmup="none")  # fmt: skip
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    text = "USER: <image>\nWhat is this? ASSISTANT:"
    n_img = engine.mm.vision.num_image_tokens
    with_image = engine.tokenize_prompt(text)[1]
    prompt_len = len(with_image) - 1 + n_img
    # Text of the same token count: the image's placeholder replaced by n_img letters.
    plain = "USER: " + "x" * n_img + "\nWhat is this? ASSISTANT:"
    assert len(engine.tokenize_prompt(plain)[1]) == prompt_len

    def timed(make) -> float:
        llm.generate(make(0), params, use_tqdm=False)  # compile these shapes
        t0 = time.perf_counter()
        for r in range(args.reps):
            llm.generate(make(r + 1), params, use_tqdm=False)
        return (time.perf_counter() - t0) / args.reps

    b = args.batch
    seed = iter(range(10**6))  # a new image every request: the encoder runs every time
    t_img = timed(lambda r: [{"prompt": text, "multi_modal_data": {"image": _image(next(seed))}}
                             for _ in range(b)])  # fmt: skip
    t_txt = timed(lambda r: [plain] * b)
    # The encoder alone, one image and a batch of b, synchronized.
    vision = engine.mm.vision
    px = np.concatenate([p.tiles for p in vision.prepare([_image(i) for i in range(b)])])
    for n in (1, b):
        vision.encode_tiles(list(px[:n])).block_until_ready()
    enc = {}
    for n in (1, b):
        t0 = time.perf_counter()
        for _ in range(args.reps):
            vision.encode_tiles(list(px[:n])).block_until_ready()
        enc[n] = (time.perf_counter() - t0) / args.reps / n
    imgs = [_image(i) for i in range(b)]
    t0 = time.perf_counter()
    for _ in range(args.reps):
        for im in imgs:  # one request's image at a time, as add_request does
            vision.prepare([im])
    pre_ms = (time.perf_counter() - t0) / args.reps / b * 1e3
    out = {
        "preprocess_ms_per_image": round(pre_ms, 3),
        "prompt_tokens": prompt_len,
        "image_tokens": n_img,
        "batch": b,
        "encoder_ms_per_image_batch1": round(enc[1] * 1e3, 3),
        f"encoder_ms_per_image_batch{b}": round(enc[b] * 1e3, 3),
        "prefill_tok_per_s_with_image": round(b * prompt_len / t_img, 1),
        "prefill_tok_per_s_text_only": round(b * prompt_len / t_txt, 1),
        "generate_ms_with_image": round(t_img * 1e3, 2),
        "generate_ms_text_only": round(t_txt * 1e3, 2),
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
