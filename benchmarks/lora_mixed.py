"""Output tok/s of a mixed multi-LoRA batch against the base model alone (docs/lora.md).

A random Llama written by transformers (default: SmolLM2-135M's shapes, or --tiny) and
--adapters random PEFT adapters of rank --rank on all seven linears (written by peft,
``init_lora_weights=False``). Three runs of the same --requests greedy requests
(--prompt-len random prompt ids, --new tokens each, EOS ignored), each timed after an
untimed identical run (compilation): the base engine; the LoRA engine
(``enable_lora=True, max_loras=--adapters``) with the requests spread round-robin over the
adapters, one batch; and the LoRA engine with base requests only (the cost of LoRA being
on). Prefix caching off (no hits between the runs).

    python benchmarks/lora_mixed.py [--tiny] [--requests 8] [--adapters 4] [--rank 8]
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def base_model(tiny: bool):
    import torch
    import transformers

    if tiny:
        cfg = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    else:  # SmolLM2-135M's shapes
        cfg = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                   num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                   tie_word_embeddings=True)  # fmt: skip
    config = transformers.LlamaConfig(max_position_embeddings=1024, initializer_range=0.05, **cfg)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers (seconds)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    import peft

    from pagedjax import LLM, SamplingParams
    from pagedjax.lora import LoRARequest

    d = Path(tempfile.mkdtemp(prefix="lora_mixed_"))
    base = base_model(args.tiny)
    base.save_pretrained(str(d / "base"))
    loras = []
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for i in range(args.adapters):
        cfg = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets,
                              init_lora_weights=False)  # fmt: skip
        peft.get_peft_model(copy.deepcopy(base), cfg).save_pretrained(str(d / f"a{i}"))
        loras.append(LoRARequest(f"a{i}", i + 1, str(d / f"a{i}")))
    rng = np.random.default_rng(0)
    vocab = base.config.vocab_size
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    common = dict(model=str(d / "base"), dtype="float32", block_size=16, max_model_len=512,
                  max_num_seqs=max(8, args.requests), max_num_batched_tokens=512,
                  num_gpu_blocks_override=256, enable_prefix_caching=False, warmup="none",
                  seed=0)  # fmt: skip

    def timed(llm, lora) -> tuple[float, float]:
        """(output tok/s of wall time, ms of this process' CPU time per output token):
        the second is steadier on a shared box (other processes' load stretches wall
        time, much less the CPU time the run itself needs)."""
        llm.generate(prompts, params, use_tqdm=False, lora_request=lora)  # compile
        t, c = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        return n / dt, 1e3 * dc / n

    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs; model"
          f" {'tiny' if args.tiny else 'SmolLM2-135M shapes'}, {args.requests} requests x"
          f" {args.prompt_len} prompt + {args.new} new, {args.adapters} adapters rank"
          f" {args.rank}", flush=True)  # fmt: skip
    def show(name: str, r: tuple[float, float], ref: tuple[float, float] | None) -> None:
        rel = "" if ref is None else (f" ({r[0] / ref[0]:.2f}x base tok/s,"
                                      f" {r[1] / ref[1]:.2f}x base CPU/token)")  # fmt: skip
        print(f"{name:34s} {r[0]:8.1f} output tok/s, {r[1]:7.2f} CPU ms/token{rel}",
              flush=True)  # fmt: skip

    base = timed(LLM(**common), None)
    show("base engine", base, None)
    llm = LLM(**common, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    mixed = [loras[i % len(loras)] for i in range(args.requests)]
    show(f"LoRA engine, {args.adapters} adapters mixed", timed(llm, mixed), base)
    show("LoRA engine, base requests only", timed(llm, None), base)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
