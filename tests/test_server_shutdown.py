"""The server as an operator runs it (issue 32): ``python -m ...api_server`` in a
subprocess, the engine core in its own process.

1. A step raises inside the engine core (``PAGEDJAX_FAULT_INJECT=raise:FILE``): the
   stream in it ends with a 500 naming the fault, the server serves on. The engine core
   process is killed mid-stream (``kill:FILE``): the stream ends with an error naming
   the SIGKILL, /health answers 503 while the core
   restarts (``--max-engine-restarts 1``), then 200, and a request is served again.
2. SIGTERM with streams in flight (``--shutdown-timeout 1``): a new request gets 503
   with ``Retry-After`` at once; the short stream finishes normally; the long ones end
   with a 503 ``ShuttingDownError`` event naming the timeout, then ``[DONE]``; the
   process logs its final counters and exits with status 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.engine_helpers import free_port, wait_healthy

pytestmark = [pytest.mark.tier2]

NAME = "tiny-llama"


async def _stream(c: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> list:
    """The stream's events (JSON objects, then the string "[DONE]")."""
    body = dict(model=NAME, prompt="hello", max_tokens=max_tokens, ignore_eos=True,
                temperature=0, stream=True)  # fmt: skip
    events: list = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                events.append("[DONE]")
            elif line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                started.set()
    return events


def test_engine_kill_restart_then_sigterm_drains(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kill_file, raise_file = tmp_path / "kill", tmp_path / "raise"
    log_path = tmp_path / "server.log"
    env = {**os.environ, "PAGEDJAX_FAULT_INJECT": f"raise:{raise_file},kill:{kill_file}",
           "PAGEDJAX_WARMUP": "none"}  # fmt: skip
    cmd = [sys.executable, "-m", "pagedjax.entrypoints.openai.api_server", "--model", NAME,
           "--port", str(port), "--max-model-len", "2048", "--block-size", "16",
           "--num-gpu-blocks-override", "512", "--max-num-seqs", "4",
           "--num-scheduler-steps", "1", "--shutdown-timeout", "1",
           "--max-engine-restarts", "1", "--disable-log-requests"]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(url, [proc], 300, lambda: open(log_path).read()[-3000:])

        async def fault_mid_stream(trigger) -> dict:
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                started = asyncio.Event()
                task = asyncio.create_task(_stream(c, 1900, started))
                await asyncio.wait_for(started.wait(), 60)
                trigger.touch()
                events = await task
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500, events[-3:]
            assert not trigger.exists()
            return events[-2]["error"]

        # A step that raises in the core: its batch fails, the core serves on.
        err = asyncio.run(fault_mid_stream(raise_file))
        assert "engine step failed: InjectedFault" in err["message"], err
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json={"model": NAME, "prompt": "on", "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # The core killed: the stream fails naming the signal, a new core starts.
        err = asyncio.run(fault_mid_stream(kill_file))
        assert "SIGKILL" in err["message"] and "restarting" in err["message"], err
        wait_healthy(url, [proc], 300, lambda: open(log_path).read()[-3000:])
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json={"model": NAME, "prompt": "again", "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        async def sigterm_with_streams_in_flight():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                flags = [asyncio.Event() for _ in range(3)]
                tasks = [asyncio.create_task(_stream(c, n, f))
                         for n, f in zip((1900, 1900, 40), flags, strict=True)]  # fmt: skip
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 60)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                r = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                assert r.status_code == 503 and r.headers.get("retry-after"), r.text
                assert "shutting down" in r.json()["error"]["message"]
                return await asyncio.gather(*tasks)

        long1, long2, short = asyncio.run(sigterm_with_streams_in_flight())
        assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
        for events in (long1, long2):
            err = events[-2]["error"]
            assert events[-1] == "[DONE]" and err["code"] == 503, events[-3:]
            assert "--shutdown-timeout 1" in err["message"]
        assert proc.wait(60) == 0
        text = log_path.read_text()
        assert "final counters" in text and "engine stopped" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
