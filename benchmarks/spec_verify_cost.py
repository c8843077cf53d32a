"""The verification-cost curve: ms per engine step against the rows it verifies (CPU).

    python benchmarks/spec_verify_cost.py [--model smollm2|tiny] [--points 1:0,1,2,4,8 8:0,1,3]
        [--steps 6] [--warm 2] [--prompt-len 48] [--shape chain|tree|both]

A speculative step verifies B * (1 + k) rows (B sequences, k drafts each) where a plain
decode step runs B. Speculation pays when the tokens a row emits per step, the mean
accepted length L = 1 + accepted drafts (vLLM's "mean acceptance length"), exceed the
step's cost ratio: L > c_verify(B, k) / c_plain(B). This script measures both costs in
the engine (the whole step: schedule, drafts written, verification, rollback, output
processing), so the ratio is the accepted length each method needs to break even, at
each (B, k); it also prints the per-draft acceptance alpha that gives that L under the
i.i.d. model L = (1 - alpha^(k+1)) / (1 - alpha).

Model: SmolLM2-135M-Instruct from the model cache (``catalog.cached_model_path``),
dequantized to fp32, else its geometry (llama, 30 layers, hidden 576, 9 / 3 heads, vocab
49152, tied embeddings) with random weights: the step's cost does not depend on the
weights' values. The drafts are forced (every row gets exactly k, from a proposer that
repeats the last token), so acceptance plays no part in the curve. ``--model tiny``:
the 2-layer test model (for checking the script).

Each point (B, k): B requests with ``--prompt-len`` token prompts are prefilled, then
``--warm`` steps (compilation) and ``--steps`` timed steps; the median step time is
reported; the plain step (k = 0) is timed alternately with each point's steps on the same
sequences ("paired"), so the ratio compares steps made under the same load. k is set per
step through the batch-size table (``num_speculative_tokens_per_
batch_size``), so one engine (K = the largest k) serves every point, k = 0 being the plain
step. Prints the load average before and after: the box is shared.

``--shape tree`` verifies draft trees instead (``"tree"`` in the speculative config,
engine/spec/tree.py): each row gets exactly k nodes, a binary tree (node i's parent
(i - 1) // 2), so the rows carry the tree mask, depth positions, the walk and the
compaction; ``both`` times chains and trees in one run, one engine each, point by point.
For a tree the "L to break even" column is what the accepted path plus the bonus must
reach; a tree of k nodes has depth about log2(k), so its L is bounded by that depth + 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax.numpy as jnp
import numpy as np

from pagedjax.config import (
    CacheConfig,
    DraftTreeConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.loading import load_model
from pagedjax.model import arch_from_hf_config, preset_arch, random_params
from pagedjax.model.catalog import cached_model_path
from pagedjax.sampling import SamplingParams
from pagedjax.tokenizer import ByteTokenizer

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_theta=100000.0, bos_token_id=1, eos_token_id=2)  # fmt: skip


class RepeatProposer:
    """Exactly k drafts for every row (the last token repeated): the cost of k drafts,
    whatever they are."""

    def propose(self, ids: list[int], k: int) -> list[int]:
        return [ids[-1]] * k


class RepeatTree:
    """Exactly ``depth`` nodes for every row (the row's k, passed as the depth cap), as a
    binary tree of the last token: the cost of a k-node tree, whatever it holds."""

    def propose_tree(self, ids: list[int], depth: int, budget: int | None = None):
        n = depth if budget is None else min(depth, budget)
        return [ids[-1]] * n, [(i - 1) // 2 if i else -1 for i in range(n)]


def parse_points(items: list[str]) -> list[tuple[int, list[int]]]:
    """["1:0,1,2", "8:0,1"] -> [(1, [0, 1, 2]), (8, [0, 1])]."""
    out = []
    for item in items:
        b, _, ks = item.partition(":")
        out.append((int(b), sorted({int(k) for k in ks.split(",")})))
    return out


def needed_alpha(length: float, k: int) -> float | None:
    """alpha with (1 - alpha^(k+1)) / (1 - alpha) = length (bisection); None if > k + 1."""
    if length > k + 1:
        return None
    if length <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def build(model: str, max_b: int, max_k: int, prompt_len: int, steps: int,
          tree: bool = False) -> LLMEngine:  # fmt: skip
    if model == "tiny":
        arch = preset_arch("tiny-llama")
        params = random_params(arch, seed=0, dtype=jnp.float32, std=0.15)
    else:
        path = cached_model_path("smollm2-135m-instruct")
        if path.is_file():  # the real model, dequantized to fp32 (as benchmarks/speculative.py)
            print(f"model: SmolLM2-135M-Instruct from {path}, fp32")
            arch, params, _, _ = load_model(ModelConfig(model=str(path), dtype="float32"))
        else:
            print("model: SmolLM2-135M's geometry, random weights, fp32 (no cached GGUF)")
            arch = arch_from_hf_config(SMOLLM2)
            params = random_params(arch, seed=0, dtype=jnp.float32, std=0.02)
    max_len = prompt_len + (steps + 8) * (max_k + 1) + 16
    budget = max(64, max_b * (max_k + 1))
    blocks = max_b * (-(-max_len // 16) + 1) + 8  # a small pool: the default sizes it to RAM
    config = EngineConfig(
        model=ModelConfig(model="random", max_model_len=max_len, seed=0),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_b,
                                  num_multi_steps=1),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=max_k,
                                      tree=DraftTreeConfig(max_k, 1) if tree else None),
        warmup="none",  # each point's --warm steps compile what it runs, nothing more
    )  # fmt: skip
    tok = ByteTokenizer(eos_token_id=arch.eos_token_id, bos_token_id=arch.bos_token_id)
    engine = LLMEngine(arch, params, tok, config)
    engine.speculator.proposer = RepeatProposer()
    if tree:
        engine.speculator.tree_proposer = RepeatTree()
    return engine


def set_k(engine: LLMEngine, k: int) -> None:
    """Every following step drafts k per row (0: plain steps), through the table."""
    spec = engine.speculator
    spec.config = dataclasses.replace(spec.config, num_speculative_tokens_per_batch_size=(
        (1, 1 << 20, k),))  # fmt: skip


def time_point(engine: LLMEngine, b: int, k: int, prompt_len: int, warm: int,
               steps: int, tag: str) -> tuple[float, float]:  # fmt: skip
    """(plain, speculative) median seconds of a step of b sequences: plain steps and
    steps with k drafts per row alternate on the same sequences, so a drifting machine
    load weighs on both alike."""
    set_k(engine, k)
    rng = np.random.default_rng(b * 100 + k)
    sp = SamplingParams(temperature=0.0, max_tokens=(warm + steps + 4) * (k + 1) + 8,
                        ignore_eos=True)  # fmt: skip
    for i in range(b):
        ids = rng.integers(3, engine.arch.vocab_size, size=prompt_len).tolist()
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, sp)
    while any(len(s.detok.ids) == 0 for _, s in engine.core.book.slot_owner.values()) or (
        engine.core.book.queue
    ):
        engine.step()  # prefill until every sequence decodes
    times: dict[int, list[float]] = {0: [], k: []}
    for i in range(warm + steps):
        for kk in (0, k):
            set_k(engine, kk)
            t0 = time.perf_counter()
            engine.step()
            if i >= warm:
                times[kk].append(time.perf_counter() - t0)
    for i in range(b):
        engine.abort_request(f"{tag}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times[0]), statistics.median(times[k])


def compare_auto(engine: LLMEngine, b: int, k: int, prompt_len: int, steps: int,
                 tag: str, warm: int = 2) -> dict[str, tuple[float, float]]:  # fmt: skip
    """Tokens per second and per step of B sequences for: no drafts (k = 0), k drafts
    every step (fixed), and the automatic rule (auto), with drafts that are almost never
    accepted (the repeated last token on a random model: a workload where speculation
    cannot pay). The methods' runs alternate: none, fixed, auto."""
    spec, out = engine.speculator, {}
    base = spec.config
    modes = {
        "none": dict(num_speculative_tokens_per_batch_size=((1, 1 << 20, 0),)),
        "fixed": dict(num_speculative_tokens_per_batch_size=((1, 1 << 20, k),)),
        "auto": dict(num_speculative_tokens_per_batch_size=((1, 1 << 20, k),),
                     auto_num_speculative_tokens=True),
    }  # fmt: skip
    rng = np.random.default_rng(b)
    sp = SamplingParams(temperature=0.0, max_tokens=(steps + warm) * (k + 1) + 16,
                        ignore_eos=True)  # fmt: skip
    for name, change in modes.items():
        spec.config = dataclasses.replace(base, **change)
        ids = [rng.integers(3, engine.arch.vocab_size, size=prompt_len).tolist()
               for _ in range(b)]  # fmt: skip
        for i in range(b):
            engine.add_request(f"{tag}{name}-{i}", {"prompt_token_ids": ids[i]}, sp)
        while any(len(q.detok.ids) == 0 for _, q in engine.core.book.slot_owner.values()):
            engine.step()
        for _ in range(warm):  # compile the decode / verification programs first
            engine.step()
        before = sum(len(q.detok.ids) for _, q in engine.core.book.slot_owner.values())
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sec = time.perf_counter() - t0
        after = sum(len(q.detok.ids) for _, q in engine.core.book.slot_owner.values())
        out[name] = ((after - before) / sec, (after - before) / steps / b)
        for i in range(b):
            engine.abort_request(f"{tag}{name}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
    spec.config = base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--points", nargs="+", default=["1:0,1,2,4,8", "8:0,1,3"],
                    help="B:k,k,... (k = 0 is the plain step)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--compare-auto", type=int, default=0, metavar="STEPS",
                    help="also time none / fixed k / auto over STEPS steps at each B")
    ap.add_argument("--skip-curve", action="store_true", help="only --compare-auto")
    ap.add_argument("--shape", choices=["chain", "tree", "both"], default="chain",
                    help="draft chains, draft trees (k nodes), or both (one engine each)")
    args = ap.parse_args()
    points = parse_points(args.points)
    max_b = max(b for b, _ in points)
    max_k = max(max(ks) for _, ks in points)
    print(f"load before: {os.getloadavg()}")
    if max_k > 31 and args.shape != "chain":
        raise SystemExit("a draft tree holds at most 31 nodes (the tree mask's reach)")
    shapes = ["chain", "tree"] if args.shape == "both" else [args.shape]
    engines = {sh: build(args.model, max_b, max(max_k, 1), args.prompt_len, args.steps,
                         tree=sh == "tree") for sh in shapes}  # fmt: skip
    engine = engines[shapes[0]]
    t_start = time.perf_counter()
    print("| shape | B | k | rows | plain ms (paired) | ms per step | vs plain |"
          " L to break even | alpha to break even (chain) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, ks in [] if args.skip_curve else points:
        for k in sorted(set(ks) - {0}):
            for sh, eng in engines.items():  # chains and trees alternate point by point
                plain, sec = time_point(eng, b, k, args.prompt_len, args.warm, args.steps,
                                        f"{sh}b{b}k{k}")  # fmt: skip
                ratio = sec / plain
                alpha = needed_alpha(ratio, k) if sh == "chain" else None
                a = "-" if sh != "chain" else ("never" if alpha is None else f"{alpha:.2f}")
                print(f"| {sh} | {b} | {k} | {b * (1 + k)} | {plain * 1e3:.1f} |"
                      f" {sec * 1e3:.1f} | {ratio:.2f} | {ratio:.2f} | {a} |",
                      flush=True)  # fmt: skip
    if args.compare_auto:
        print("\n| B | k | none tok/s | fixed k tok/s (vs none) | auto tok/s (vs none) |"
              " tokens per row-step none / fixed / auto |\n|---|---|---|---|---|---|")
        for b, ks in points:
            r = compare_auto(engine, b, max(ks), args.prompt_len, args.compare_auto, f"c{b}",
                             warm=max(args.warm, 2))  # fmt: skip
            n, f, a = r["none"], r["fixed"], r["auto"]
            print(f"| {b} | {max(ks)} | {n[0]:.1f} | {f[0]:.1f} ({f[0] / n[0]:.2f}) |"
                  f" {a[0]:.1f} ({a[0] / n[0]:.2f}) | {n[1]:.2f} / {f[1]:.2f} / {a[1]:.2f} |",
                  flush=True)  # fmt: skip
    print(f"total {time.perf_counter() - t_start:.0f} s; load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
