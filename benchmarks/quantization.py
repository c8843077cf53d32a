"""Quantized weights: what they buy in memory, and what they cost on this CPU.

1. Memory (computed from shapes, no device needed): bytes per parameter of a
   Llama-2-7B-shaped model in every in-flight mode (linears quantized; embeddings, LM
   head and norms in bf16), the KV pool left on an 80 GB device at
   gpu_memory_utilization 0.9 (no activation reserve: stated, not measured), its size in
   tokens (bf16 KV), and the mean batch the paper's ShareGPT workload then reaches in the
   simulator (paged system, 1,024 rows so memory is the limit, the H100-80GB roofline
   of the bf16 model for step time: the simulated step is not made faster by smaller
   weights, so the batch differs through memory alone).
2. CPU decode step (measured): one decode step of --seqs sequences of the real
   SmolLM2-135M (kv length 128, float32 compute) per mode, median of --reps, as a ratio
   to the float32 model. On a CPU every mode dequantizes in XLA (fp8: emulated with
   ml_dtypes' float8, no fp8 arithmetic), so this measures overhead, not the speed-up
   a GPU kernel would give.
3. Quality (measured): perplexity of the real model on the fixed text (--tokens, windows
   of 512) per mode, with top-1 agreement and KL against the float32 model.

    python benchmarks/quantization.py [--quick] [--reps 20] [--seqs 8] [--tokens 1024]

The last line is ``int4_bytes_per_param: <value>``.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model import ModelInput, allocate_kv_cache, make_forward, preset_arch
from pagedjax.model.quant.inflight import INFLIGHT_MODES, quantize_params, quantized_nbytes

GIB = 1 << 30
DEVICE_BYTES = 80e9
UTILIZATION = 0.9


def memory_table(quick: bool, sim: bool = True) -> list[dict]:
    arch = preset_arch("llama-2-7b")
    h, inter, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    shapes = [(h, arch.num_heads * d), (h, arch.num_kv_heads * d), (h, arch.num_kv_heads * d),
              (arch.num_heads * d, h), (h, inter), (h, inter), (inter, h)]  # fmt: skip
    linear_params = arch.num_layers * sum(i * o for i, o in shapes)
    other_params = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2) + h * (
        2 * arch.num_layers + 1
    )
    kv_per_token = arch.kv_bytes_per_token(jnp.bfloat16)
    rows = []
    for mode in ("bf16", *INFLIGHT_MODES):
        if mode == "bf16":
            linear_bytes = 2 * linear_params
        else:
            linear_bytes = arch.num_layers * sum(quantized_nbytes(mode, i, o) for i, o in shapes)
        weights = linear_bytes + 2 * other_params
        kv = UTILIZATION * DEVICE_BYTES - weights
        rows.append(dict(mode=mode, params=linear_params + other_params,
                         bytes_per_param=weights / (linear_params + other_params),
                         weights_gib=weights / GIB, kv_gib=kv / GIB,
                         kv_tokens=int(kv // kv_per_token)))  # fmt: skip
    kv = [r["kv_tokens"] for r in rows]
    batched = simulated_batch(kv, quick) if sim else [float("nan")] * len(kv)
    for r, b in zip(rows, batched, strict=True):
        r["sharegpt_batch"] = b
    return rows


def simulated_batch(kv_tokens: list[int], quick: bool) -> list[float]:
    from pagedjax.simulator.systems import make_cost_model, simulate_system
    from pagedjax.workloads.builder import make_workload

    cost = make_cost_model("H100-80GB", "llama-2-7b")
    duration = 30.0 if quick else 120.0
    workload = make_workload("sharegpt", 60.0, duration_s=duration, seed=0)
    out = []
    for tokens in kv_tokens:
        run = simulate_system("paged", workload, cost_model=cost, kv_slots=tokens,
                              slots=1024, max_num_seqs=1024, model="llama-2-7b")  # fmt: skip
        out.append(float(run.result.win_batched))
    return out


def _decode_batch(seqs: int, kv_len: int, block: int) -> ModelInput:
    blocks_per_seq = -(-(kv_len + 1) // block)
    tables = 1 + np.arange(seqs * blocks_per_seq, dtype=np.int32).reshape(seqs, blocks_per_seq)
    slots = tables[:, kv_len // block] * block + kv_len % block
    return ModelInput(
        tokens=jnp.arange(3, 3 + seqs, dtype=jnp.int32),
        positions=jnp.full((seqs,), kv_len, jnp.int32),
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(tables),
        kv_lens=jnp.full((seqs,), kv_len + 1, jnp.int32),
        cu_q_lens=jnp.arange(seqs + 1, dtype=jnp.int32),
        logits_indices=jnp.arange(seqs, dtype=jnp.int32),
    )


def decode_times(arch, params_by_mode: dict, seqs: int, reps: int) -> dict[str, float]:
    block, kv_len = 16, 128
    batch = _decode_batch(seqs, kv_len, block)
    num_blocks = 1 + seqs * (-(-(kv_len + 1) // block))
    fwd = make_forward(arch, donate=False)
    kv = allocate_kv_cache(arch, num_blocks, block, jnp.float32)
    out = {}
    for mode, params in params_by_mode.items():
        jax.block_until_ready(fwd(params, kv, batch))  # compile
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(fwd(params, kv, batch))
            times.append(time.perf_counter() - t)
        out[mode] = 1e3 * float(np.median(times))
    return out


def quality(llm, params_by_mode: dict, tokens: int) -> dict[str, dict]:
    from pagedjax.eval import load_text, quality_report, score_text

    engine = llm.llm_engine
    dense = engine.params
    ref = score_text(llm, load_text(), window=512, max_tokens=tokens)
    out = {}
    for mode, params in params_by_mode.items():
        engine.params = params
        out[mode] = quality_report(ref, score_text(llm, load_text(), window=512,
                                                   max_tokens=tokens))  # fmt: skip
    engine.params = dense
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="memory table only, short simulation")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--no-sim", action="store_true", help="skip the simulated batch column")
    ap.add_argument("--no-quality", action="store_true", help="skip the perplexity table")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs, jax {jax.__version__}")
    rows = memory_table(args.quick, not args.no_sim)
    print("\nLlama-2-7B shape on an 80 GB device (gpu_memory_utilization 0.9, bf16 KV):")
    print(f"{'mode':>30} {'B/param':>8} {'weights GiB':>11} {'KV GiB':>7} {'KV tokens':>10}"
          f" {'ShareGPT batch':>14}")  # fmt: skip
    for r in rows:
        print(f"{r['mode']:>30} {r['bytes_per_param']:8.3f} {r['weights_gib']:11.2f} "
              f"{r['kv_gib']:7.2f} {r['kv_tokens']:10d} {r['sharegpt_batch']:14.1f}")  # fmt: skip
    if not args.quick:
        from pagedjax import LLM

        llm = LLM(model="smollm2-135m-instruct", max_model_len=640, max_num_seqs=4,
                  max_num_batched_tokens=512, warmup="none")  # fmt: skip
        arch, dense = llm.llm_engine.arch, llm.llm_engine.params
        by_mode = {"float32": dense, **{m: quantize_params(dense, m) for m in INFLIGHT_MODES}}
        ms = decode_times(arch, by_mode, args.seqs, args.reps)
        print(f"\nSmolLM2-135M decode step, {args.seqs} sequences x kv 128, CPU, float32 "
              f"compute (median of {args.reps}; load {os.getloadavg()[0]:.1f}):")  # fmt: skip
        for mode, t in ms.items():
            print(f"{mode:>30} {t:8.2f} ms  {t / ms['float32']:5.2f}x float32")
        quantized = {m: p for m, p in by_mode.items() if m != "float32"}
        q = {} if args.no_quality else quality(llm, quantized, args.tokens)
        if q:
            print(f"\nSmolLM2-135M on the fixed text ({args.tokens} tokens), vs float32:")
        for mode, r in q.items():
            print(f"{mode:>30} ppl {r['ppl_candidate']:8.3f} (float32 {r['ppl_reference']:.3f})"
                  f"  top-1 {r['top1_agreement']:.4f}  KL {r['kl']:.5f}")  # fmt: skip
    int4 = next(r for r in rows if r["mode"] == "int4")
    print(f"int4_bytes_per_param: {int4['bytes_per_param']:.4f}")


if __name__ == "__main__":
    main()
