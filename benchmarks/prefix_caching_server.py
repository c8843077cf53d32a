"""The prefix-caching scenario vLLM's users quote, over the OpenAI server: a long shared
system prompt, short user turns, chat requests; mean TTFT and throughput with automatic
prefix caching off and on, side by side.

    python benchmarks/prefix_caching_server.py [--system-len 1500] [--num-requests 30]
        [--output-len 32] [--concurrency 1]

One random llama (load_format="dummy", byte-level tokenizer: one token per printable
character) served twice, once per setting, with a plain chat template. Before the timed
requests, two warm-up requests with a *different* system prompt compile the prefill and
(on) the cache-hit shapes, so neither setting compiles while timed and the timed
system prompt is new to the cache. The quoted vLLM figures (220 ms -> 25 ms TTFT,
1,200 -> 8,500 tokens/s) are from a GPU; on this CPU only the ratios count.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from serving_common import dummy_model_dir, run_client, serve, stop  # benchmarks/ is on sys.path

from pagedjax import LLM
from pagedjax.machine import cpu_model

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system-len", type=int, default=1500)
    ap.add_argument("--num-requests", type=int, default=30)
    ap.add_argument("--user-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()

    model = dummy_model_dir(args.hidden, args.layers, args.heads)
    rng = np.random.default_rng(0)
    text = lambda n: "".join(chr(c) for c in rng.integers(97, 123, n))  # noqa: E731
    system, warm_system = text(args.system_len), text(args.system_len)
    users = [text(args.user_len) for _ in range(args.num_requests + 2)]

    def bodies(sys_prompt: str, turns: list[str]) -> list[dict]:
        return [dict(model="bench", max_tokens=args.output_len, temperature=0.0,
                     ignore_eos=True, messages=[{"role": "system", "content": sys_prompt},
                                                {"role": "user", "content": u}])
                for u in turns]  # fmt: skip

    rows = []
    for caching in (False, True):
        llm = LLM(
            model=model, load_format="dummy", dtype="float32",
            max_model_len=args.system_len + args.user_len + args.output_len + 64,
            max_num_seqs=32, max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=1 << 30, enable_prefix_caching=caching,
        )  # fmt: skip
        server, thread, url, engine, _ = serve(llm, "bench", chat_template=TEMPLATE)
        chat = url + "/v1/chat/completions"
        for body in bodies(warm_system, users[-2:]):  # one miss, then one hit
            run_client(chat, [body])
        got = run_client(chat, bodies(system, users[: args.num_requests]), args.concurrency)
        stats = engine.call_future(lambda e: e.stats()).result()
        stop(server, thread, engine)
        res = got["results"]
        assert not any(r["error"] for r in res), res[:3]
        ttft = np.array([r["ttft"] for r in res])
        tokens = sum(r["tokens"] for r in res)
        prompt_tokens = args.num_requests * (args.system_len + args.user_len)
        rows.append(dict(
            caching="on" if caching else "off", ttft_ms=ttft.mean() * 1e3,
            p50_ms=np.median(ttft) * 1e3, out_tps=tokens / got["wall"],
            total_tps=(tokens + prompt_tokens) / got["wall"], wall=got["wall"],
            hit_rate=stats["prefix_cache_hit_rate"],
        ))  # fmt: skip
    print(f"# prefix caching over the server on {cpu_model()} ({os.cpu_count()} cores); load:"
          f" {os.getloadavg()[0]:.2f} (1-min average at the end)")  # fmt: skip
    print(f"# random llama hidden={args.hidden} layers={args.layers}; system prompt"
          f" {args.system_len} tokens, {args.num_requests} chat requests of {args.user_len}-token"
          f" user turns, {args.output_len} output tokens, {args.concurrency} in flight")
    print("| prefix caching | mean TTFT ms | median TTFT ms | output tok/s | total tok/s |"
          " wall s | hit rate (all requests, warm-up included) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['caching']} | {r['ttft_ms']:.1f} | {r['p50_ms']:.1f} | {r['out_tps']:.1f} |"
              f" {r['total_tps']:.1f} | {r['wall']:.2f} | {r['hit_rate']:.2f} |")  # fmt: skip
    off, on = rows
    print(f"ttft_off_over_on: {off['ttft_ms'] / on['ttft_ms']:.2f}")
    print(f"throughput_on_over_off: {on['out_tps'] / off['out_tps']:.2f}")


if __name__ == "__main__":
    main()
