"""Tool calls, reasoning and structured-output fields through the real HTTP server and
the official ``openai`` client, over a *scripted* engine: an EngineClient whose output
text is fixed by the test (the user message names the script) and arrives a few
characters per step, so tags and JSON are cut across stream deltas. The server code
under test is all of it (request mapping, chat template with tools=, parsers, SSE); only
the model is replaced, because a random tiny model cannot be made to write a tool call
(tests/test_server.py runs the real engine, with structured outputs when it has them).
"""

from __future__ import annotations

import json
import re
import types

import httpx
import openai
import pytest

from pagedjax.engine.outputs import CompletionOutput, RequestOutput
from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.openai.api_server import build_app
from pagedjax.tokenizer import HFTokenizer
from tests.model_helpers import save_tiny_tokenizer
from tests.test_server import _serve

# A template that shows the tools, as Hermes / Qwen templates do.
TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function.name }}"
    " {{ c.function.arguments.city }}]{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SCRIPTS = {
    "hermes": 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
    ' "unit": "c"}}\n</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "plain": "No tool needed: 42.",
    "think": "<think>The user wants 6*7.\nThat is 42.</think>\n\nThe answer is 42.",
    "think-call": '<think>weather needed</think><tool_call>{"name": "get_weather",'
    ' "arguments": {"city": "Rome"}}</tool_call>',
    "required": '[{"name": "get_weather", "parameters": {"city": "Oslo"}},'
    ' {"name": "get_time", "parameters": {}}]',
    "named": '{"city": "Lima", "unit": "f"}',
    "tagged": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "tagged-named": '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "f"}}'
    "\n</tool_call>",
    "llama": '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters":'
    ' {"city": "Kyiv"}}',
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CHUNK = 3  # characters per engine step: tags and JSON are cut across deltas


class ScriptedEngine:
    """An EngineClient that writes SCRIPTS[last user message] CHUNK characters a step
    and remembers each request's prompt and SamplingParams."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.max_model_len = 4096
        self.max_logprobs = 5
        self.arch = types.SimpleNamespace(vocab_size=tokenizer.vocab_size)
        self.num_preemptions = 0
        self.live: dict[str, list] = {}
        self.seen: dict[str, tuple] = {}

    def add_request(self, request_id, prompt, params=None):
        text = prompt["prompt"]
        key = re.findall(r"<\|user\|>([\w-]+)", text)[-1]
        self.seen[request_id] = (text, params)
        self.live[request_id] = [prompt["prompt_token_ids"], SCRIPTS[key], 0, params.n]

    def abort_request(self, request_id):
        for r in [request_id] if isinstance(request_id, str) else request_id:
            self.live.pop(r, None)

    def step(self):
        outs = []
        for rid, st in list(self.live.items()):
            ids, script, sent, n = st
            st[2] = sent = min(sent + CHUNK, len(script))
            done = sent == len(script)
            text = script[:sent]
            toks = list(range(3, 3 + sent))
            outs.append(RequestOutput(rid, None, ids, None, [
                CompletionOutput(i, text, toks, None, None, "stop" if done else None)
                for i in range(n)], finished=done))  # fmt: skip
            if done:
                del self.live[rid]
        return outs

    def has_unfinished_requests(self):
        return bool(self.live)

    def get_num_unfinished_requests(self):
        return len(self.live)

    def request_counts(self):
        n = len(self.live)
        return dict(running=n, waiting=0, swapped=0, slots_in_use=n)

    def stats(self):
        return {}

    def num_free_blocks(self):
        return 0

    def num_usable_blocks(self):
        return 0


def _start(tokenizer, **parsers):
    engine = ScriptedEngine(tokenizer)
    aengine = AsyncLLMEngine(engine)
    server, thread, url = _serve(build_app(aengine, ["scripted"], **parsers))
    return engine, aengine, server, thread, url


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Servers with: hermes; hermes + deepseek_r1; llama3_json; no parsers."""
    d = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(d, TOOLS_TEMPLATE)
    tok = HFTokenizer(d)
    started = [
        _start(tok, enable_auto_tools=True, tool_parser="hermes"),
        _start(tok, enable_auto_tools=True, tool_parser="hermes", reasoning_parser="deepseek_r1"),
        _start(tok, enable_auto_tools=True, tool_parser="llama3_json"),
        _start(tok),
    ]
    yield [(s[0], s[4]) for s in started]
    for _, aengine, server, thread, _ in started:
        server.should_exit = True
        thread.join(30)
        aengine.shutdown()


def _client(url):
    return openai.OpenAI(api_key="x", base_url=url + "/v1", timeout=60, max_retries=0)


def _ask(url, script, stream=False, **kw):
    c = _client(url)
    msgs = [{"role": "user", "content": script}]
    return c.chat.completions.create(model="scripted", messages=msgs, stream=stream, **kw)


def _collect(stream):
    """Reassemble a chat stream: reasoning, content, calls {index: [id, name, args]}, finish."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            extra = d.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index][2] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return reasoning, content, [calls[i][1:] for i in sorted(calls)], finish


def _full(r):
    m = r.choices[0].message
    calls = [[c.function.name, c.function.arguments] for c in m.tool_calls or []]
    return (
        (m.model_extra or {}).get("reasoning") or "",
        m.content or "",
        calls,
        r.choices[0].finish_reason,
    )


def test_auto_tool_calls_hermes_stream_and_not(servers):
    (engine, url), _, _, _ = servers
    kw = dict(tools=[WEATHER, TIME])  # tool_choice defaults to "auto"
    full = _full(_ask(url, "hermes", **kw))
    assert full == (
        "",
        "Let me look. ",
        [["get_weather", '{"city": "Paris", "unit": "c"}'], ["get_time", "{}"]],
        "tool_calls",
    )
    assert _collect(_ask(url, "hermes", stream=True, **kw)) == full
    prompt, params = next(v for v in engine.seen.values() if "hermes" in v[0])
    assert prompt.startswith("<|tools|>get_weather;get_time;")  # the template saw tools=
    assert params.structured_outputs is None  # "auto" does not constrain
    # No call in the output: plain content and the engine's finish reason.
    assert _full(_ask(url, "plain", **kw)) == ("", "No tool needed: 42.", [], "stop")
    # parallel_tool_calls=false keeps the first call (vLLM's filter).
    one = _full(_ask(url, "hermes", parallel_tool_calls=False, **kw))
    assert [c[0] for c in one[2]] == ["get_weather"]


def test_reasoning_stream_and_not(servers):
    _, (_, url), _, _ = servers
    full = _full(_ask(url, "think"))
    assert full == ("The user wants 6*7.\nThat is 42.", "\n\nThe answer is 42.", [], "stop")
    r = _ask(url, "think")
    assert r.choices[0].message.model_extra["reasoning_content"] == full[0]
    assert _collect(_ask(url, "think", stream=True)) == full
    # Reasoning, then a call read from the text after </think>.
    kw = dict(tools=[WEATHER])
    full = _full(_ask(url, "think-call", **kw))
    assert full == ("weather needed", "", [["get_weather", '{"city": "Rome"}']], "tool_calls")
    assert _collect(_ask(url, "think-call", stream=True, **kw)) == full
    # include_reasoning=false drops it (vLLM's extra).
    r = _ask(url, "think", extra_body={"include_reasoning": False})
    assert r.choices[0].message.model_extra["reasoning"] is None


def test_llama3_json_auto(servers):
    _, _, (_, url), _ = servers
    kw = dict(tools=[WEATHER, TIME], tool_choice="auto")
    full = _full(_ask(url, "llama", **kw))
    assert full[2] == [["get_time", "{}"], ["get_weather", '{"city": "Kyiv"}']]
    assert full[3] == "tool_calls" and full[1] == ""
    assert _collect(_ask(url, "llama", stream=True, **kw)) == full


def test_required_and_named_constrain_and_parse(servers):
    """The constraint reaches the engine as StructuredOutputsParams(json=...) (vLLM's
    schemas), and the constrained output is read back as tool_calls."""
    _, _, _, (engine, url) = servers
    kw = dict(tools=[WEATHER, TIME], tool_choice="required")
    full = _full(_ask(url, "required", **kw))
    assert full == (
        "",
        "",
        [["get_weather", '{"city": "Oslo"}'], ["get_time", "{}"]],
        "tool_calls",
    )
    assert _collect(_ask(url, "required", stream=True, **kw)) == full
    _, params = next(v for v in engine.seen.values() if "required" in v[0])
    schema = params.structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = _full(_ask(url, "named", tools=[WEATHER, TIME], tool_choice=named))
    assert full == ("", "", [["get_weather", '{"city": "Lima", "unit": "f"}']], "stop")
    assert json.loads(full[2][0][1]) == {"city": "Lima", "unit": "f"}
    stream = _ask(url, "named", stream=True, tools=[WEATHER, TIME], tool_choice=named)
    assert _collect(stream) == full
    _, params = next(v for v in engine.seen.values() if "named" in v[0])
    assert params.structured_outputs.json == WEATHER["function"]["parameters"]


def _user(prompt: str) -> str:
    return re.findall(r"<\|user\|>([\w-]+)", prompt)[-1]


def test_hermes_required_and_named_use_vllms_structural_tag(servers):
    """With --tool-call-parser hermes (and VLLM_ENFORCE_STRICT_TOOL_CALLING unset, vLLM's
    default) "required" and named calls are constrained by vLLM's hermes structural tag
    and read back by the hermes parser (tool_tags.py), streamed and not."""
    engine, url = servers[0]
    kw = dict(tools=[WEATHER, TIME], tool_choice="required")
    full = _full(_ask(url, "tagged", **kw))
    assert full == (
        "",
        "",
        [["get_weather", '{"city": "Oslo"}'], ["get_time", "{}"]],
        "tool_calls",
    )
    assert _collect(_ask(url, "tagged", stream=True, **kw)) == full
    _, params = next(v for v in engine.seen.values() if _user(v[0]) == "tagged")
    so = params.structured_outputs
    assert so.json is None
    fmt = json.loads(so.structural_tag)["format"]
    assert fmt["type"] == "tags_with_separator" and not fmt["stop_after_first"]
    assert [t["begin"] for t in fmt["tags"]][::2] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "get_time", "arguments": ',
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(tools=[WEATHER, TIME], tool_choice=named)
    full = _full(_ask(url, "tagged-named", **kw))
    assert full == ("", "", [["get_weather", '{"unit": "f"}']], "stop")
    assert _collect(_ask(url, "tagged-named", stream=True, **kw)) == full


def test_structured_fields_reach_sampling_params(servers):
    _, _, _, (engine, url) = servers
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _ask(
        url,
        "plain",
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        max_tokens=50,
        extra_body={
            "min_tokens": 2,
            "logit_bias": {"5": -100},
            "bad_words": ["no"],
            "allowed_token_ids": list(range(3, 100)),
        },
    )
    _, p = list(engine.seen.values())[-1]
    assert p.structured_outputs.json == schema and p.min_tokens == 2
    assert p.logit_bias == {5: -100.0} and p.bad_words == ("no",)
    assert p.allowed_token_ids == tuple(range(3, 100))
    c = _client(url)
    c.completions.create(
        model="scripted",
        prompt="<|user|>plain",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["a", "b"]}},
    )
    _, p = list(engine.seen.values())[-1]
    assert p.structured_outputs.choice == ("a", "b")


def test_tool_errors_are_400_naming_the_field(servers):
    _, _, _, (_, url) = servers
    msgs = [{"role": "user", "content": "plain"}]
    cases = [
        ({"tools": [WEATHER]}, "tool_choice"),  # "auto" without --enable-auto-tool-choice
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": []}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),  # fmt: skip
        ({"guided_json": {"type": "object"}}, "guided_json"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),  # fmt: skip
        ({"logit_bias": {"7": 500}}, "logit_bias"),
    ]
    with httpx.Client(base_url=url, timeout=30) as h:
        for extra, param in cases:
            r = h.post("/v1/chat/completions", json={"messages": msgs, **extra})
            err = r.json()["error"]
            assert (r.status_code, err["type"], err["param"]) == (400, "BadRequestError", param), (
                extra,
                err,
            )
        assert h.post("/v1/chat/completions", json={"messages": msgs}).status_code == 200
