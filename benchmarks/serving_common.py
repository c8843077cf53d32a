"""Shared pieces of the server benchmarks (server_overhead.py, prefix_caching_server.py).

``dummy_model_dir``: a config.json of a random llama (weights drawn at load,
load_format="dummy"; byte-level tokenizer). ``serve``: the OpenAI server over an LLM in
a thread of this process (uvicorn). ``run_client``: the load generator in a *separate*
process (as vLLM's benchmark client is), so its JSON and HTTP work is not charged to
the server's interpreter; it prints one JSON line of per-request timings.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def dummy_model_dir(hidden: int, layers: int, heads: int, vocab: int = 512,
                    max_pos: int = 4096) -> str:  # fmt: skip
    d = Path(tempfile.mkdtemp(prefix="pagedjax_bench_model_"))
    cfg = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab,
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, rms_norm_eps=1e-6,
        max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def serve(llm: Any, name: str, chat_template: str | None = None):
    """(server, thread, url, engine, metrics): the OpenAI server over llm's engine."""
    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.api_server import SERVER_SWITCH_INTERVAL_S
    from pagedjax.entrypoints.openai.metrics import ServerMetrics

    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)  # as run_server does
    metrics = ServerMetrics(name)
    engine = AsyncLLMEngine.from_llm(llm, stats=metrics)
    server, thread, url = serve_engine(engine, name, chat_template, metrics)
    return server, thread, url, engine, metrics


def serve_engine(engine: Any, name: str, chat_template: str | None = None, metrics=None,
                 http: str = "auto"):  # fmt: skip
    """(server, thread, url): uvicorn (``http``: auto / h11 / httptools) over an app on an
    existing AsyncLLMEngine."""
    import uvicorn

    from pagedjax.entrypoints.openai.api_server import build_app

    app = build_app(engine, [name], chat_template=chat_template, metrics=metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http,
                                           log_level="warning", backlog=4096))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def stop(server, thread, engine) -> None:
    server.should_exit = True
    thread.join(30)
    engine.shutdown()


def run_client(url: str, requests: list[dict], concurrency: int | None = None) -> dict:
    """Send ``requests`` (request bodies, "stream" forced on) to url from a subprocess;
    all at once, or at most ``concurrency`` in flight. Returns {"wall": s, "results":
    [{"ttft", "latency", "tokens", "error"}]} (tokens: the server's usage; ttft: the
    first chunk with choices, None if every token decoded to no text)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(url=url, requests=requests, concurrency=concurrency), f)
    out = subprocess.run(
        [sys.executable, __file__, f.name], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"client failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _client_main(path: str) -> None:
    import asyncio

    import httpx

    job = json.loads(Path(path).read_text())

    async def one(c, sem, body) -> dict:
        body = dict(body, stream=True, stream_options={"include_usage": True})
        res = dict(ttft=None, latency=None, tokens=0, error=None)
        async with sem:
            t0 = time.perf_counter()
            async with c.stream("POST", job["url"], json=body) as r:
                if r.status_code != 200:
                    res["error"] = f"HTTP {r.status_code}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        res["tokens"] = chunk["usage"]["completion_tokens"]
                    # A chunk with choices carries a token: chat sends the role chunk
                    # with the first token, completions a chunk per non-empty text.
                    if chunk.get("choices") and res["ttft"] is None:
                        res["ttft"] = time.perf_counter() - t0
            res["latency"] = time.perf_counter() - t0
        return res

    async def main() -> dict:
        n = len(job["requests"])
        sem = asyncio.Semaphore(job["concurrency"] or n)
        limits = httpx.Limits(max_connections=max(n, 1))
        async with httpx.AsyncClient(timeout=None, limits=limits) as c:
            t0 = time.perf_counter()
            results = await asyncio.gather(*[one(c, sem, b) for b in job["requests"]])
            return dict(wall=time.perf_counter() - t0, results=results)

    print(json.dumps(asyncio.run(main())))


if __name__ == "__main__":
    _client_main(sys.argv[1])
