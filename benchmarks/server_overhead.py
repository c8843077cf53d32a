"""Server overhead: output tokens/s through the OpenAI server at saturation against
``LLM.generate`` on the same requests and model (issue 16's target: ratio >= 0.85).

    python benchmarks/server_overhead.py [--num-prompts 64] [--input-len 32]
        [--output-len 32] [--hidden 256 --layers 4 --heads 4]

One random llama (load_format="dummy", byte-level tokenizer), one LLM whose every
(tokens, sequences) bucket is compiled first (``warmup(mode="all")``): requests that
arrive over HTTP one by one form batches that ``LLM.generate`` never forms, and a
compile inside a timed run would be charged to the server. The same N requests (random
printable prompts of --input-len tokens, greedy, ignore_eos, max_tokens --output-len)
then run, each path once untimed, then ``--repeats`` rounds of timed runs that
alternate the paths (so a change in the machine's load hits every path alike; the
table gives each path's median and the median of the per-round ratios):

1. ``LLM.generate`` (offline, no server);
2. ``AsyncLLMEngine.generate`` from asyncio in this process (the async layer alone);
3. the HTTP server (uvicorn in a thread of this process) with all N requests sent at
   once as streams by a client in another process (benchmarks/serving_common.py), for
   each variant: uvicorn's HTTP parser (httptools / pure-Python h11) x the GIL switch
   interval (the server's 0.5 ms / CPython's default 5 ms), the engine stepped by a
   thread of the server process (``--disable-frontend-multiprocessing``);
4. the same server with the engine core in a process of its own (``MPEngineClient``,
   the server's default; ``--mp-variants``), built from the same config and weights
   (same seed) and warmed up the same way (every bucket, in the core).

Printed: tokens/s and the ratio to LLM.generate of each, the compilations during the
timed runs (must be 0), and the load (uptime).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np
from serving_common import dummy_model_dir, run_client, serve_engine  # benchmarks/ on path

from pagedjax import LLM, SamplingParams
from pagedjax.engine.core_client import MPEngineClient
from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.llm import engine_config
from pagedjax.entrypoints.openai.api_server import SERVER_SWITCH_INTERVAL_S
from pagedjax.machine import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--variants", default="httptools:0.0005,httptools:0.005,h11:0.0005",
                    help="HTTP:SWITCH_INTERVAL_S list for the server runs")  # fmt: skip
    ap.add_argument("--mp-variants", default="httptools:0.0005",
                    help="HTTP:SWITCH_INTERVAL_S list for the engine-core-process server"
                         " runs ('' for none)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--offline-switch-interval", type=float, default=SERVER_SWITCH_INTERVAL_S,
                    help="GIL switch interval of the LLM.generate runs (default: the"
                         " server's, so the comparison changes one thing)")  # fmt: skip
    args = ap.parse_args()

    model = dummy_model_dir(args.hidden, args.layers, args.heads)
    llm_kwargs = dict(
        model=model, load_format="dummy", dtype="float32", max_model_len=1024,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=1 << 30,
    )  # fmt: skip
    llm = LLM(**llm_kwargs)
    t0 = time.perf_counter()
    llm.llm_engine.warmup(mode="all")
    warm_s = time.perf_counter() - t0
    compiles = lambda: llm.llm_engine.stats()["compilations"]  # noqa: E731
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

    engine = AsyncLLMEngine.from_llm(llm)

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

    bodies = [dict(model="bench", prompt=p, max_tokens=args.output_len, temperature=0.0,
                   ignore_eos=True) for p in prompts]  # fmt: skip
    variants = [(v.split(":")[0], float(v.split(":")[1])) for v in args.variants.split(",")]
    servers = {v: serve_engine(engine, "bench", http=v[0]) for v in variants}
    mp_variants = [(v.split(":")[0], float(v.split(":")[1]))
                   for v in args.mp_variants.split(",") if v]  # fmt: skip
    mp_engine = None
    if mp_variants:
        client = MPEngineClient(engine_config(**llm_kwargs, warmup="all"))
        mp_engine = AsyncLLMEngine(client)
        for v in mp_variants:
            servers[("mp", *v)] = serve_engine(mp_engine, "bench", http=v[0])
        mp_compiles = lambda: client.stats()["compilations"]  # noqa: E731

    def offline_run() -> float:
        # The engine thread is idle between runs; LLM.generate drives the engine from
        # here while nothing else is queued (the async engine only steps on requests).
        sys.setswitchinterval(args.offline_switch_interval)
        return offline()

    def async_run() -> float:
        sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
        return asyncio.run(async_layer())

    def server_run(v) -> tuple[float, list]:
        sys.setswitchinterval(v[-1])
        got = run_client(servers[v][2] + "/v1/completions", bodies)
        tokens = sum(r["tokens"] for r in got["results"])
        assert tokens == want and not any(r["error"] for r in got["results"])
        return want / got["wall"], [r["ttft"] for r in got["results"] if r["ttft"]]

    all_variants = [*variants, *[("mp", *v) for v in mp_variants]]
    offline_run(), async_run()  # untimed
    for v in all_variants:
        server_run(v)
    c0 = compiles()
    m0 = mp_compiles() if mp_variants else 0
    names = [
        f"LLM.generate, {args.offline_switch_interval * 1e3:g} ms switch",
        "AsyncLLMEngine (in-process asyncio), 0.5 ms switch",
        *[f"HTTP server, engine thread: {h}, {i * 1e3:g} ms switch" for h, i in variants],
        *[f"HTTP server, engine core process: {h}, {i * 1e3:g} ms switch"
          for h, i in mp_variants],
    ]  # fmt: skip
    tps: dict[str, list[float]] = {n: [] for n in names}
    ttfts: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        tps[names[0]].append(offline_run())
        tps[names[1]].append(async_run())
        for name, v in zip(names[2:], all_variants, strict=True):
            t, tt = server_run(v)
            tps[name].append(t)
            ttfts.setdefault(name, []).extend(tt)
    stop_compiles = compiles() - c0 + (mp_compiles() - m0 if mp_variants else 0)
    for server, thread, _ in servers.values():
        server.should_exit = True
        thread.join(30)
    engine.shutdown()
    if mp_engine is not None:
        mp_engine.shutdown()
    base = tps[names[0]]
    rows = [(n, float(np.median(v)), float(np.median(np.array(v) / np.array(base))))
            for n, v in tps.items()]  # fmt: skip

    print(f"# server overhead on {cpu_model()} ({os.cpu_count()} cores); load: "
          f"{os.getloadavg()[0]:.2f} (1-min average at the end)")  # fmt: skip
    print(f"# model: random llama hidden={args.hidden} layers={args.layers} heads={args.heads};"
          f" {args.num_prompts} requests x ({args.input_len} in, {args.output_len} out),"
          f" greedy, all at once; max_num_seqs={args.max_num_seqs},"
          f" max_num_batched_tokens={args.max_num_batched_tokens}; warm-up (all buckets)"
          f" {warm_s:.0f} s; compilations during the timed runs: {stop_compiles}")  # fmt: skip
    print(f"# {args.repeats} rounds; per path: median tok/s, median of the per-round ratios"
          " to LLM.generate, and each round's tok/s")  # fmt: skip
    print("| path | median output tok/s | median ratio to LLM.generate | rounds | mean TTFT ms |")
    print("|---|---|---|---|---|")
    for name, med, ratio in rows:
        t = ttfts.get(name)
        ttft = f"{np.mean(t) * 1e3:.0f}" if t else "-"
        each = ", ".join(f"{x:.0f}" for x in tps[name])
        print(f"| {name} | {med:.1f} | {ratio:.2f} | {each} | {ttft} |")
    print(f"server_over_offline: {rows[2][2]:.3f}")
    if mp_variants:
        print(f"core_process_server_over_offline: {rows[2 + len(variants)][2]:.3f}")


if __name__ == "__main__":
    main()
