"""Offline throughput of ``LLM.generate`` per attention backend (random weights of a preset).

    python -m pagedjax.tools.offline_throughput --model llama-2-7b --dtype bfloat16 \
        --num-requests 256 --prompt-len 128 --output-len 128 --backends reference triton
    python -m pagedjax.tools.offline_throughput --tiny          # seconds on a CPU

For each backend: one ``LLM`` (preset weights drawn at random, greedy, ``ignore_eos``, so
every request generates exactly ``output_len`` tokens), one untimed run of the same workload
(compiles every step shape it meets), then a timed run. Prints prompt + generated tokens
per second and generated tokens per second, and a last line per backend
``offline_throughput_tok_s[<backend>]: <generated tokens / s>``. A backend that cannot
start here (e.g. ``triton`` without a CUDA GPU) is reported and skipped. Used by
``python -m pagedjax.gpu_check`` (the end-to-end part).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import jax
import numpy as np

from pagedjax import LLM
from pagedjax.sampling import SamplingParams


def run_backend(args: argparse.Namespace, backend: str) -> dict:
    llm = LLM(
        args.model, dtype=args.dtype, attention_backend=backend,
        max_model_len=args.prompt_len + args.output_len + 1,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_scheduler_steps=args.multi_steps, seed=0, warmup=args.warmup,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.arch.vocab_size
    prompts = [
        {"prompt_token_ids": rng.integers(3, vocab, args.prompt_len).tolist()}
        for _ in range(args.num_requests)
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # compiles the step shapes
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    name = llm.llm_engine.attention_backend
    del llm
    gc.collect()
    return dict(
        backend=backend, chosen=name, seconds=seconds, generated=generated,
        total=generated + args.num_requests * args.prompt_len,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", help="preset name (random weights)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--multi-steps", type=int, default=8, help="K of the decode loop")
    ap.add_argument("--backends", nargs="+", default=["auto"])
    ap.add_argument("--warmup", default="none", choices=["auto", "all", "decode", "none"],
                    help="LLM's start-up compilation; the untimed first run compiles what the"
                         " workload meets anyway")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="tiny-llama, 4 requests (CPU smoke)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.model, args.dtype, args.num_requests = "tiny-llama", "float32", 4
        args.prompt_len, args.output_len, args.max_num_seqs = 8, 4, 4
        args.max_num_batched_tokens, args.multi_steps = 32, 1
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.device_kind} ({dev.platform}), load average {load}")
    print(f"model {args.model} (random {args.dtype}), {args.num_requests} requests x"
          f" ({args.prompt_len} prompt + {args.output_len} generated) tokens, greedy,"
          f" K={args.multi_steps}")  # fmt: skip
    failed = 0
    for backend in args.backends:
        try:
            r = run_backend(args, backend)
        except Exception as e:  # a backend this machine cannot run is reported, not fatal
            failed += 1
            print(f"{backend}: could not run: {type(e).__name__}: {e}"[:400])
            continue
        print(f"{backend} (ran {r['chosen']}): {r['seconds']:.2f} s,"
              f" {r['total'] / r['seconds']:.0f} tok/s prompt + generated,"
              f" {r['generated'] / r['seconds']:.0f} generated tok/s")  # fmt: skip
        print(f"offline_throughput_tok_s[{backend}]: {r['generated'] / r['seconds']:.1f}")
    return 1 if failed == len(args.backends) else 0


if __name__ == "__main__":
    raise SystemExit(main())
