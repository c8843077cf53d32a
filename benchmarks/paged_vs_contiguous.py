"""pagedjax (paged KV) against a contiguous-KV baseline at equal KV memory (CPU).

    python benchmarks/paged_vs_contiguous.py [--tiny] [--num-requests 200] [--slots 8]

Both engines run the same model weights (the paged engine's), the same ShareGPT-like
requests scaled to max_model_len (all arriving at t = 0, greedy, every request generating
exactly its output length) and the same KV memory: the paged engine gets a pool of
``num_blocks = 1 + slots * ceil(max_model_len / block_size)`` blocks and the baseline
(``pagedjax.baselines.contiguous``) cuts the same pool into ``slots`` max_model_len regions,
one per running sequence (a reservation by max_model_len, contiguous pages, the model code
reused). Each engine runs the workload once to compile its buckets, then once timed; the
timed run must compile nothing (checked by the trace counters). The concurrency reported is
the largest number of sequences holding KV at once, measured during the timed runs, and the
last line is the ratio paged / contiguous.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import jax
import numpy as np

from pagedjax import LLM, SamplingParams
from pagedjax.baselines.contiguous import ContiguousEngine
from pagedjax.machine import cpu_model
from pagedjax.scheduler.state import RUNNING
from pagedjax.workloads import make_workload


def run_paged(llm: LLM, prompts: list[list[int]], out_lens: list[int]) -> dict:
    """Drives the engine step by step (to read its running count); returns measurements."""
    engine = llm.llm_engine
    traces0 = sum(engine.runner.trace_count.values())
    steps0, pre0 = engine.num_steps, engine.num_preemptions
    base = f"r{time.monotonic_ns()}-"
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens, strict=True)):
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
        engine.add_request(f"{base}{i}", p, sp)
    max_running, n_out = 0, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        # Sequences holding KV this step: those that got a token, or are still RUNNING.
        running = int(np.asarray(engine.state.status == RUNNING).sum())
        max_running = max(max_running, running, len(outs))
        n_out += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    dt = time.perf_counter() - t0
    return dict(
        seconds=dt,
        out_tokens=n_out,
        steps=engine.num_steps - steps0,
        max_running=max_running,
        preemptions=engine.num_preemptions - pre0,
        compiles=sum(engine.runner.trace_count.values()) - traces0,
    )


def run_contiguous(base: ContiguousEngine, prompts: list[list[int]], out_lens: list[int]) -> dict:
    r = base.generate(prompts, out_lens)
    return dict(
        seconds=r.seconds,
        out_tokens=sum(map(len, r.outputs)),
        steps=r.steps,
        max_running=r.max_running,
        preemptions=0,
        compiles=r.compiles,
    )


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    ap.add_argument("--model", default="tiny-llama", help="preset name or HF directory")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--slots", type=int, default=None, help="contiguous slots; sets KV memory")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    num_requests = args.num_requests or (8 if args.tiny else 200)
    max_len = args.max_model_len or (64 if args.tiny else 512)
    slots = args.slots or (2 if args.tiny else 8)
    bs = args.block_size
    num_blocks = 1 + slots * math.ceil(max_len / bs)
    budget = max_len  # tokens per step: one whole prompt always fits, for both engines

    wl = make_workload("sharegpt", math.inf, num_requests=num_requests, seed=args.seed)
    wl = wl.scale_to_context(max_len)
    llm = LLM(
        model=args.model,
        max_model_len=max_len,
        block_size=bs,
        num_gpu_blocks_override=num_blocks,
        max_num_seqs=8 if args.tiny else 256,
        max_num_batched_tokens=budget,
        seed=args.seed,
        enable_prefix_caching=False,  # the contiguous baseline has none: compare like with like
    )
    engine = llm.llm_engine
    rng = np.random.default_rng(args.seed)
    vocab = engine.arch.vocab_size
    prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in wl.prompt_len]
    out_lens = [int(n) for n in wl.output_len]
    base = ContiguousEngine(
        engine.arch,
        engine.params,
        num_blocks=num_blocks,
        block_size=bs,
        max_model_len=max_len,
        max_num_batched_tokens=budget,
        kv_dtype=engine.kv[0].dtype,
    )

    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cpus,"
          f" {cpu_model()}")  # fmt: skip
    print(f"model {args.model}, {num_requests} sharegpt requests scaled to {max_len} tokens:"
          f" {int(wl.prompt_len.sum())} prompt + {sum(out_lens)} output tokens;"
          f" KV memory {num_blocks} blocks x {bs} tokens = {slots} max-len slots")  # fmt: skip
    results = {}
    for name, fn in (("paged", lambda: run_paged(llm, prompts, out_lens)),
                     ("contiguous", lambda: run_contiguous(base, prompts, out_lens))):  # fmt: skip
        fn()  # warm-up: the identical workload compiles every bucket the timed run meets
        results[name] = fn()
    head = ("engine", "max concurrent", "seconds", "out tok/s", "steps", "preempt", "compiles")
    print("{:>10} | {:>14} | {:>8} | {:>9} | {:>6} | {:>7} | {:>8}".format(*head))
    for name, r in results.items():
        print(f"{name:>10} | {r['max_running']:>14} | {r['seconds']:>8.2f} |"
              f" {r['out_tokens'] / r['seconds']:>9.1f} | {r['steps']:>6} |"
              f" {r['preemptions']:>7} | {r['compiles']:>8}")  # fmt: skip
    p, c = results["paged"], results["contiguous"]
    tput = (p["out_tokens"] / p["seconds"]) / (c["out_tokens"] / c["seconds"])
    print(f"throughput ratio (paged / contiguous): {tput:.2f}")
    ratio = p["max_running"] / c["max_running"]
    print(f"concurrency_ratio: {ratio:.2f}")
    return ratio


if __name__ == "__main__":
    main()
