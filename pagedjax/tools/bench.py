"""Engine throughput on the current device: ``python -m pagedjax.tools.bench``.

Runs the same batch of requests twice through ``LLM.generate`` (the first run includes
the compilation of every bucket it meets, the second is warm) and prints tokens/s.
Greedy with ignore_eos, so every request generates exactly its output length.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagedjax.entrypoints.llm import LLM
from pagedjax.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 128), help="min max")
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128), help="min max")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--num-blocks", type=int, default=None, help="num_gpu_blocks_override")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-format", default="auto", help="dummy: random weights for a directory")
    args = ap.parse_args()

    llm = LLM(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_blocks,
        seed=args.seed,
        load_format=args.load_format,
    )
    engine = llm.llm_engine
    vocab = engine.arch.vocab_size
    rng = np.random.default_rng(args.seed)
    lo, hi = args.input_len
    prompts = [rng.integers(3, vocab, size=rng.integers(lo, hi + 1)).tolist()
               for _ in range(args.num_requests)]  # fmt: skip
    lo, hi = args.output_len
    lens = rng.integers(lo, hi + 1, size=len(prompts))
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=int(n)) for n in lens]
    n_in = sum(map(len, prompts))
    blocks = engine.num_blocks
    print(f"model {args.model}, {len(prompts)} requests, {n_in} prompt tokens,"
          f" {int(lens.sum())} output tokens, {blocks} KV blocks")  # fmt: skip
    head = ("run", "seconds", "out tok/s", "total tok/s", "steps", "preempt")
    print("{:>6} {:>8} {:>10} {:>12} {:>6} {:>8}".format(*head))
    for run in ("cold", "warm"):
        steps0, pre0 = engine.num_steps, engine.num_preemptions
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{run:>6} {dt:8.2f} {n_out / dt:10.1f} {(n_in + n_out) / dt:12.1f}"
              f" {engine.num_steps - steps0:6d} {engine.num_preemptions - pre0:8d}")  # fmt: skip
    print(f"compiled buckets (T, S): {sorted(engine.runner.trace_count)}")


if __name__ == "__main__":
    main()
