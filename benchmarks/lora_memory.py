"""Unified vs separate LoRA memory: KV blocks and the largest batch as adapter slots grow
(docs/lora.md, "Unified memory").

For a model's shapes (default: SmolLM2-135M; ``--llama8b``: Llama-3-8B's) and one KV
budget (``--kv-gib``, the engine's kv_cache_memory_bytes), prints per max_loras and rank:
the adapter slot table's bytes (``lora.slot_table_bytes``, exactly what the engine
allocates: tests/test_lora_engine.py checks it against the arrays), the pool's blocks
under ``lora_memory="static"`` (the table inside the budget) and "separate" (beside it),
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
adapter, for "separate" and for "static" at max_loras 1 / 8 / 24 (``--engine-loras``):
the engine's pool, how many requests fit whole in it (usable blocks // 4), and the run's
preemptions, engine steps and wall time (compilation included: each pool size is a new
program; this is about memory, not speed).

``--paging``: unified paging (S-LoRA) against fixed pools at the same device memory, as
the number of distinct adapters in the workload grows (``--paging-adapters``, default
1,2,4,8,16): the tiny Llama, 16 random peft adapters of rank 8 (each 8 blocks of this
model's KV), a 2 MiB budget (blocks of 16: 256 blocks); 48 greedy requests of 32 + 32
tokens, adapters round-robin (request i: adapter i mod n). Engines: "unified"
(max_loras 16, the whole budget a KV pool that adapters borrow blocks from as they
load), "fixed 16" (lora_memory="separate" with a 16-slot table and
kv_cache_memory_bytes = budget - table: two fixed pools that add up to the same
memory) and "fixed 4" (a 4-slot table, the rest KV). Per engine and adapter count: the
pool, the largest and the mean batch (sequences per iteration), iterations,
preemptions, adapter waits (deferrals: one per request per admission pass) and loads,
and wall seconds (each engine's first run includes compiling).

``--gather``: the step's cost of reading adapters from pages, one layer of SmolLM2-135M's
shapes: the seven base matmuls, the seven gathered deltas from the fixed table, and
``materialize`` (the gather of the slots' pages, bitcast, reshape) + the same deltas,
jitted, median of 20; the paged read's extra time as a share of the base matmuls; and
the same seven deltas through the native CPU kernel (``model/native_lora.py``), what the
engine runs on the CPU at fp32.

    python benchmarks/lora_memory.py --paging      # ~3-5 min on the 2-core box
    python benchmarks/lora_memory.py --gather
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
    ap.add_argument("--paging", action="store_true", help="unified paging vs fixed pools")
    ap.add_argument("--paging-adapters", default="1,2,4,8,16")
    ap.add_argument("--gather", action="store_true", help="the paged read's cost per layer")
    args = ap.parse_args()
    if args.engine:
        return engine_runs([int(x) for x in args.engine_loras.split(",")])
    if args.paging:
        return paging_runs([int(x) for x in args.paging_adapters.split(",")])
    if args.gather:
        return gather_cost()

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
    print("| rank | max_loras | table MiB | static: blocks | batch | device MiB"
          " | separate: blocks | batch | device MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = blocks(0)
    for rank in map(int, args.ranks.split(",")):
        for n in map(int, args.loras.split(",")):
            cfg = LoRAConfig(max_loras=n, max_lora_rank=rank, memory="static")
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
    for memory, n in [("separate", max(loras))] + [("static", n) for n in loras]:
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


def paging_runs(counts: list[int]) -> None:
    """The --paging table (module docstring)."""
    import copy
    import os
    import tempfile
    import time
    from pathlib import Path

    import numpy as np
    import peft
    from lora_mixed import base_model

    from pagedjax import LLM, SamplingParams
    from pagedjax.engine.lora_manager import lora_reserved_bytes
    from pagedjax.lora import LoRARequest
    from pagedjax.model.config import arch_from_hf_config

    d = Path(tempfile.mkdtemp(prefix="lora_paging_"))
    base = base_model(tiny=True)
    base.save_pretrained(str(d / "base"))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    n_max = max(counts)
    loras = []
    for i in range(n_max):
        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                              init_lora_weights=False)  # fmt: skip
        peft.get_peft_model(copy.deepcopy(base), cfg).save_pretrained(str(d / f"a{i}"))
        loras.append(LoRARequest(f"a{i}", i + 1, str(d / f"a{i}")))
    from pagedjax.config import LoRAConfig

    arch = arch_from_hf_config(base.config.to_dict())
    budget = 2 << 20

    def table(n: int) -> int:
        return lora_reserved_bytes(LoRAConfig(max_loras=n, max_lora_rank=8, memory="static"),
                                   arch)  # fmt: skip

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, 32).tolist() for _ in range(48)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    print(f"load average {os.getloadavg()[0]:.1f}; tiny Llama, {budget >> 20} MiB of device"
          f" memory for KV + adapters, 48 requests of 32 + 32 tokens (4 blocks of 16 each),"
          f" adapters of rank 8 (8 blocks each; a 16-slot table {table(16) / 2**20:.2f} MiB)")
    print("| engine | pool blocks | adapters | largest batch | mean batch | iterations |"
          " preemptions | adapter waits | loads | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    engines = [("unified", 16, "unified", budget), ("fixed 16", 16, "separate",
               budget - table(16)), ("fixed 4", 4, "separate", budget - table(4))]  # fmt: skip
    for name, slots, memory, kv_bytes in engines:
        llm = LLM(model=str(d / "base"), dtype="float32", block_size=16, max_model_len=128,
                  max_num_seqs=48, max_num_batched_tokens=256, kv_cache_memory_bytes=kv_bytes,
                  enable_prefix_caching=False, warmup="none", seed=0, enable_lora=True,
                  max_loras=slots, max_lora_rank=8, max_cpu_loras=n_max,
                  lora_memory=memory)  # fmt: skip
        e = llm.llm_engine
        batches: list[int] = []
        e.add_step_observer(lambda rec, seen=batches: seen.append(rec.num_seqs))
        for n in counts:
            for i in e.core.lora.held_ids():  # start each workload with none resident
                e.remove_lora(i)
            e.reset_stats()
            batches.clear()
            pre = e.num_preemptions
            t = time.perf_counter()
            for i, p in enumerate(prompts):
                e.add_request(f"{name}-{n}-{i}", p, params, lora_request=loras[i % n])
            while e.has_unfinished_requests():
                e.step()
            s = e.stats()
            mean = sum(batches) / len(batches)
            print(f"| {name} | {e.num_blocks} | {n} | {max(batches)} | {mean:.1f} |"
                  f" {len(batches)} | {e.num_preemptions - pre} | {s['lora_waits']} |"
                  f" {s['lora_loads']} | {time.perf_counter() - t:.1f} |",
                  flush=True)  # fmt: skip


def gather_cost() -> None:
    """The --gather numbers (module docstring)."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.lora import llama_module_shapes, lora_delta
    from pagedjax.lora.checkpoint import ATTENTION_MODULES
    from pagedjax.model.config import arch_from_hf_config
    from pagedjax.model.lora_pages import (
        PagedLoRA,
        block_floats,
        materialize,
        pages_for_rank,
        rank_slice_floats,
    )
    from pagedjax.model.native_lora import stacked_lora_delta

    arch = arch_from_hf_config(SMOLLM2_135M)
    shapes = llama_module_shapes(arch)
    mods = tuple(("self_attn" if m in ATTENTION_MODULES else "mlp", m, i, o)
                 for m, (i, o) in shapes.items())  # fmt: skip
    rng = np.random.default_rng(0)
    print("one layer of SmolLM2-135M's shapes, fp32, rank 8 adapters, 7 modules; ms per"
          " layer (jitted, median of 20)")
    print("| rows | slots | base: 7 matmuls | table: 7 deltas | paged: read + 7 deltas |"
          " paged - table, % of base | table, native kernel: 7 deltas |")
    print("|---|---|---|---|---|---|---|")
    for rows, loras in ((8, 4), (64, 16), (256, 16)):
        slots, r, bs = loras + 1, 8, 16
        x = jnp.asarray(rng.normal(size=(rows, 1536)), jnp.float32)
        ids = jnp.asarray(rng.integers(0, slots, rows), jnp.int32)
        a = {m: jnp.asarray(rng.normal(size=(slots, i, r)), jnp.float32)
             for m, (i, o) in shapes.items()}  # fmt: skip
        b = {m: jnp.asarray(rng.normal(size=(slots, r, o)), jnp.float32)
             for m, (i, o) in shapes.items()}  # fmt: skip
        scale = jnp.ones((slots,), jnp.float32)
        page = (arch.num_kv_heads, bs, arch.head_dim)
        per = block_floats((1, 1, *page), 4)
        n_pages = pages_for_rank(r, rank_slice_floats(mods), per)
        blocks = 2 + slots * n_pages
        pool = jnp.asarray(rng.normal(size=(1, blocks, *page)), jnp.float32)
        pages = jnp.asarray(1 + np.arange(slots * n_pages).reshape(slots, n_pages), jnp.int32)
        paged = PagedLoRA(pages, jnp.full((slots,), r, jnp.int32), scale, mods, r)
        view = {"self_attn": {m: {} for m in shapes if m in ATTENTION_MODULES},
                "mlp": {m: {} for m in shapes if m not in ATTENTION_MODULES}}

        def deltas(tree, x=x, ids=ids):
            return sum(lora_delta(x[:, : tree[g][m]["lora_a"].shape[1]], ids,
                                  tree[g][m]["lora_a"], tree[g][m]["lora_b"],
                                  tree[g][m]["lora_scale"]).sum()
                       for g in tree for m in tree[g])  # fmt: skip

        def native_deltas(tree, x=x, ids=ids):
            return sum(stacked_lora_delta(x[:, : tree[g][m]["lora_a"].shape[1]], ids,
                                          tree[g][m]["lora_a"][None], tree[g][m]["lora_b"][None],
                                          tree[g][m]["lora_scale"], 0).sum()
                       for g in tree for m in tree[g])  # fmt: skip

        table_tree = {g: {m: dict(lora_a=a[m], lora_b=b[m], lora_scale=scale) for m in sub}
                      for g, sub in view.items()}  # fmt: skip
        w = {m: jnp.asarray(rng.normal(size=(i, o)), jnp.float32) for m, (i, o) in shapes.items()}
        f_base = jax.jit(lambda w, x=x: sum((x[:, : k.shape[0]] @ k).sum() for k in w.values()))
        f_table = jax.jit(lambda t: deltas(t))
        f_paged = jax.jit(lambda p, pool, view=view: deltas(
            materialize({**view, "lora_paged": p}, (None, pool, pool), jnp.int32(0))))
        f_native = jax.jit(lambda t: native_deltas(t))
        times = []
        for fn, args in ((f_base, (w,)), (f_table, (table_tree,)), (f_paged, (paged, pool)),
                         (f_native, (table_tree,))):  # fmt: skip
            fn(*args).block_until_ready()
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                fn(*args).block_until_ready()
                ts.append(time.perf_counter() - t)
            times.append(statistics.median(ts) * 1e3)
        print(f"| {rows} | {loras} | {times[0]:.2f} | {times[1]:.2f} | {times[2]:.2f} |"
              f" {100 * (times[2] - times[1]) / times[0]:+.0f} % | {times[3]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
