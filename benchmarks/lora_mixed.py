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


def _model(tiny: bool):
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
    base = _model(args.tiny)
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

    def timed(llm, lora) -> float:
        llm.generate(prompts, params, use_tqdm=False, lora_request=lora)  # compile
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        dt = time.perf_counter() - t
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt

    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs; model"
          f" {'tiny' if args.tiny else 'SmolLM2-135M shapes'}, {args.requests} requests x"
          f" {args.prompt_len} prompt + {args.new} new, {args.adapters} adapters rank"
          f" {args.rank}", flush=True)  # fmt: skip
    base_tps = timed(LLM(**common), None)
    print(f"base engine:                      {base_tps:8.1f} output tok/s", flush=True)
    llm = LLM(**common, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    mixed = [loras[i % len(loras)] for i in range(args.requests)]
    mixed_tps = timed(llm, mixed)
    print(f"LoRA engine, {args.adapters} adapters mixed:     {mixed_tps:8.1f} output tok/s"
          f" ({mixed_tps / base_tps:.2f}x base)", flush=True)  # fmt: skip
    off_tps = timed(llm, None)
    print(f"LoRA engine, base requests only:  {off_tps:8.1f} output tok/s"
          f" ({off_tps / base_tps:.2f}x base)")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
