"""The OpenAI server's output parsers and request mapping, without an engine.

Tool-call parsers (hermes, llama3_json, required, named) and reasoning parsers
(deepseek_r1, qwen3): known outputs give vLLM's answer, and -- the property the
streaming path rests on -- any split of an output into deltas, streamed through
``ChoiceStream``, adds up to the non-streamed message (reasoning, content, each call's
name and arguments), tags cut anywhere included. Request mapping: response_format,
structured_outputs, the removed guided_* extras, logit controls and tools become
SamplingParams fields or 400s naming the field; the flags parse and refuse by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.entrypoints.openai import cli_args
from pagedjax.entrypoints.openai.chat_output import (
    ChatExtras,
    OutputRules,
    build_rules,
    prepare_chat,
)
from pagedjax.entrypoints.openai.protocol import OpenAIError, parse_chat
from pagedjax.entrypoints.openai.reasoning import (
    Qwen3ReasoningParser,
    ThinkReasoningParser,
    reasoning_ended_ids,
)
from pagedjax.entrypoints.openai.structured import parse_constraints
from pagedjax.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedFunctionParser,
    RequiredParser,
)
from pagedjax.entrypoints.openai.tool_parsers.json_scan import scan_object, value_end
from pagedjax.entrypoints.openai.tools import ToolRequest, parse_tools, tool_schema
from pagedjax.sampling import SamplingParams

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": None}}


def _rules(mode="none", tools=None, reasoning=None, parallel=True) -> OutputRules:
    return OutputRules(
        reasoning=reasoning,
        report_reasoning=reasoning is not None,
        tools=tools,
        mode=mode,
        parallel=parallel,
    )


def _stream(rules: OutputRules, text: str, cuts: list[int], reason="stop") -> dict:
    """Stream ``text`` cut at ``cuts`` and reassemble the deltas into a message."""
    s = rules.stream()
    bounds = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    got = {"reasoning": "", "content": "", "calls": []}
    finish = None
    for k, end in enumerate(bounds):
        final = k == len(bounds) - 1
        d = s.delta(text[:end], final)
        got["reasoning"] += d.get("reasoning", "")
        assert d.get("reasoning") == d.get("reasoning_content")
        got["content"] += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(got["calls"]):
                assert tc["id"].startswith("chatcmpl-tool-") and tc["type"] == "function"
                got["calls"].append([tc["function"]["name"], tc["function"]["arguments"]])
            else:
                assert "name" not in tc["function"]
                got["calls"][tc["index"]][1] += tc["function"]["arguments"]
        finish = s.finish_reason(reason if final else None)
    got["finish"] = finish
    return got


def _full(rules: OutputRules, text: str, reason="stop") -> dict:
    msg, finish = rules.message("assistant", text, reason)
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in msg.get("tool_calls", [])]
    return {
        "reasoning": msg.get("reasoning") or "",
        "content": msg["content"] or "",
        "calls": calls,
        "finish": finish,
    }


def _check_split_property(rules: OutputRules, text: str, cuts: list[int]) -> dict:
    full = _full(rules, text)
    assert _stream(rules, text, cuts) == full
    return full


# ------------------------------------------------------------------ json scanning


def test_json_scan_spans_and_partial_values():
    text = '{"name": "f", "arguments": {"a": [1, "}"], "b": "x\\"y"}, "n": 12}'
    obj = scan_object(text, 0, final=True)
    assert obj.end == len(text) and not obj.error
    args = obj.get("arguments")
    assert json.loads(text[args.start : args.end]) == {"a": [1, "}"], "b": 'x"y'}
    assert text[obj.get("n").start : obj.get("n").end] == "12"
    assert value_end("123", 0) is None and value_end("123", 0, final=True) == 3
    partial = scan_object('{"name": "f", "arguments": {"a": "}', 0)
    assert partial.end is None and partial.get("arguments").end is None
    assert scan_object("[1]", 0).error and scan_object('{"a" 1}', 0).error


# ------------------------------------------------------------------ tool parsers

HERMES_OUT = (
    'I will check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    '\n</tool_call>\n<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
)


def test_hermes_known_outputs():
    r = _rules("auto", HermesToolParser())
    full = _check_split_property(r, HERMES_OUT, [3, 20, 31, 40, 70, 100])
    assert full == {
        "reasoning": "",
        "content": "I will check. ",
        "finish": "tool_calls",
        "calls": [["get_weather", '{"city": "Paris"}'], ["get_time", "{}"]],
    }
    assert json.loads(full["calls"][0][1]) == {"city": "Paris"}
    # No call: all content, finish_reason kept; broken JSON: the whole text is content.
    assert _full(r, "just text") == {
        "reasoning": "",
        "content": "just text",
        "calls": [],
        "finish": "stop",
    }
    bad = "x <tool_call>{not json}</tool_call>"
    assert _full(r, bad)["content"] == bad and _full(r, bad)["calls"] == []
    # parallel_tool_calls=false keeps the first call.
    one = _rules("auto", HermesToolParser(), parallel=False)
    assert [c[0] for c in _check_split_property(one, HERMES_OUT, [50])["calls"]] == ["get_weather"]


def test_llama3_json_known_outputs():
    r = _rules("auto", Llama3JsonToolParser())
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}};'
        ' {"name": "get_time", "arguments": {}}'
    )
    full = _check_split_property(r, text, [1, 5, 14, 15, 40, 77, 80])
    assert full["calls"] == [["get_weather", '{"city": "Oslo", "unit": "c"}'], ["get_time", "{}"]]
    assert full["content"] == "" and full["finish"] == "tool_calls"
    no_tag = '{"name": "get_time", "parameters": {}}'
    assert _check_split_property(r, no_tag, [1])["calls"] == [["get_time", "{}"]]
    assert _full(r, "Hello {there}")["content"] == "Hello {there}"
    # Plain text after the calls is dropped (vLLM 0.32); a cut-off object is content.
    assert _full(r, '{"name": "f", "parameters": {}} trailing')["calls"] == [["f", "{}"]]
    assert _full(r, '{"name": "f", "parameters": {')["calls"] == []


def test_required_and_named_outputs():
    req = _rules("required", RequiredParser())
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Rome"}},'
        ' {"name": "get_time", "parameters": {}}]'
    )
    full = _check_split_property(req, text, [2, 10, 30, 55, 60])
    assert full["calls"] == [["get_weather", '{"city": "Rome"}'], ["get_time", "{}"]]
    assert full["finish"] == "tool_calls" and full["content"] == ""
    assert _full(req, "not an array")["calls"] == []  # unconstrained engine: content
    assert _full(req, "[]")["calls"] == []
    named = _rules("named", NamedFunctionParser("get_weather"))
    full = _check_split_property(named, '{"city": "Lima"}', [4])
    assert full["calls"] == [["get_weather", '{"city": "Lima"}']] and full["finish"] == "stop"


# ------------------------------------------------------------------ reasoning


def test_reasoning_parsers_known_outputs():
    r1 = ThinkReasoningParser()
    assert r1.split("<think>hmm</think>Answer", True) == ("hmm", "Answer")
    assert r1.split("hmm</think>\n\nAnswer", True) == ("hmm", "\n\nAnswer")  # <think> in prompt
    assert r1.split("still thinking", True) == ("still thinking", None)
    assert r1.split("<thi", False) == ("", None) and r1.split("abc</th", False) == ("abc", None)
    assert r1.reasoning_ended_in("<|assistant|><think>\n\n</think>\n\n")
    assert not r1.reasoning_ended_in("<|assistant|><think>\n")
    q = Qwen3ReasoningParser()
    assert q.thinking(None) and not q.thinking({"enable_thinking": False})
    rules = _rules(reasoning=r1)
    full = _check_split_property(rules, "<think>a < b</think>The answer", [3, 9, 14, 17, 20])
    assert full == {"reasoning": "a < b", "content": "The answer", "calls": [], "finish": "stop"}
    msg, _ = rules.message("assistant", "only thinking", "length")
    assert (
        msg["content"] is None and msg["reasoning"] == msg["reasoning_content"] == "only thinking"
    )
    # Reasoning then a hermes call: the call is read from the text after </think>.
    both = _rules("auto", HermesToolParser(), reasoning=r1)
    text = "<think>need weather</think>" + HERMES_OUT
    full = _check_split_property(both, text, [5, 26, 27, 40])
    assert full["reasoning"] == "need weather" and len(full["calls"]) == 2
    # The engine's token-level rule.
    assert reasoning_ended_ids([5, 1, 7, 2, 9], [1], [2]) and not reasoning_ended_ids(
        [2, 1], [1], [2]
    )
    assert reasoning_ended_ids([3, 4, 8, 8], [3, 5], [4, 8])


def _texts():
    """Outputs that mix reasoning, content, tag fragments and well-formed calls."""
    word = st.text(alphabet='ab <>/{}":;,[]_\\\n', max_size=8)
    args = st.dictionaries(
        st.sampled_from(["city", "n", "q"]),
        st.one_of(st.integers(-50, 50), st.text(max_size=5), st.lists(st.booleans(), max_size=2)),
        max_size=3,
    )
    call = st.tuples(st.sampled_from(["get_weather", "get_time"]), args)
    return st.tuples(st.booleans(), word, word, st.lists(call, max_size=3), st.booleans())


def _render(think: bool, reasoning: str, content: str, calls: list, fmt: str, spaced: bool):
    sep = " " if spaced else ""
    prefix = f"<think>{reasoning.replace('<', '(')}</think>" if think else ""
    content = content.replace("<", "(")
    if fmt == "hermes":
        body = "".join(
            f"<tool_call>{sep}{json.dumps({'name': n, 'arguments': a})}{sep}</tool_call>"
            for n, a in calls
        )
        return prefix + content + body
    if fmt == "llama3_json":
        if not calls:
            return prefix + "x" + content
        return (
            prefix
            + "<|python_tag|>"
            + f";{sep}".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
        )
    return prefix + json.dumps([{"name": n, "parameters": a} for n, a in calls])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "required"])
@settings(max_examples=100)  # x3 formats: ~4 s on 2 loaded cores
@given(parts=_texts(), cuts=st.lists(st.integers(0, 400), max_size=12), use_r=st.booleans())
def test_any_split_into_deltas_gives_the_full_parse(fmt, parts, cuts, use_r):
    """Property: the streamed deltas of any split add up to the non-streamed message."""
    think, reasoning, content, calls, spaced = parts
    parser = {
        "hermes": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
        "required": RequiredParser,
    }[fmt]()
    rules = _rules(
        "required" if fmt == "required" else "auto",
        parser,
        ThinkReasoningParser() if use_r else None,
    )
    text = _render(think and use_r, reasoning, content, calls, fmt, spaced)
    full = _check_split_property(rules, text, cuts)
    if calls and (think or not use_r):  # reasoning never closed: all of it is reasoning
        assert [(n, json.loads(a)) for n, a in full["calls"]] == [tuple(c) for c in calls]


_PIECES = ["<think>", "</think>", "<", "</", "<th", "ink>", "a", " ", "\n", "{", "}", '"']


@given(
    pieces=st.lists(st.sampled_from(_PIECES), max_size=12),
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_any_split_of_any_text_reasoning_only(pieces, cuts):
    """Without tools the property holds for every text, tags cut anywhere."""
    text = "".join(pieces)
    _check_split_property(_rules(reasoning=ThinkReasoningParser()), text, cuts)
    _check_split_property(_rules(), text, cuts)


# ------------------------------------------------------------------ request mapping

VOCAB = 300


def _constraints(**body):
    return parse_constraints(body, VOCAB)


def _bad(fn, *args, **kwargs) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        fn(*args, **kwargs)
    assert e.value.status == 400
    return e.value


def test_response_format_and_structured_outputs_mapping():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    so = _constraints(response_format=rf)["structured_outputs"]
    assert so.json == schema and so.kind == "json"
    assert _constraints(response_format={"type": "json_object"})["structured_outputs"].json_object
    assert _constraints(response_format={"type": "text"}) == {}
    so = _constraints(structured_outputs={"choice": ["yes", "no"], "disable_any_whitespace": True})
    assert so["structured_outputs"].choice == ("yes", "no")
    # response_format replaces the kind and keeps structured_outputs' options (vLLM's rule).
    merged = _constraints(
        response_format={"type": "json_object"}, structured_outputs={"disable_any_whitespace": True}
    )["structured_outputs"]
    assert merged.json_object and merged.disable_any_whitespace
    params = SamplingParams(**_constraints(structured_outputs={"regex": "[0-9]+"}))
    assert params.structured_outputs.regex == "[0-9]+"
    for body, param in [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": "regex"}, "structured_outputs"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_choice": ["a"]}, "guided_choice"),
    ]:
        assert _bad(_constraints, **body).param == param, body


def test_logit_controls_mapping():
    kw = _constraints(
        min_tokens=3,
        logit_bias={"5": 10, "7": -100},
        allowed_token_ids=[1, 2],
        bad_words=["foo bar"],
    )
    assert kw == {
        "min_tokens": 3,
        "logit_bias": {5: 10.0, 7: -100.0},
        "allowed_token_ids": [1, 2],
        "bad_words": ["foo bar"],
    }
    p = SamplingParams(max_tokens=8, **kw)
    assert p.logit_bias == {5: 10.0, 7: -100.0} and p.bad_words == ("foo bar",)
    assert _constraints(logit_bias={}, bad_words=[], min_tokens=0) == {}
    for body, param in [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
        ({"bad_words": "x"}, "bad_words"),
        ({"bad_words": [""]}, "bad_words"),
        ({"min_tokens": -1}, "min_tokens"),
    ]:
        assert _bad(_constraints, **body).param == param, body


def test_tools_mapping_and_schemas():
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_tools({"messages": msgs}).choice == "none"
    assert parse_tools({"tools": [WEATHER]}).choice == "auto"  # vLLM's default with tools
    named = parse_tools(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        }
    )
    assert (named.choice, named.function) == ("named", "get_time")
    # no parameters schema: still a JSON object (vLLM 0.32's _params_or_empty_object)
    assert tool_schema(named) == {"type": "object", "properties": {}}
    w = ToolRequest([WEATHER], "named", "get_weather")
    assert tool_schema(w) == WEATHER["function"]["parameters"]
    defs_tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/P"}},
                "$defs": {"P": {"type": "integer"}},
            },
        },
    }
    schema = tool_schema(parse_tools({"tools": [WEATHER, defs_tool], "tool_choice": "required"}))
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["$defs"] == {"P": {"type": "integer"}}
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["get_weather"], ["f"]]
    assert "$defs" in defs_tool["function"]["parameters"]  # the request is not mutated
    assert "maxItems" not in schema
    # vLLM's get_json_schema_from_tools(parallel_tool_calls=False): at most one call; a
    # tool without parameters is an empty object in its branch too
    one = tool_schema(
        parse_tools({"tools": [TIME], "tool_choice": "required", "parallel_tool_calls": False})
    )
    assert one == {
        "type": "array",
        "minItems": 1,
        "maxItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                }
            ],
        },
    }
    for body, param in [
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]:
        assert _bad(parse_tools, body).param == param, body


def _prepare(body, auto_tools=False):
    parsed = parse_chat(body, vocab_size=VOCAB, max_logprobs=5)
    parsed.params_kwargs.update(parse_constraints(body, VOCAB))
    return parsed, prepare_chat(body, parsed, auto_tools=auto_tools)


def test_prepare_chat_constraints_and_auto_rule():
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    parsed, extras = _prepare({"messages": msgs, "tools": [WEATHER], "tool_choice": "required"})
    so = parsed.params_kwargs["structured_outputs"]
    assert so.json["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    assert extras.template_kwargs["tools"][0]["function"]["name"] == "get_weather"
    assert parsed.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert parsed.messages[2]["tool_call_id"] == "c1"
    e = _bad(_prepare, {"messages": msgs[:1], "tools": [WEATHER]})  # auto without the flag
    assert e.param == "tool_choice" and "--enable-auto-tool-choice" in e.message
    _, extras = _prepare({"messages": msgs[:1], "tools": [WEATHER]}, auto_tools=True)
    rules = build_rules(extras, tool_parser="hermes", reasoning_parser=None, prompt="")
    assert isinstance(rules.tools, HermesToolParser) and rules.mode == "auto"
    e = _bad(
        _prepare,
        {
            "messages": msgs[:1],
            "tools": [WEATHER],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
    )
    assert e.param == "tool_choice"
    _, extras = _prepare({"messages": msgs[:1], "chat_template_kwargs": {"enable_thinking": False}})
    rules = build_rules(extras, tool_parser=None, reasoning_parser="qwen3", prompt="")
    assert rules.reasoning is None and rules.report_reasoning  # thinking off: all content
    _, extras = _prepare({"messages": msgs[:1], "reasoning_effort": "none"})
    assert extras.template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    rules = build_rules(extras, tool_parser=None, reasoning_parser="qwen3", prompt="")
    assert rules.reasoning is None  # vLLM 0.32: reasoning_effort "none" turns thinking off
    assert _bad(_prepare, {"messages": msgs[:1], "reasoning_effort": "huge"}).param == (
        "reasoning_effort"
    )
    rules = build_rules(
        ChatExtras(extras.tools, {}, True),
        tool_parser=None,
        reasoning_parser="deepseek_r1",
        prompt="<think>\n",
    )
    assert isinstance(rules.reasoning, ThinkReasoningParser)


def test_output_flags():
    p = cli_args.make_parser()
    args = p.parse_args(
        [
            "--model",
            "m",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
            "--structured-outputs-config",
            '{"backend": "xgrammar", "enable_in_reasoning": false}',
        ]
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser) == (
        True,
        "hermes",
        "qwen3",
    )
    assert args.structured_outputs_config == {"backend": "xgrammar", "enable_in_reasoning": False}
    jf = p.parse_args(["--model", "m", "--structured-outputs-config", '{"jump_forward": true}'])
    assert jf.structured_outputs_config == {"jump_forward": True}
    for bad_cfg in ('{"backend": "magic"}', '{"nope": 1}', '{"disable_fallback": "yes"}', "[1]",
                    '{"jump_forward": 1}'):  # fmt: skip
        with pytest.raises(SystemExit):
            p.parse_args(["--model", "m", "--structured-outputs-config", bad_cfg])
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--tool-call-parser", "mistral"])
    with pytest.raises(SystemExit, match="needs --tool-call-parser"):
        cli_args.reject_unbuilt(p.parse_args(["--model", "m", "--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--model", "m", "--tool-parser-plugin", "x.py"])
    assert e.value.code == 2


def test_hermes_structural_tag_equals_vllms():
    """tool_structural_tag gives what vLLM 0.32's hermes parser sets (its adjust_request,
    recorded by tests/data/make_vllm032_hermes_tool_tags.py): strict and non-strict tools,
    required / named / auto, parallel_tool_calls unset / false, with and without a
    response_format; where vLLM joins a tag and the user's constraint (OrFormat), a 400."""
    from pagedjax.entrypoints.openai.tool_tags import tool_structural_tag

    data = Path(__file__).parent / "data" / "vllm032_hermes_tool_tags.json"
    cases = json.loads(data.read_text())
    assert len(cases) == 24
    for case in cases:
        body, want = case["body"], (case["result"] or {}).get("structural_tag")
        req = parse_tools(body)
        user = "response_format" in body
        if want is not None and want["format"]["type"] == "or":
            with pytest.raises(OpenAIError, match="strict tool"):
                tool_structural_tag("hermes", req, user_constraint=user)
            continue
        assert tool_structural_tag("hermes", req, user_constraint=user) == want, body
        assert tool_structural_tag("llama3_json", req, user_constraint=user) is None


def test_strict_tool_calling_reads_vllms_variable():
    from pagedjax.entrypoints.openai.tool_tags import STRICT_ENV, strict_tool_calling

    assert strict_tool_calling({})  # vLLM's default: on
    assert strict_tool_calling({STRICT_ENV: "1"}) and strict_tool_calling({STRICT_ENV: "TRUE"})
    assert not strict_tool_calling({STRICT_ENV: "0"})
    assert not strict_tool_calling({STRICT_ENV: "false"})
