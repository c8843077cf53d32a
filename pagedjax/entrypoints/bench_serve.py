"""``pagedjax bench serve``: vLLM's serving benchmark (``vllm bench serve``) against any
OpenAI-compatible server.

Requests come from a dataset (``random``: random tokens of given lengths, with an
optional shared prefix; ``sharegpt``: vLLM's ShareGPT sampling rules; ``trace``: the
Azure-format CSVs of ``data/traces/``, with the trace's own arrival times unless
``--request-rate`` is given), are sent on a Poisson / gamma schedule (``--request-rate``,
``--burstiness``) under an optional ``--max-concurrency``, streamed, and timed on the
client: time to first token (TTFT), time per output token after the first (TPOT),
inter-token latency (ITL, between streamed chunks), end-to-end latency (E2EL); output
tokens are the server's ``usage`` (``stream_options.include_usage``). The report has
vLLM's fields and, with ``--goodput ttft:MS tpot:MS e2el:MS``, the rate of requests
that met every SLO. ``--save-result`` writes it as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int
    arrival: float | None = None  # trace datasets: seconds from the start


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat", "vllm"],
                   help="openai / vllm: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default by backend")
    p.add_argument("--model", required=True, help="model name sent in requests")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: --model if a directory; else bytes)")
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "trace"])
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--trace-max-len", type=int, default=None,
                   help="[pagedjax only] scale trace lengths so prompt + output fit")  # fmt: skip
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", default=None, help="SLOs KEY:MS, keys ttft tpot e2el")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")


# ---------------------------------------------------------------- datasets


def _tokenizer(args: argparse.Namespace):
    from pagedjax.tokenizer import ByteTokenizer, load_tokenizer

    path = args.tokenizer or (args.model if Path(args.model).is_dir() else None)
    return load_tokenizer(path) if path else ByteTokenizer()


def _text_ids(tok) -> np.ndarray:
    """Ids that decode to plain text on their own (random prompts sample from these)."""
    ok = []
    for i in range(min(tok.vocab_size, 1 << 17)):
        s = tok.decode([i])
        if s and s.isprintable() and "\ufffd" not in s:
            ok.append(i)
    if not ok:
        raise SystemExit("error: the tokenizer decodes no id to printable text")
    return np.array(ok)


def _random_text(tok, ids: np.ndarray, n: int, rng: np.random.Generator) -> str:
    return tok.decode(rng.choice(ids, size=n).tolist()) if n > 0 else ""


def sample_requests(args: argparse.Namespace, tok) -> list[BenchRequest]:
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    if args.dataset_name == "sharegpt":
        from pagedjax.workloads.sharegpt import load_sharegpt

        if not args.dataset_path:
            raise SystemExit("error: --dataset-name sharegpt needs --dataset-path")
        s = load_sharegpt(args.dataset_path, tok.encode, n, seed=args.seed)
        out = args.sharegpt_output_len
        rows = zip(s.prompts, s.prompt_len, s.output_len, strict=True)
        return [BenchRequest(p, int(pl), int(out or ol)) for p, pl, ol in rows]
    ids = _text_ids(tok)
    if args.dataset_name == "trace":
        from pagedjax.workloads.azure import load_azure_conv

        w = load_azure_conv(args.dataset_path)
        if args.trace_max_len is not None:
            w = w.scale_to_context(args.trace_max_len)
        w = w.head(min(n, len(w)))
        lens = zip(w.arrival_time, w.prompt_len, w.output_len, strict=True)
        reqs = []
        for t, pl, ol in lens:
            text = _random_text(tok, ids, int(pl), rng)
            reqs.append(BenchRequest(text, len(tok.encode(text)), int(ol), float(t)))
        return reqs
    lo_in = max(1, int(args.random_input_len * (1 - args.random_range_ratio)))
    hi_in = int(args.random_input_len * (1 + args.random_range_ratio))
    lo_out = max(1, int(args.random_output_len * (1 - args.random_range_ratio)))
    hi_out = int(args.random_output_len * (1 + args.random_range_ratio))
    prefix = _random_text(tok, ids, args.random_prefix_len, rng)
    reqs = []
    for _ in range(n):
        text = prefix + _random_text(tok, ids, int(rng.integers(lo_in, hi_in + 1)), rng)
        out_len = int(rng.integers(lo_out, hi_out + 1))
        reqs.append(BenchRequest(text, len(tok.encode(text)), out_len))
    return reqs


# ---------------------------------------------------------------- client


async def send(client, url: str, args: argparse.Namespace, req: BenchRequest) -> RequestResult:
    chat = args.backend == "openai-chat"
    body: dict[str, Any] = {
        "model": args.served_model_name or args.model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    res = RequestResult(prompt_len=req.prompt_len)
    headers = {}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for ch in chunk.get("choices", []):
                    text = ch.get("delta", {}).get("content") if chat else ch.get("text")
                    if text:
                        if res.ttft == 0.0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
            res.latency = time.perf_counter() - start
            res.success = True
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args: argparse.Namespace, reqs: list[BenchRequest]) -> tuple[list, float]:
    import httpx

    from pagedjax.workloads.arrivals import arrival_times

    base = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    )
    url = base.rstrip("/") + endpoint
    if reqs and reqs[0].arrival is not None and math.isinf(args.request_rate):
        times = np.array([r.arrival for r in reqs])  # the trace's own schedule
    else:
        process = "poisson" if args.burstiness == 1.0 else "gamma"
        times = arrival_times(len(reqs), args.request_rate, args.seed, process, args.burstiness)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if not args.disable_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(reqs))
    limits = httpx.Limits(max_connections=args.max_concurrency or 4096)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int, req: BenchRequest) -> RequestResult:
            delay = t0 + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                res = await send(client, url, args, req)
            else:
                async with sem:
                    res = await send(client, url, args, req)
            if bar is not None:
                bar.update(1)
            return res

        results = await asyncio.gather(*[one(i, r) for i, r in enumerate(reqs)])
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return results, duration


# ---------------------------------------------------------------- report


def summarize(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    outs = [r.output_tokens for r in ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    e2el = [r.latency for r in ok]
    pct = [float(x) for x in args.metric_percentiles.split(",")]
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "model_id": args.model,
        "dataset_name": args.dataset_name,
        "num_prompts": len(results),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(outs),
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(outs) / duration,
        "total_token_throughput": (sum(r.prompt_len for r in ok) + sum(outs)) / duration,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        ms = np.array(xs) * 1000 if xs else np.zeros(1)
        out[f"mean_{name}_ms"] = float(ms.mean())
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"std_{name}_ms"] = float(ms.std())
        for p in pct:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    if args.goodput:
        slo = {}
        for item in args.goodput:
            key, _, val = item.partition(":")
            if key not in ("ttft", "tpot", "e2el") or not val:
                raise SystemExit(f"error: --goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
            slo[key] = float(val) / 1000
        good = 0
        for r in ok:
            t = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            vals = {"ttft": r.ttft, "tpot": t, "e2el": r.latency}
            good += all(vals[k] <= v for k, v in slo.items())
        out["request_goodput"] = good / duration
    return out


def print_report(m: dict, args: argparse.Namespace) -> None:
    line = lambda k, v: print(f"{k:<40}{v:<10}")  # noqa: E731
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Successful requests:", m["completed"])
    if m["max_concurrency"]:
        line("Maximum request concurrency:", m["max_concurrency"])
    line("Benchmark duration (s):", f"{m['duration']:.2f}")
    line("Total input tokens:", m["total_input_tokens"])
    line("Total generated tokens:", m["total_output_tokens"])
    line("Request throughput (req/s):", f"{m['request_throughput']:.2f}")
    if "request_goodput" in m:
        line("Request goodput (req/s):", f"{m['request_goodput']:.2f}")
    line("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}")
    line("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}  # fmt: skip
    for name in args.percentile_metrics.split(","):
        print("{s:{c}^{n}}".format(s=titles[name], n=50, c="-"))
        up = name.upper()
        line(f"Mean {up} (ms):", f"{m[f'mean_{name}_ms']:.2f}")
        line(f"Median {up} (ms):", f"{m[f'median_{name}_ms']:.2f}")
        for p in args.metric_percentiles.split(","):
            line(f"P{p} {up} (ms):", f"{m[f'p{float(p):g}_{name}_ms']:.2f}")
    if m["failed"]:
        print(f"failed requests: {m['failed']}; errors: {m['errors']}")
    print("=" * 50)


def main(args: argparse.Namespace) -> dict:
    tok = _tokenizer(args)
    reqs = sample_requests(args, tok)
    results, duration = asyncio.run(run(args, reqs))
    metrics = summarize(args, results, duration)
    print_report(metrics, args)
    if args.save_result:
        name = args.result_filename or (
            f"{args.backend}-{args.request_rate}qps-{Path(args.model).name}-{metrics['date']}.json"
        )
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(metrics, indent=2))
        print(f"saved {path}")
    return metrics

