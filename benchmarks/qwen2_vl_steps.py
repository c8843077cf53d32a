"""Qwen2-VL on the paged engine: encoder time per image grid, prefill with an image vs
text of the same length, and decode steps of image requests (M-RoPE deltas) vs text
requests (docs/multimodal.md has the numbers and the command).

    python benchmarks/qwen2_vl_steps.py [--model DIR] [--reps 10]

DIR: a Qwen2VLForConditionalGeneration checkpoint with its tokenizer and
preprocessor_config.json; without --model the tiny one tests/test_qwen2_vl.py builds is
written to a temporary directory. Every timing follows one untimed run of the same
shapes (compiles excluded); prefix caching off; a new image every request.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _write_tiny() -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.test_qwen2_vl import qwen2vl

    class _Factory:
        def mktemp(self, _name: str) -> Path:
            return Path(tempfile.mkdtemp(prefix="qwen2vl_"))

    return qwen2vl.__wrapped__(_Factory())[0]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args(argv)
    model = args.model or str(_write_tiny())
    from PIL import Image

    from pagedjax import LLM, SamplingParams

    rng = np.random.default_rng(0)
    image = lambda: Image.fromarray(rng.integers(0, 255, (40, 48, 3), np.uint8))
    llm = LLM(model=model, enable_prefix_caching=False, block_size=8, max_model_len=256,
              num_gpu_blocks_override=256, max_num_seqs=args.batch,
              max_num_batched_tokens=512, warmup="none")  # fmt: skip
    engine, b = llm.llm_engine, args.batch
    text = "User: <|vision_start|><|image_pad|><|vision_end|>What is this?"
    n_img = len(engine.mm.vision.prepare([image()])[0].replacement)
    plain = "User: " + "x" * (n_img + 2) + "What is this?"

    def timed(make, max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(make(), params, use_tqdm=False)  # compile these shapes
        t0 = time.perf_counter()
        for _ in range(args.reps):
            llm.generate(make(), params, use_tqdm=False)
        return (time.perf_counter() - t0) / args.reps

    with_image = lambda: [{"prompt": text, "multi_modal_data": {"image": image()}}
                          for _ in range(b)]  # fmt: skip
    out: dict = {"image_tokens": n_img, "batch": b}
    for name, make in (("image", with_image), ("text", lambda: [plain] * b)):
        t1, t33 = timed(make, 1), timed(make, 33)
        out[f"prefill_ms_{name}"] = round(t1 * 1e3, 2)
        out[f"decode_ms_per_step_{name}"] = round((t33 - t1) / 32 * 1e3, 3)
    vision = engine.mm.vision
    for size in ((40, 24), (48, 40), (96, 80)):
        im = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), np.uint8))
        tile = vision.prepare([im])[0].tiles[0]
        vision.encode_tiles([tile]).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            vision.encode_tiles([tile]).block_until_ready()
        key = f"encoder_ms_{tile.shape[0]}x{tile.shape[1]}_patches"
        out[key] = round((time.perf_counter() - t0) / args.reps * 1e3, 3)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
