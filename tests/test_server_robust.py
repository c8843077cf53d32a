"""The server under faults and limits (issue 32), on the tiny-llama preset in this process.

- Disconnects: a streamed and a non-streamed request that wait in the queue behind a
  running one (no first token yet), and a non-streamed one that has tokens, are each
  aborted when their client goes away: the waiting / running counts drop while the
  running request is still generating, the abort is counted, every block is free after.
- A step that raises (the ``PAGEDJAX_FAULT_INJECT`` hook inside the model runner) fails
  the request in that batch with a 500 naming the fault, frees its blocks, and the
  request queued behind it is served.
- The waiting-queue bound: 503 with ``Retry-After``, counted in /metrics.
- --request-timeout: a 504 ``TimeoutError`` (and an error event in a stream), blocks freed.
- Body and field limits: size (413), content type (415), depth, messages, n, stop.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import httpx
import pytest

from pagedjax import LLM
from pagedjax.engine.faults import FAULT_ENV
from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.openai.api_server import build_app
from pagedjax.entrypoints.openai.limits import ServerLimits
from pagedjax.entrypoints.openai.metrics import ServerMetrics
from tests.engine_helpers import serve_in_thread

NAME = "tiny-llama"
LONG = 1000  # tokens of a request that holds the only slot: long enough to outlast a check


class Served:
    def __init__(self, url: str, app: Any, engine: AsyncLLMEngine, fault_file: str):
        self.url, self.app, self.engine, self.fault_file = url, app, engine, fault_file

    def call(self, fn):
        return self.engine.call_future(fn).result(timeout=60)

    def counts(self) -> dict[str, int]:
        return self.call(lambda e: e.request_counts())

    def scrape(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=60).text
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def aborted(self) -> float:
        return self.scrape("pagedjax:request_success_total", finished_reason="abort")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    fault_file = str(tmp_path_factory.mktemp("faults") / "raise")
    os.environ[FAULT_ENV] = f"raise:{fault_file}"  # read once, when the runner is built
    try:
        llm = LLM(NAME, max_model_len=1024, num_gpu_blocks_override=160, block_size=8,
                  max_num_seqs=1, max_num_batched_tokens=64, num_scheduler_steps=1,
                  warmup="none")  # fmt: skip
    finally:
        del os.environ[FAULT_ENV]
    metrics = ServerMetrics(NAME)
    engine = AsyncLLMEngine.from_llm(llm, stats=metrics)
    app = build_app(engine, [NAME], metrics=metrics)
    server, thread, url = serve_in_thread(app)
    yield Served(url, app, engine, fault_file)
    server.should_exit = True
    thread.join(30)
    engine.shutdown()


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _assert_idle_and_free(s: Served) -> None:
    _wait(lambda: not s.call(lambda e: e.has_unfinished_requests()), "requests to finish")
    free, usable, counts = s.call(
        lambda e: (e.num_free_blocks(), e.num_usable_blocks(), e.request_counts())
    )
    assert free == usable
    assert counts == dict(running=0, waiting=0, swapped=0, slots_in_use=0)


def _body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return dict(model=NAME, prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                temperature=0, stream=stream)  # fmt: skip


async def _read_all(c: httpx.AsyncClient, body: dict) -> tuple[int, list[dict]]:
    """(status, the stream's JSON events or the one JSON body)."""
    if not body.get("stream"):
        r = await c.post("/v1/completions", json=body)
        return r.status_code, [r.json()]
    events = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, [r.json()]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return r.status_code, events


# ------------------------------------------------------------------ disconnects


def test_every_disconnect_aborts(served):
    s = served

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            blocker = asyncio.create_task(_read_all(c, _body("blocker", LONG, True)))
            await asyncio.to_thread(_wait, lambda: s.counts()["running"] == 1, "the blocker")
            # Queued behind the blocker (one slot), no first token: streamed and not.
            for stream in (True, False):
                before = s.aborted()
                victim = asyncio.create_task(_read_all(c, _body("victim", 20, stream)))
                await asyncio.to_thread(_wait, lambda: s.counts()["waiting"] == 1, "queued")
                victim.cancel()  # closes its connection
                await asyncio.gather(victim, return_exceptions=True)
                await asyncio.to_thread(_wait, lambda: s.counts()["waiting"] == 0, "abort")
                assert not blocker.done(), "the blocker finished first: the test proves nothing"
                assert s.aborted() == before + 1, stream
            blocker.cancel()  # a disconnect mid-stream (test_server.py has 50 of them)
            await asyncio.gather(blocker, return_exceptions=True)
            await asyncio.to_thread(_assert_idle_and_free, s)
            # Non-streamed, after its first tokens: aborted mid-generation.
            before = s.aborted()
            victim = asyncio.create_task(_read_all(c, _body("victim", LONG, False)))

            def generating() -> bool:
                return s.call(lambda e: any(
                    len(q.detok.ids) >= 2 for r in e.core.book.requests.values() for q in r.seqs
                ))  # fmt: skip

            await asyncio.to_thread(_wait, generating, "tokens")
            victim.cancel()
            await asyncio.gather(victim, return_exceptions=True)
            await asyncio.to_thread(_assert_idle_and_free, s)
            assert s.aborted() == before + 1

    asyncio.run(main())


# ------------------------------------------------------------------ faults


@pytest.mark.tier2  # second tier (docs/testing.md): 19 s cold
def test_step_fault_fails_its_batch_only(served):
    s = served

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            hit = asyncio.create_task(_read_all(c, _body("hit", LONG, True)))
            await asyncio.to_thread(_wait, lambda: s.counts()["running"] == 1, "running")
            behind = asyncio.create_task(_read_all(c, _body("behind", 5, False)))
            await asyncio.to_thread(_wait, lambda: s.counts()["waiting"] == 1, "queued")
            open(s.fault_file, "w").close()  # the runner raises at its next call
            status, events = await hit
            assert status == 200  # headers were sent: the error is the stream's last event
            err = events[-1]["error"]
            assert err["code"] == 500 and err["type"] == "InternalServerError"
            assert "engine step failed: InjectedFault" in err["message"]
            status, (body,) = await behind
            assert status == 200 and body["usage"]["completion_tokens"] == 5
            assert (await c.get("/health")).status_code == 200
        await asyncio.to_thread(_assert_idle_and_free, s)

    asyncio.run(main())
    assert not os.path.exists(s.fault_file)


# ------------------------------------------------------------------ limits


def test_queue_bound_503_retry_after(served):
    s = served
    s.engine.max_waiting_requests = 1
    try:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                before = s.scrape("pagedjax:request_rejected_total", reason="queue_full")
                first = asyncio.create_task(_read_all(c, _body("a", 30, False)))
                await asyncio.to_thread(_wait, lambda: s.counts()["running"] == 1, "running")
                second = asyncio.create_task(_read_all(c, _body("b", 3, False)))
                await asyncio.to_thread(_wait, lambda: s.counts()["waiting"] == 1, "queued")
                r = await c.post("/v1/completions", json=_body("c", 3, True))
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                err = r.json()["error"]
                assert err["type"] == "ServiceUnavailableError"
                assert "--max-num-queued-reqs" in err["message"]
                assert [x[0] for x in await asyncio.gather(first, second)] == [200, 200]
                after = s.scrape("pagedjax:request_rejected_total", reason="queue_full")
                assert after == before + 1

        asyncio.run(main())
    finally:
        s.engine.max_waiting_requests = None
    _assert_idle_and_free(s)


def test_request_timeout_504(served):
    s = served
    app = build_app(s.engine, [NAME], limits=ServerLimits(request_timeout_s=0.3))
    untimed = build_app(s.engine, [NAME])

    async def main():
        # The stream's first token must come within 0.3 s: compile this prompt's step
        # programs first, without a timeout (the test is about the timeout, not a cold
        # compile; it would otherwise depend on which test of the module ran before it).
        warm = httpx.ASGITransport(app=untimed)
        async with httpx.AsyncClient(transport=warm, base_url="http://t", timeout=120) as c:
            status, _ = await _read_all(c, _body("slow", 2, True))
            assert status == 200
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            r = await c.post("/v1/completions", json=_body("slow", LONG, False))
            assert r.status_code == 504, r.text
            err = r.json()["error"]
            assert err["type"] == "TimeoutError" and "--request-timeout" in err["message"]
            status, events = await _read_all(c, _body("slow", LONG, True))
            assert status == 200 and events[-1]["error"]["code"] == 504

    asyncio.run(main())
    _assert_idle_and_free(s)


def test_body_and_field_limits(served):
    limits = ServerLimits(max_body_bytes=8192, max_json_depth=8, max_messages=3, max_n=4,
                          max_stop_strings=2, max_stop_string_length=5)  # fmt: skip
    app = build_app(served.engine, [NAME], limits=limits)
    msgs = [{"role": "user", "content": "x"}] * 4
    cases = [
        # (body: dict or bytes, headers, status, param, words in the message)
        ({"prompt": "x" * 9000}, {}, 413, None, "--max-request-body-bytes"),
        (b'{"prompt": "a"}', {"content-type": "text/plain"}, 415, None, "application/json"),
        ({"prompt": "a", "x": [[[[[[[[[1]]]]]]]]]}, {}, 400, None, "--max-json-depth"),
        (b"[" * 2000 + b"]" * 2000, {}, 400, None, "depth"),  # RecursionError inside json
        (b'{"prompt": "a", "temperature": NaN}', {}, 400, None, "NaN"),
        (b'{"prompt": "a", "max_tokens": 1' + b"0" * 4400 + b"}", {}, 400, None, "JSON"),
        (b'{"prompt": "\\ud800"}', {}, 400, None, "surrogate"),
        (b"\xff\xfe{", {}, 400, None, "JSON"),
        (b"", {}, 400, None, "empty"),
        ({"messages": msgs}, {}, 400, "messages", "--max-messages"),
        ({"prompt": "a", "n": 5}, {}, 400, "n", "--max-n"),
        ({"prompt": "a", "stop": ["a", "b", "c"]}, {}, 400, "stop", "--max-stop-strings"),
        ({"prompt": "a", "stop": "abcdef"}, {}, 400, "stop", "--max-stop-string-length"),
        ({"prompt": "a", "logprobs": 21}, {}, 400, "logprobs", "logprobs"),
        ({"messages": msgs[:1], "chat_template": "{{ 1 }}"}, {}, 400, "chat_template",
         "--trust-request-chat-template"),
    ]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            for body, headers, status, param, words in cases:
                chat = isinstance(body, dict) and "messages" in body
                path = "/v1/chat/completions" if chat else "/v1/completions"
                if isinstance(body, bytes):
                    headers = {"content-type": "application/json", **headers}
                    r = await c.post(path, content=body, headers=headers)
                else:
                    r = await c.post(path, json=body, headers=headers)
                err = r.json()["error"]
                assert (r.status_code, err["param"], err["code"]) == (status, param, status), (
                    body[:80], err)  # fmt: skip
                assert words in err["message"], (words, err["message"])
            r = await c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
            assert r.status_code == 200

    asyncio.run(main())
    _assert_idle_and_free(served)


def test_limit_and_shutdown_flags(served):
    """The flags reach ServerLimits (vLLM's names where vLLM has one); bad values exit;
    --trust-request-chat-template lets a request's own template render."""
    from pagedjax.entrypoints.openai import cli_args

    p = cli_args.make_parser()
    args = p.parse_args(["--model", "m"])
    assert (args.max_waiting_requests, args.shutdown_timeout) == (1024, 20.0)
    assert ServerLimits.from_args(args) == ServerLimits()
    args = p.parse_args(["--model", "m", "--max-num-queued-reqs", "256", "--shutdown-timeout",
                         "0", "--request-timeout", "0", "--max-n", "4",
                         "--trust-request-chat-template"])  # fmt: skip
    lim = ServerLimits.from_args(args)
    assert args.max_waiting_requests == 256 and args.shutdown_timeout == 0
    assert lim.request_timeout_s is None and lim.max_n == 4 and lim.trust_request_chat_template
    assert p.parse_args(["--model", "m", "--max-waiting-requests", "7"]).max_waiting_requests == 7
    for bad in (["--max-n", "0"], ["--shutdown-timeout", "-1"], ["--max-engine-restarts", "-1"],
                ["--max-num-queued-reqs", "-1"], ["--max-json-depth", "0"]):
        with pytest.raises(SystemExit):
            cli_args.reject_unbuilt(p.parse_args(["--model", "m", *bad]))
    app = build_app(served.engine, [NAME], limits=lim)
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "chat_template": template})  # fmt: skip
            assert r.status_code == 200, r.text

    asyncio.run(main())
    _assert_idle_and_free(served)
