"""int4's scale rule on the real model: absmax / 7 (15 codes), all 16 codes (pagedjax's
choice, ``quantize_int4``), and a per-group MSE clip search, each teacher-forced over the
first 512 tokens of the fixed text against the float32 load (the slow test's harness:
``score_text`` / ``quality_report``); docs/quantization.md has the table and the reasons.

    python benchmarks/int4_scale_choice.py [absmax7] [16codes] [mse_clip]

One line per variant: top-1 agreement, KL, perplexity and the rest of the report.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from pagedjax import LLM
from pagedjax.eval import load_text, quality_report, score_text
from pagedjax.model.quant import inflight
from pagedjax.model.quant.inflight import int4_group, quantize_int4, quantize_params
from pagedjax.model.quant.weight import QuantizedWeight, pack_nibbles


def _grouped(w: np.ndarray) -> tuple[np.ndarray, int]:
    gs = int4_group(w.shape[0])
    return np.asarray(w, np.float32).reshape(w.shape[0] // gs, gs, w.shape[1]), gs


def _weight(q: np.ndarray, s: np.ndarray, shape: tuple[int, int], gs: int) -> QuantizedWeight:
    codes = (q.astype(np.int32) + 8).reshape(shape)
    return QuantizedWeight(pack_nibbles(codes), np.asarray(s, np.float32), in_features=shape[0],
                           bits=4, group_size=gs, code_offset=8, fmt="int4").check()  # fmt: skip


def absmax7(w: np.ndarray) -> QuantizedWeight:
    """The first rule: s = absmax / 7, q in [-7, 7] (15 codes)."""
    g, gs = _grouped(w)
    s = np.abs(g).max(axis=1) / 7.0
    s = np.where(s > 0, s, 1.0)
    return _weight(np.clip(np.rint(g / s[:, None]), -7, 7), s, w.shape, gs)


CLIP_RATIOS = np.linspace(0.7, 1.0, 13)


def mse_clip(w: np.ndarray, ratios: np.ndarray = CLIP_RATIOS) -> QuantizedWeight:
    """s = r * absmax / 7 for the r of the grid with the lowest squared error, per group
    and column; values past 7 s are clipped (the error can exceed s / 2)."""
    g, gs = _grouped(w)
    amax = np.abs(g).max(axis=1)
    best_s, best_e = None, None
    for r in ratios:
        s = np.where(amax > 0, r * amax / 7.0, 1.0)
        e = ((np.clip(np.rint(g / s[:, None]), -7, 7) * s[:, None] - g) ** 2).sum(axis=1)
        if best_s is None:
            best_s, best_e = s, e
        else:
            better = e < best_e
            best_s, best_e = np.where(better, s, best_s), np.where(better, e, best_e)
    return _weight(np.clip(np.rint(g / best_s[:, None]), -7, 7), best_s, w.shape, gs)


VARIANTS = {"absmax7": absmax7, "16codes": quantize_int4, "mse_clip": mse_clip}


def main(names: list[str]) -> None:
    t0 = time.time()
    llm = LLM(model="smollm2-135m-instruct", max_model_len=640, max_num_seqs=4,
              max_num_batched_tokens=512, warmup="none")  # fmt: skip
    dense = llm.llm_engine.params
    ref = score_text(llm, load_text(), window=512, max_tokens=512)
    print(f"loaded and scored the float32 model in {time.time() - t0:.0f} s", flush=True)
    original = inflight.QUANTIZERS["int4"]
    for name in names or list(VARIANTS):
        inflight.QUANTIZERS["int4"] = VARIANTS[name]  # quantize_params reads the table
        try:
            llm.llm_engine.params = quantize_params(dense, "int4")
            report = quality_report(ref, score_text(llm, load_text(), window=512,
                                                    max_tokens=512))  # fmt: skip
        finally:
            inflight.QUANTIZERS["int4"] = original
            llm.llm_engine.params = dense
        print(name, {k: round(float(v), 4) for k, v in report.items()}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
