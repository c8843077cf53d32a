"""Unified vs separate LoRA memory: KV blocks and the largest batch as adapter slots grow
(docs/lora.md, "Unified memory").

For a model's shapes (default: SmolLM2-135M; ``--llama8b``: Llama-3-8B's) and one KV
budget (``--kv-gib``, the engine's kv_cache_memory_bytes), prints per max_loras and rank:
the adapter slot table's bytes (``lora.slot_table_bytes``, exactly what the engine
allocates: tests/test_lora_engine.py checks it against the arrays), the pool's blocks
under ``lora_memory="unified"`` (the table inside the budget) and "separate" (beside it),
computed by the engine's own sizing function (``kv_budget.num_kv_blocks``, as
``LLMEngine`` calls it: tests/test_lora_engine.py checks that a built engine gets that
count), the device bytes each mode then uses, and the largest batch of requests of
``--prompt-len`` + ``--new`` tokens the pool holds at once (usable blocks // blocks per
request, capped at --max-num-seqs). Nothing is run on a device: the numbers are the
sizing, not a throughput measurement.

    python benchmarks/lora_memory.py [--llama8b] [--kv-gib 1] [--dtype float32]

``--engine``: the same trade-off on real engines at small scale: a tiny random Llama
(hidden 64, 2 layers; transformers), one random PEFT adapter of rank 8 (peft), a 2 MiB
KV budget (``kv_cache_memory_bytes``), 64 greedy requests of 32 + 32 tokens all with the
adapter, for "separate" and for "unified" at max_loras 1 / 8 / 24 (``--engine-loras``):
the engine's pool, how many requests fit whole in it (usable blocks // 4), and the run's
preemptions, engine steps and wall time (compilation included: each pool size is a new
program; this is about memory, not speed).
"""

from __future__ import annotations

import argparse

SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3)  # fmt: skip
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama8b", action="store_true")
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--loras", default="1,4,16,64")
    ap.add_argument("--engine", action="store_true", help="real tiny engines (module doc)")
    ap.add_argument("--engine-loras", default="1,8,24")
    args = ap.parse_args()
    if args.engine:
        return engine_runs([int(x) for x in args.engine_loras.split(",")])

    import jax
    import jax.numpy as jnp

    from pagedjax.config import LoRAConfig
    from pagedjax.engine.kv_budget import num_kv_blocks
    from pagedjax.engine.lora_manager import lora_reserved_bytes
    from pagedjax.model.config import arch_from_hf_config
    from pagedjax.model.kv_cache import cache_bytes_per_token

    arch = arch_from_hf_config(LLAMA3_8B if args.llama8b else SMOLLM2_135M)
    per_token = cache_bytes_per_token(arch, "auto", jnp.dtype(args.dtype))
    budget = int(args.kv_gib * 2**30)
    per_req = -(-(args.prompt_len + args.new) // args.block_size)
    cpu = jax.devices("cpu")[0]

    def blocks(reserved: int) -> int:
        return num_kv_blocks(kv_bytes_per_token=per_token, block_size=args.block_size,
                             max_blocks_needed=10**12, num_gpu_blocks_override=None,
                             kv_cache_memory_bytes=budget, gpu_memory_utilization=0.9,
                             device=cpu, reserved_bytes=reserved,
                             reserved_for="LoRA slots")  # fmt: skip

    def batch(n: int) -> int:
        return min(args.max_num_seqs, (n - 1) // per_req)

    name = "Llama-3-8B" if args.llama8b else "SmolLM2-135M"
    print(f"{name} shapes, KV {args.dtype} {per_token} B/token, budget {args.kv_gib:g} GiB,"
          f" blocks of {args.block_size}, requests {args.prompt_len}+{args.new} tokens"
          f" ({per_req} blocks); slot tables in float32")  # fmt: skip
    print("| rank | max_loras | table MiB | unified: blocks | batch | device MiB"
          " | separate: blocks | batch | device MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = blocks(0)
    for rank in map(int, args.ranks.split(",")):
        for n in map(int, args.loras.split(",")):
            cfg = LoRAConfig(max_loras=n, max_lora_rank=rank)
            table = lora_reserved_bytes(cfg, arch)
            mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
            try:
                uni = blocks(table)
                unified = f"{uni} | {batch(uni)} | {mib(uni * per_token * args.block_size + table)}"
            except ValueError:  # the table alone is over the budget
                unified = "does not fit | 0 | -"
            print(f"| {rank} | {n} | {mib(table)} | {unified} | {base} | {batch(base)} |"
                  f" {mib(base * per_token * args.block_size + table)} |")  # fmt: skip


def engine_runs(loras: list[int]) -> None:
    """The --engine table (module docstring)."""
    import copy
    import os
    import tempfile
    import time
    from pathlib import Path

    import numpy as np
    import peft
    from lora_mixed import base_model

    from pagedjax import LLM, SamplingParams
    from pagedjax.lora import LoRARequest

    d = Path(tempfile.mkdtemp(prefix="lora_memory_"))
    base = base_model(tiny=True)
    base.save_pretrained(str(d / "base"))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(base), cfg).save_pretrained(str(d / "a"))
    lora = LoRARequest("a", 1, str(d / "a"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, 32).tolist() for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    print(f"load average {os.getloadavg()[0]:.1f}; tiny Llama, 2 MiB KV budget, 64 requests"
          f" of 32 + 32 tokens (blocks of 16: 4 each), adapter rank 8")  # fmt: skip
    print("| memory | max_loras | pool blocks | requests that fit whole | preemptions |"
          " steps | wall s |")
    print("|---|---|---|---|---|---|---|")
    for memory, n in [("separate", max(loras))] + [("unified", n) for n in loras]:
        llm = LLM(model=str(d / "base"), dtype="float32", block_size=16, max_model_len=128,
                  max_num_seqs=64, max_num_batched_tokens=256, kv_cache_memory_bytes=2 << 20,
                  enable_prefix_caching=False, warmup="none", seed=0, enable_lora=True,
                  max_loras=n, max_lora_rank=8, lora_memory=memory)  # fmt: skip
        e = llm.llm_engine
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, params, lora_request=lora)
        steps = 0
        while e.has_unfinished_requests():
            e.step()
            steps += 1
        fit = min(64, (e.num_blocks - 1) // 4)
        print(f"| {memory} | {n} | {e.num_blocks} | {fit} | {e.num_preemptions} | {steps} |"
              f" {time.perf_counter() - t:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
