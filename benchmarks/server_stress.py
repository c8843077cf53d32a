"""The server under a flood and a soak (issue 32), against ``python -m ...api_server`` in
a subprocess (the engine core in its own process), numbers as one JSON line.

    python benchmarks/server_stress.py flood   # 1,000 requests at once, queue limit 256
    python benchmarks/server_stress.py soak    # 2,000 mixed requests over ~10 minutes

flood: after a warm-up, N requests (default 1,000) are sent at once against
``--max-num-queued-reqs`` 256: the excess must get 503 with ``Retry-After``, every other
request must be served, and the resident memory of the server's processes (API process
+ engine cores) after the flood must stay within 1.5x of before.

soak: M requests (default 2,000) of mixed kinds (streamed, not streamed, aborted
mid-stream, disconnected before the first token, n > 1, shared-prefix prompts) arrive as a
Poisson process sized to last about ``--duration`` seconds; afterwards every KV block must
be free, the running / waiting gauges 0, and resident memory must have grown less than 5 %
since the end of the warm-up (the first tenth of the requests).

Both print the measured numbers and exit non-zero when a check fails; tests/
test_server_stress.py runs them in the slow tier (by hand).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import httpx

MODEL = "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The API server in a subprocess, its URL and its processes' resident memory."""

    def __init__(self, extra: list[str], max_model_len: int = 512):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedjax_stress_", suffix=".log",
                                               delete=False)  # fmt: skip
        cmd = [sys.executable, "-m", "pagedjax.entrypoints.openai.api_server", "--model", MODEL,
               "--port", str(self.port), "--max-model-len", str(max_model_len),
               "--block-size", "16", "--num-gpu-blocks-override", "2048",
               "--disable-log-requests", "--uvicorn-log-level", "warning", *extra]  # fmt: skip
        env = {**os.environ, "PAGEDJAX_WARMUP": os.environ.get("PAGEDJAX_WARMUP", "none")}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {open(self.log.name).read()[-3000:]}")
            time.sleep(0.5)

    def rss(self) -> int:
        """Resident bytes of the server process and its children (the engine cores)."""
        import psutil

        p = psutil.Process(self.proc.pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        text = httpx.get(self.url + "/metrics", timeout=60).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + "".join(f"{{{v}}}" for k, v in sorted(s.labels.items())
                                       if k != "model_name")  # fmt: skip
                out[key] = out.get(key, 0.0) + s.value
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


async def _complete(c: httpx.AsyncClient, body: dict) -> tuple[int, Any]:
    try:
        r = await c.post("/v1/completions", json=body)
    except httpx.HTTPError as e:
        return -1, repr(e)
    return r.status_code, r


async def _wait_idle(server: Server, timeout: float = 300) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m.get("pagedjax:num_requests_running", 1) == 0 and \
                m.get("pagedjax:num_requests_waiting", 1) == 0:  # fmt: skip
            return m
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not go idle: {m}")
        await asyncio.sleep(0.2)


# ------------------------------------------------------------------ flood


def flood(n: int = 1000, queue: int = 256, max_num_seqs: int = 32,
          max_tokens: int = 16) -> dict:  # fmt: skip
    server = Server(["--max-num-queued-reqs", str(queue), "--max-num-seqs", str(max_num_seqs)])
    try:
        return asyncio.run(_flood(server, n, queue, max_tokens))
    finally:
        server.stop()


async def _flood(server: Server, n: int, queue: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=n + 16, max_keepalive_connections=n + 16)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as c:
        def body(i: int) -> dict:
            return dict(model=MODEL, prompt=f"flood request {i}: " + "x" * (i % 40),
                        max_tokens=max_tokens, ignore_eos=True)  # fmt: skip

        warm = await asyncio.gather(*(_complete(c, body(i)) for i in range(64)))
        assert all(s == 200 for s, _ in warm), [s for s, _ in warm]
    await _wait_idle(server)
    rss_before = server.rss()
    # New connections (1,000 clients at once), not the warm-up's idle keep-alive ones: the
    # server closes those after its keep-alive timeout, a race a reused one can lose.
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as c:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_complete(c, body(i)) for i in range(n)))
        elapsed = time.perf_counter() - t0
    m = await _wait_idle(server)
    rss_after = server.rss()
    status = Counter(s for s, _ in results)
    ok = [r for s, r in results if s == 200]
    retry = {r.headers.get("retry-after") for s, r in results if s == 503}
    served_right = all(r.json()["usage"]["completion_tokens"] == max_tokens for r in ok)
    out = dict(
        kind="flood", requests=n, queue_limit=queue, status={str(k): v for k, v in status.items()},
        retry_after=sorted(x for x in retry if x is not None), served_in_full=served_right,
        rejected_metric=m.get("pagedjax:request_rejected_total{queue_full}", 0.0),
        seconds=round(elapsed, 2), rss_before_mib=round(rss_before / 2**20, 1),
        rss_after_mib=round(rss_after / 2**20, 1), rss_ratio=round(rss_after / rss_before, 3),
        kv_usage_after=m.get("pagedjax:kv_cache_usage_perc"),
        client_errors=sorted({r for s, r in results if s == -1}),
    )  # fmt: skip
    out["ok"] = bool(
        status.get(503, 0) > 0 and status.get(200, 0) + status.get(503, 0) == n
        and served_right and retry and None not in retry and rss_after <= 1.5 * rss_before
        and out["kv_usage_after"] == 0
    )  # fmt: skip
    return out


# ------------------------------------------------------------------ soak


KINDS = ("stream", "plain", "abort_mid_stream", "disconnect_before_first", "n3", "prefix")


async def _soak_one(c: httpx.AsyncClient, kind: str, i: int, rng: random.Random) -> str:
    prefix = "You are a helpful assistant. Answer briefly and precisely. " * 3
    body: dict[str, Any] = dict(model=MODEL, prompt=f"soak {i} " + "y" * rng.randrange(40),
                                max_tokens=rng.randrange(4, 48), ignore_eos=True)  # fmt: skip
    if kind == "n3":
        body.update(n=3, temperature=0.8, seed=i)
    elif kind == "prefix":
        body["prompt"] = prefix + f"question {i % 17}"
    if kind in ("stream", "abort_mid_stream"):
        body["stream"] = True
        try:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if kind == "abort_mid_stream" and seen == 2:
                            return "aborted"
                return str(r.status_code)
        except httpx.HTTPError as e:
            return f"error {type(e).__name__}"
    if kind == "disconnect_before_first":
        body.update(stream=True, max_tokens=200)
        task = asyncio.create_task(c.post("/v1/completions", json=body))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "disconnected"
    status, _ = await _complete(c, body)
    return str(status)


def soak(n: int = 2000, duration: float = 600.0, seed: int = 0) -> dict:
    server = Server(["--max-num-seqs", "32"])
    try:
        return asyncio.run(_soak(server, n, duration, seed))
    finally:
        server.stop()


async def _soak(server: Server, n: int, duration: float, seed: int) -> dict:
    rng = random.Random(seed)
    rate = n / duration
    limits = httpx.Limits(max_connections=512)
    outcomes: Counter = Counter()
    rss_warm = None
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as c:
        tasks = []
        for i in range(n):
            kind = KINDS[i % len(KINDS)]
            tasks.append(asyncio.create_task(_soak_one(c, kind, i, rng)))
            if i == n // 10:  # the end of the warm-up
                await asyncio.gather(*tasks)
                await _wait_idle(server)
                rss_warm = server.rss()
            await asyncio.sleep(rng.expovariate(rate))
        for kind_result in await asyncio.gather(*tasks):
            outcomes[kind_result] += 1
    m = await _wait_idle(server)
    rss_end = server.rss()
    elapsed = time.perf_counter() - t0
    out = dict(
        kind="soak", requests=n, seconds=round(elapsed, 1), outcomes=dict(outcomes),
        running=m.get("pagedjax:num_requests_running"),
        waiting=m.get("pagedjax:num_requests_waiting"),
        kv_usage=m.get("pagedjax:kv_cache_usage_perc"),
        rss_warm_mib=round(rss_warm / 2**20, 1), rss_end_mib=round(rss_end / 2**20, 1),
        rss_growth=round(rss_end / rss_warm - 1, 4),
    )  # fmt: skip
    bad = {k: v for k, v in outcomes.items()
           if k not in ("200", "aborted", "disconnected")}  # fmt: skip
    out["ok"] = bool(not bad and out["running"] == 0 and out["waiting"] == 0
                     and out["kv_usage"] == 0 and out["rss_growth"] < 0.05)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["flood", "soak"])
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--queue", type=int, default=256, help="flood: --max-num-queued-reqs")
    p.add_argument("--duration", type=float, default=600.0, help="soak: seconds")
    a = p.parse_args(argv)
    if a.kind == "flood":
        out = flood(a.requests or 1000, a.queue)
    else:
        out = soak(a.requests or 2000, a.duration)
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
