"""Server overhead: output tokens/s through the OpenAI server at saturation against
``LLM.generate`` on the same requests and model (issue 16's target: ratio >= 0.85).

    python benchmarks/server_overhead.py [--num-prompts 256] [--input-len 64]
        [--output-len 64] [--hidden 512 --layers 8 --heads 8]

One random llama (load_format="dummy", byte-level tokenizer), one LLM. The same N
requests (random printable prompts of --input-len tokens, greedy, ignore_eos, max_tokens
--output-len) run three ways, each once to compile and once timed:

1. ``LLM.generate`` (offline, no server);
2. ``AsyncLLMEngine.generate`` from asyncio in this process (the async layer alone);
3. the HTTP server (uvicorn thread in this process), all N requests sent at once as
   streams by a client in another process (benchmarks/serving_common.py).

Printed: tokens/s of each and the ratios to LLM.generate, plus the load (uptime).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np
from serving_common import dummy_model_dir, run_client, serve, stop  # benchmarks/ is on sys.path

from pagedjax import LLM, SamplingParams
from pagedjax.machine import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--num-scheduler-steps", type=int, default=1)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="GIL switch interval (s) for the server (default: the server's,"
                         " api_server.SERVER_SWITCH_INTERVAL_S)")  # fmt: skip
    args = ap.parse_args()

    model = dummy_model_dir(args.hidden, args.layers, args.heads)
    llm = LLM(
        model=model, load_format="dummy", dtype="float32", max_model_len=1024,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=1 << 30, num_scheduler_steps=args.num_scheduler_steps,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    # Printable ASCII: one byte-level token each, so prompts are exactly input_len tokens
    # (plus BOS) as text, the same ids on every path.
    prompts = ["".join(chr(c) for c in rng.integers(32, 127, args.input_len))
               for _ in range(args.num_prompts)]  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    want = args.num_prompts * args.output_len

    def offline() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == want
        return want / dt

    offline()  # compile
    offline_tps = offline()

    server, thread, url, engine, _ = serve(llm, "bench")
    if args.switch_interval is not None:
        import sys

        sys.setswitchinterval(args.switch_interval)

    async def async_layer() -> float:
        async def one(i: int, p: str) -> int:
            last = None
            async for out in engine.generate(p, sp, f"a{time.monotonic_ns()}-{i}"):
                last = out
            return len(last.outputs[0].token_ids)

        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))
        dt = time.perf_counter() - t0
        assert n == want
        return want / dt

    async_tps = asyncio.run(async_layer())
    bodies = [dict(model="bench", prompt=p, max_tokens=args.output_len, temperature=0.0,
                   ignore_eos=True) for p in prompts]  # fmt: skip
    run_client(url + "/v1/completions", bodies)  # warm (nothing new should compile)
    got = run_client(url + "/v1/completions", bodies)
    stop(server, thread, engine)
    tokens = sum(r["tokens"] for r in got["results"])
    assert tokens == want and not any(r["error"] for r in got["results"]), got["results"][:3]
    server_tps = want / got["wall"]
    ttft = np.array([r["ttft"] for r in got["results"] if r["ttft"] is not None])

    print(f"# server overhead on {cpu_model()} ({os.cpu_count()} cores); load: "
          f"{os.getloadavg()[0]:.2f} (1-min average at the end)")  # fmt: skip
    print(f"# model: random llama hidden={args.hidden} layers={args.layers} heads={args.heads};"
          f" {args.num_prompts} requests x ({args.input_len} in, {args.output_len} out),"
          f" greedy, all at once; max_num_seqs={args.max_num_seqs}")  # fmt: skip
    print("| path | output tok/s | ratio to LLM.generate |")
    print("|---|---|---|")
    print(f"| LLM.generate | {offline_tps:.1f} | 1.00 |")
    print(f"| AsyncLLMEngine (in-process asyncio) | {async_tps:.1f} | "
          f"{async_tps / offline_tps:.2f} |")  # fmt: skip
    print(f"| HTTP server, streaming client in another process | {server_tps:.1f} | "
          f"{server_tps / offline_tps:.2f} |")  # fmt: skip
    if len(ttft):
        print(f"# server: mean TTFT {ttft.mean() * 1e3:.0f} ms, wall {got['wall']:.2f} s")
    print(f"server_over_offline: {server_tps / offline_tps:.3f}")


if __name__ == "__main__":
    main()
