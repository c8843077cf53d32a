"""Offline throughput on CPU: pagedjax against Hugging Face transformers ``generate``.

    python benchmarks/throughput_vs_hf.py [--tiny] [--num-requests 200] [--model-size 58m]
                                          [--multi-steps 8]

One random-weight fp32 LlamaForCausalLM is built with transformers, saved with
``save_pretrained`` into a temp directory, and loaded by both sides (``LLM(model=dir)``).
Requests: ShareGPT-like lengths (``make_workload("sharegpt")``) scaled to the model's
context, random prompt ids, greedy, every request generating exactly its own output length
(pagedjax: ``ignore_eos=True, max_tokens=n``; HF: ``min_new_tokens = max_new_tokens`` =
the batch's longest output, counting only each request's own length).

- HF: static batches in request order, left-padded to the batch's longest prompt (as
  people batch with ``generate``), batch size 8, 32 and 64; the best one is the baseline.
  Warmed up with one small ``generate`` call first.
- pagedjax: ``LLM.generate`` with continuous batching and the K-step on-device decode
  loop (``--multi-steps K``, ``LLM(num_scheduler_steps=K)``; 1 = one dispatch per step;
  docs/engine.md, "Multi-step decoding"). Warmed up by running the same lengths with
  other prompt ids once (so no prompt of the timed run is in the prefix cache; the
  timed run then meets only compiled programs; the engine's compile
  count, ``stats()["compilations"]``, must not move during the timed run, and the table
  shows it).
- Threads: XLA's CPU client runs one Eigen thread per core (``os.cpu_count()``); torch is
  set to the same number with ``torch.set_num_threads`` (``--threads`` overrides torch's).

Only output tokens count. The last line is pagedjax's tokens/s over the best HF's.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import numpy as np
import torch
import transformers

from pagedjax.machine import cpu_model

# Llama shapes: vocab, hidden, layers, heads, kv heads, intermediate, context.
SIZES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (512, 64, 2, 4, 2, 128, 128),
    "34m": (8192, 512, 8, 8, 8, 1376, 512),  # issue 13's 8-layer model (bench llama-34m-8l)
    "58m": (32000, 512, 8, 8, 8, 1376, 512),
    "106m": (32000, 768, 8, 12, 12, 2048, 512),
}
HF_BATCH_SIZES = (8, 32, 64)


def build_model(size: str, directory: str, seed: int) -> tuple[int, int]:
    """Saves a random fp32 Llama of the given size; returns (parameter count, context)."""
    vocab, hidden, layers, heads, kv_heads, inter, ctx = SIZES[size]
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        max_position_embeddings=ctx,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters()), ctx


def run_hf(
    model: transformers.LlamaForCausalLM,
    prompts: list[list[int]],
    out_lens: list[int],
    batch_size: int,
) -> tuple[float, int]:
    """Static batches, left-padded; returns (seconds, counted output tokens)."""
    counted = 0
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        ps, ns = prompts[b : b + batch_size], out_lens[b : b + batch_size]
        width = max(map(len, ps))
        ids = torch.zeros((len(ps), width), dtype=torch.long)  # pad id 0
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        m = max(ns)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=m,
                min_new_tokens=m,  # no early EOS: every row runs the batch's longest output
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + m, out.shape
        counted += sum(ns)  # each request's own output length only
    return time.perf_counter() - t0, counted


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--model-size", choices=sorted(SIZES), default=None)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--multi-steps", type=lambda v: v if v == "auto" else int(v), default=8,
        help='K of the decode loop, or "auto" (the engine default: 1 on a CPU)',
    )  # fmt: skip
    args = ap.parse_args(argv)
    size = args.model_size or ("tiny" if args.tiny else "58m")
    num_requests = args.num_requests or (8 if args.tiny else 200)
    hf_sizes = args.hf_batch_sizes or ((4, 8) if args.tiny else HF_BATCH_SIZES)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # keep stdout to the table

    import jax

    from pagedjax import LLM, SamplingParams  # after torch's thread setting
    from pagedjax.workloads import make_workload

    with tempfile.TemporaryDirectory() as d:
        n_params, ctx = build_model(size, d, args.seed)
        wl = make_workload("sharegpt", math.inf, num_requests=num_requests, seed=args.seed)
        wl = wl.scale_to_context(ctx)
        rng = np.random.default_rng(args.seed)
        vocab = SIZES[size][0]
        prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in wl.prompt_len]
        # pagedjax's warm-up run: the same lengths (the same buckets), other ids, so the
        # timed run finds none of its prompts in the prefix cache (on by default).
        warm_prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in wl.prompt_len]
        out_lens = [int(n) for n in wl.output_len]
        n_out = sum(out_lens)
        print(f"jax {jax.__version__}, torch {torch.__version__}, transformers"
              f" {transformers.__version__}; {os.cpu_count()} cpus ({cpu_model()});"
              f" torch threads {torch.get_num_threads()}, XLA: one per core")  # fmt: skip
        print(f"model llama-{size}: {n_params / 1e6:.1f}M params, fp32, context {ctx};"
              f" {num_requests} sharegpt requests: {int(wl.prompt_len.sum())} prompt +"
              f" {n_out} output tokens")  # fmt: skip

        # Rows are printed as they are measured (flushed): a long run shows partial results.
        print(f"{'engine':>24} | {'seconds':>8} | {'out tokens':>10} | {'out tok/s':>9} | notes")
        rows: list[tuple[str, float, int, str]] = []

        def row(name: str, sec: float, tok: int, note: str = "") -> None:
            rows.append((name, sec, tok, note))
            print(f"{name:>24} | {sec:>8.2f} | {tok:>10} | {tok / sec:>9.1f} | {note}", flush=True)

        hf = transformers.LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        run_hf(hf, prompts[:2], [2, 2], 2)  # warm-up
        best_hf = 0.0
        for bs in hf_sizes:
            dt, counted = run_hf(hf, prompts, out_lens, bs)
            best_hf = max(best_hf, counted / dt)
            row(f"HF generate, batch {bs}", dt, counted)
        del hf

        llm = LLM(model=d, dtype="float32", max_model_len=ctx, max_num_seqs=args.max_num_seqs,
                  seed=args.seed, num_scheduler_steps=args.multi_steps)  # fmt: skip
        engine = llm.llm_engine
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in out_lens]
        t0 = time.perf_counter()
        llm.generate(warm_prompts, params, use_tqdm=False)  # warm-up: the buckets met
        cold = time.perf_counter() - t0
        traces0, steps0 = engine.stats()["compilations"], engine.num_steps
        engine.reset_stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == n_out, (got, n_out)
        st = engine.stats()
        compiles = st["compilations"] - traces0
        loops = f"{st['multi_step_iterations']} in {st['multi_step_loops']} loops"
        note = (f"{engine.num_steps - steps0} steps ({loops}), {compiles} compiles"
                f" (cold run {cold:.1f} s)")  # fmt: skip
        row(f"pagedjax generate, K={args.multi_steps}", dt, got, note)

    speedup = (rows[-1][2] / rows[-1][1]) / best_hf
    print(f"speedup_vs_hf: {speedup:.2f}")
    return speedup


if __name__ == "__main__":
    main()
