"""A Hypothesis fuzz of malformed requests (issue 32): each answer is a 4xx in OpenAI's
error shape, none a 5xx, and the server serves a valid request afterwards.

At least 1,000 generated requests per CI run (tier2; more under
PAGEDJAX_HYPOTHESIS_PROFILE=long) go through the app in this process
(``httpx.ASGITransport``: the whole middleware, routing, body reading, limits and
validation, without sockets); a sample of 100 goes through a live uvicorn socket in the
default tier. Kinds: a valid body with one
field given a wrong type, a number out of range (huge, negative, NaN / Infinity, a
4,301-digit integer), invalid UTF-8, lone surrogate escapes, deep nesting, bodies that
are not JSON objects, truncated JSON, empty bodies, wrong content types, missing required
fields, malformed messages; unknown fields are sprinkled over all of them (alone they are
accepted, as vLLM does, so they never make a case by themselves).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedjax import LLM
from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.openai.api_server import build_app

NAME = "tiny-llama"
MIN_EXAMPLES = 1000
COUNT = {"asgi": 0, "live": 0}

# Per field: values of a wrong type or out of range (each alone makes a body invalid).
_NOT_INT = st.one_of(st.text(max_size=5), st.booleans(), st.floats(allow_nan=False),
                     st.lists(st.integers(), max_size=2), st.just({}))  # fmt: skip
_NEG_OR_HUGE = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63))
BAD_FIELDS: dict[str, st.SearchStrategy] = {
    "max_tokens": st.one_of(_NOT_INT, st.integers(max_value=0), st.integers(min_value=10**6)),
    "n": st.one_of(_NOT_INT, st.integers(max_value=0), st.integers(min_value=129)),
    "temperature": st.one_of(st.text(max_size=3), st.booleans(),
                             st.floats(min_value=2.0001, allow_infinity=False),
                             st.floats(max_value=-0.0001, allow_infinity=False)),  # fmt: skip
    "top_p": st.one_of(st.text(max_size=3), st.floats(min_value=1.0001, allow_infinity=False),
                       st.floats(max_value=0.0, allow_infinity=False)),  # fmt: skip
    "top_k": st.one_of(st.text(max_size=3), st.integers(max_value=-2), st.floats(0.5, 0.6)),
    "seed": st.one_of(st.text(max_size=3), _NEG_OR_HUGE),
    "presence_penalty": st.one_of(st.text(max_size=3), st.floats(min_value=2.01, max_value=1e300)),
    "frequency_penalty": st.one_of(st.lists(st.none(), max_size=2),
                                   st.floats(max_value=-2.01, min_value=-1e300)),  # fmt: skip
    "stop": st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=3),
                      st.just([""]), st.lists(st.text(min_size=1), min_size=65, max_size=70)),
    "stream": st.one_of(st.text(max_size=3), st.integers()),
    "stop_token_ids": st.one_of(st.text(max_size=3), st.lists(st.text(), min_size=1, max_size=3),
                                st.lists(st.integers(max_value=-1), min_size=1, max_size=3)),
    "logprobs": st.one_of(st.text(max_size=3), st.integers(min_value=21),
                          st.integers(max_value=-1)),
    "model": st.one_of(st.integers(), st.text(min_size=1, max_size=8).filter(lambda s: s != NAME)),
    "stream_options": st.one_of(st.integers(), st.just({"include_usage": "yes"})),
}  # fmt: skip
COMPLETION_ONLY = {"logprobs"}
CHAT_BAD = {
    "messages": st.one_of(
        st.just([]), st.text(max_size=5), st.integers(),
        st.lists(st.integers(), min_size=1, max_size=3),
        st.lists(st.fixed_dictionaries({"role": st.text(max_size=6).filter(
            lambda r: r not in ("system", "developer", "user", "assistant", "tool")),
            "content": st.text(max_size=5)}), min_size=1, max_size=3),
        st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
            st.integers(), st.lists(st.integers(), min_size=1, max_size=2))}),
            min_size=1, max_size=3),
    ),
    "top_logprobs": st.one_of(st.integers(min_value=21), st.text(max_size=3)),
    "max_completion_tokens": st.one_of(_NOT_INT, st.integers(max_value=0)),
}  # fmt: skip
UNKNOWN = st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in BAD_FIELDS
                          and k not in CHAT_BAD and k not in ("prompt", "messages")),
                          st.one_of(st.integers(), st.text(max_size=5), st.none()),
                          max_size=3)  # fmt: skip
PATHS = ("/v1/completions", "/v1/chat/completions")
JSON_CT = {"content-type": "application/json"}


def _valid(path: str) -> dict:
    if path == "/v1/completions":
        return {"prompt": "hi", "max_tokens": 2}
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@st.composite
def malformed(draw) -> tuple[str, bytes, dict]:
    """(path, raw body, headers) of a request that must be refused with a 4xx."""
    path = draw(st.sampled_from(PATHS + ("/tokenize", "/detokenize")))
    kind = draw(st.sampled_from(["field", "field", "field", "number", "utf8", "surrogate",
                                 "deep", "not_object", "truncated", "empty", "content_type",
                                 "missing"]))  # fmt: skip
    if path in ("/tokenize", "/detokenize") and kind in ("field", "number", "missing"):
        body = {"tokens": draw(st.one_of(st.text(max_size=3), st.lists(
            st.one_of(st.integers(max_value=-1), st.integers(min_value=10**6), st.text()),
            min_size=1, max_size=3)))} if path == "/detokenize" else {"add_special_tokens": 1}
        return path, json.dumps(body).encode(), JSON_CT
    chat = path.endswith("chat/completions")
    body = _valid(path)
    body.update(draw(UNKNOWN))
    if kind == "field":
        fields = {**BAD_FIELDS, **CHAT_BAD} if chat else BAD_FIELDS
        fields = {k: v for k, v in fields.items() if not (chat and k in COMPLETION_ONLY)}
        name = draw(st.sampled_from(sorted(fields)))
        body[name] = draw(fields[name])
        if name == "stream_options":
            body["stream"] = True
        if name == "top_logprobs":
            body["logprobs"] = True
        return path, json.dumps(body).encode(), JSON_CT
    if kind == "number":
        name = draw(st.sampled_from(["max_tokens", "n", "temperature", "top_p", "seed"]))
        token = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400",
                                      "1" + "0" * 4300, "-" + "9" * 30]))  # fmt: skip
        raw = json.dumps({**body, name: 0}).replace(f'"{name}": 0', f'"{name}": {token}')
        return path, raw.encode(), JSON_CT
    if kind == "utf8":
        raw = json.dumps(body).encode()
        cut = draw(st.integers(0, len(raw)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80"]))
        return path, raw[:cut] + bad + raw[cut:], JSON_CT
    if kind == "surrogate":
        raw = json.dumps(body)  # the prompt / message "hi" with a lone surrogate escape
        return path, raw.replace('"hi"', '"h\\ud800i"', 1).encode(), JSON_CT
    if kind == "deep":
        depth = draw(st.integers(65, 3000))
        nest = draw(st.sampled_from(["[]", "{}"]))
        inner = "[" * depth + "]" * depth if nest == "[]" else '{"a":' * depth + "1" + "}" * depth
        raw = json.dumps(body)[:-1] + f', "deep": {inner}}}'
        return path, raw.encode(), JSON_CT
    if kind == "not_object":
        value = draw(st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=5),
                               st.integers(), st.none(), st.booleans()))  # fmt: skip
        return path, json.dumps(value).encode(), JSON_CT
    if kind == "truncated":
        raw = json.dumps(body).encode()
        return path, raw[: draw(st.integers(1, len(raw) - 1))], JSON_CT
    if kind == "empty":
        return path, draw(st.sampled_from([b"", b" ", b"\n\t"])), JSON_CT
    if kind == "content_type":
        ct = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/xml",
                                   "image/png"]))  # fmt: skip
        return path, json.dumps(body).encode(), {"content-type": ct}
    del body["prompt" if not chat else "messages"]  # missing
    return path, json.dumps(body).encode(), JSON_CT


def _check(r: httpx.Response, case) -> None:
    assert 400 <= r.status_code < 500, (case, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == r.status_code and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"].endswith("Error")


@pytest.fixture(scope="module")
def app_engine():
    llm = LLM(NAME, max_model_len=64, num_gpu_blocks_override=32, block_size=8,
              max_num_seqs=2, max_num_batched_tokens=32, warmup="none")  # fmt: skip
    engine = AsyncLLMEngine.from_llm(llm)
    yield build_app(engine, [NAME]), engine
    engine.shutdown()


def _examples() -> int:
    return max(MIN_EXAMPLES, settings.default.max_examples)


@pytest.mark.tier2  # about 6 s on a quiet machine, 21 s at load 10 on 2 cores
def test_fuzz_malformed_requests_asgi(app_engine):
    app, engine = app_engine
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    t0 = time.perf_counter()

    @settings(max_examples=_examples(), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(malformed())
    def one(case):
        path, raw, headers = case
        r = loop.run_until_complete(client.post(path, content=raw, headers=headers))
        COUNT["asgi"] += 1
        _check(r, case)

    try:
        one()
        # Alive: a valid request and /health afterwards, nothing left in the engine.
        r = loop.run_until_complete(client.post("/v1/completions", json=_valid("/v1/completions")))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert loop.run_until_complete(client.get("/health")).status_code == 200
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    assert COUNT["asgi"] >= MIN_EXAMPLES
    print(f"fuzz: {COUNT['asgi']} malformed requests in {time.perf_counter() - t0:.1f} s")
    assert engine.engine.get_num_unfinished_requests() == 0


@pytest.mark.tier2  # second tier (docs/testing.md): 21 s cold; test_server_robust stays
def test_fuzz_live_socket_sample(app_engine):
    """A smaller sample through uvicorn's HTTP parser and a real socket."""
    import uvicorn

    app, engine = app_engine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as c:

            @settings(max_examples=100, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(malformed())
            def one(case):
                path, raw, headers = case
                COUNT["live"] += 1
                _check(c.post(path, content=raw, headers=headers), case)

            one()
            r = c.post("/v1/completions", json=_valid("/v1/completions"))
            assert r.status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(30)
    assert COUNT["live"] >= 100
