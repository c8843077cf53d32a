"""The host tier on a multi-turn workload: TTFT p50 / p90 and prompt tokens computed,
``kv_offloading_size`` off vs on, the device pool capped so the working set is ~4x it.

    python benchmarks/kv_tiers.py [--convs 8] [--turns 4] [--system-len 192]
        [--pool-blocks 48] [--tier-blocks 256] [--shared-prefix 0]
        [--indexes hash,radix] [--policies lru,lfu,cost] [--tiers off,on]

Closed loop over ``--convs`` conversations taken round robin (turn t of each, then turn
t + 1), ``--concurrency`` requests in flight: each turn resends the whole history (the
first message, then every reply and user message so far), so by a conversation's next
turn the others have evicted its prefix from the device pool. TTFT at concurrency 1 is
the prefill itself (no queueing). One random llama (load_format="dummy"; ``--hidden``,
``--layers``, ``--heads``), or ``--model`` (a catalog name such as
``smollm2-135m-instruct``, a .gguf file or a checkpoint directory), on the engine
directly (no server); a warm-up pass of the same workload with other tokens compiles
every shape first (warmup "none": only the programs used), then the timed pass.
Greedy outputs are compared between all settings (they must be equal).

``--indexes`` x ``--policies`` x ``--tiers`` (defaults: hash x lru x off,on, the first
measurement) runs each combination of ``prefix_index``, ``eviction_policy`` and the host
tier, and ends with one table: TTFT p50 / p90, prefix hit rate per tier (hit tokens /
prompt tokens looked up), prompt tokens computed and output tok/s over the timed pass.
``--shared-prefix N``: every conversation's first message starts with the same N tokens
(a system prompt), so some blocks are hit far more often than others (what LFU and the
cost policy rank by).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from serving_common import dummy_model_dir  # benchmarks/ is on sys.path

from pagedjax import LLM, SamplingParams


def run(args: argparse.Namespace, model: str, tier_gib: float, index: str = "hash",
        policy: str = "lru") -> dict:  # fmt: skip
    load = dict(load_format="dummy") if args.model is None else dict(dtype="float32")
    llm = LLM(
        model, **load, block_size=args.block_size,
        num_gpu_blocks_override=args.pool_blocks + 1, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, swap_space=0.0,
        kv_offloading_size=tier_gib, warmup="none", prefix_index=index, eviction_policy=policy,
    )  # fmt: skip
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = engine.arch.vocab_size

    def tokens(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    first_turn: list[bool] = []

    def converse(convs: int, turns: int, tag: str) -> tuple[list[float], dict]:
        # Drawn up front: each conversation's messages do not depend on finishing order.
        shared = tokens(args.shared_prefix)
        hist = [shared + tokens(args.system_len - args.shared_prefix) for _ in range(convs)]
        users = [[tokens(args.user_len) for _ in range(turns)] for _ in range(convs)]
        order = [(c, t) for t in range(turns) for c in range(convs)]  # round robin
        ttft, outs, arrival, first = [], {}, {}, set()
        first_turn.clear()
        nxt = 0

        def submit() -> None:
            nonlocal nxt
            c, t = order[nxt]
            nxt += 1
            if t > 0:  # the whole history: the previous reply and a new user message
                hist[c] = hist[c] + outs[f"{tag}{c}-{t - 1}"] + users[c][t]
            rid = f"{tag}{c}-{t}"
            engine.add_request(rid, {"prompt_token_ids": hist[c]}, params)
            arrival[rid] = time.perf_counter()

        while nxt < min(args.concurrency, len(order)):
            submit()
        while engine.has_unfinished_requests():
            for o in engine.step():
                now = time.perf_counter()
                if o.request_id not in first and o.outputs[0].token_ids:
                    first.add(o.request_id)
                    ttft.append(now - arrival[o.request_id])
                    first_turn.append(o.request_id.endswith("-0"))
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
                    if nxt < len(order):
                        submit()
        return ttft, outs

    converse(args.convs, args.turns, "warm")  # the same shapes, other tokens: compiles
    engine.reset_stats()
    compiled = engine.stats()["compilations"]
    t0 = time.perf_counter()
    ttft, outs = converse(args.convs, args.turns, "c")
    wall = time.perf_counter() - t0
    s = engine.stats()
    return dict(
        out_tokens=sum(len(o) for o in outs.values()),
        ttft=np.array(ttft), first_turn=np.array(first_turn), outs=outs, wall=wall, stats=s,
        computed=s["prefix_cache_query_tokens"] - s["prefix_cache_hit_tokens"],
        compiled=s["compilations"] - compiled,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=192)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=48)
    ap.add_argument("--tier-blocks", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--model", default=None, help="a real model instead of the random llama")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens of the first message every conversation shares")
    ap.add_argument("--indexes", default="hash", help="prefix_index values, comma-separated")
    ap.add_argument("--policies", default="lru", help="eviction_policy values, comma-separated")
    ap.add_argument("--tiers", default="off,on", help="host tier off / on, comma-separated")
    args = ap.parse_args()
    if not 0 <= args.shared_prefix <= args.system_len:
        ap.error("--shared-prefix must be in [0, --system-len]")

    model = args.model or dummy_model_dir(args.hidden, args.layers, args.heads)
    if args.model is None:
        per_block = 2 * args.layers * args.hidden * args.block_size * 4  # K and V, float32
    else:  # the model's KV bytes per block, read off a throwaway engine's pool
        import jax

        e = LLM(model, dtype="float32", block_size=args.block_size, warmup="none",
                num_gpu_blocks_override=2).llm_engine  # fmt: skip
        per_block = sum(x.nbytes for x in jax.tree.leaves(e.kv)) // e.num_blocks
        del e
    final = args.system_len + (args.turns - 1) * (args.output_len + args.user_len)
    working = args.convs * -(-final // args.block_size)
    print(f"working set {working} blocks (final histories), device pool {args.pool_blocks}"
          f" ({working / args.pool_blocks:.1f}x), host tier {args.tier_blocks} blocks;"
          f" load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    tier_gib = {"off": 0.0, "on": (args.tier_blocks + 0.5) * per_block / (1 << 30)}
    combos = [(i, p, t) for t in args.tiers.split(",") for i in args.indexes.split(",")
              for p in args.policies.split(",")]  # fmt: skip
    res = {}
    for index, policy, name in combos:
        r = res[(index, policy, name)] = run(args, model, tier_gib[name], index, policy)
        t = r["ttft"] * 1e3
        s = r["stats"]
        dev_hits = s.get("prefix_cache_device_hit_tokens", s["prefix_cache_hit_tokens"])
        print(f"{index} {policy} tier {name:3s}: TTFT p50 {np.percentile(t, 50):7.1f} ms  p90"
              f" {np.percentile(t, 90):7.1f} ms  prompt tokens computed {r['computed']:6d}"
              f"  hits device {dev_hits}"
              f" host {s.get('prefix_cache_host_hit_tokens', 0)}  offloaded"
              f" {s.get('kv_offloaded_blocks', 0)} reloaded {s.get('kv_reloaded_blocks', 0)}"
              f" blocks ({s.get('kv_reloaded_bytes', 0) / 1e6:.1f} MB back)  wall {r['wall']:.1f} s"
              f"  compiled while timed {r['compiled']}  load {os.getloadavg()[0]:.2f}")  # fmt: skip
        later = t[~r["first_turn"]]
        print(f"          turns >= 2 only: TTFT p50 {np.percentile(later, 50):7.1f} ms  p90"
              f" {np.percentile(later, 90):7.1f} ms; first turns p50"
              f" {np.percentile(t[r['first_turn']], 50):7.1f} ms", flush=True)  # fmt: skip
    print("\n| index | policy | host tier | TTFT p50 | TTFT p90 | turns >= 2 p50 | hit rate device"
          " | hit rate host | prompt tokens computed | output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (index, policy, name), r in res.items():
        t, s = r["ttft"] * 1e3, r["stats"]
        q = max(s["prefix_cache_query_tokens"], 1)
        dev = s.get("prefix_cache_device_hit_tokens", s["prefix_cache_hit_tokens"])
        host = s.get("prefix_cache_host_hit_tokens", 0)
        print(f"| {index} | {policy} | {name} | {np.percentile(t, 50):.1f} ms"
              f" | {np.percentile(t, 90):.1f} ms | {np.percentile(t[~r['first_turn']], 50):.1f} ms"
              f" | {100 * dev / q:.1f} % | {100 * host / q:.1f} % | {r['computed']:,}"
              f" | {r['out_tokens'] / r['wall']:.1f} |")  # fmt: skip
    first = next(iter(res.values()))["outs"]
    same = all(r["outs"] == first for r in res.values())
    print(f"greedy outputs equal across all {len(res)} settings: {same}")


if __name__ == "__main__":
    main()
