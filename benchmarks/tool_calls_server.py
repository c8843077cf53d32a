"""Tool calls from a real model through the OpenAI server (issue 33's acceptance line:
"the official openai client gets valid tool_calls for tool_choice='required' and for a
named function on every request of the set, streaming and not").

    PYTHONPATH=. python benchmarks/tool_calls_server.py [--model DIR] [--quick]

Serves ``--model`` (default: SmolLM2-135M-Instruct in float32, the directory
benchmarks/serve_vs_vllm.py makes) in this process, then sends, for each of TOOLS, a
named-function request and a "required" request (that tool and the next one), each
streamed and not, with the official ``openai`` client, greedy. A call is valid when its
name is one of the request's tools and its arguments parse as JSON and follow the tool's
schema (``valid()`` below: the keywords TOOLS use). Prints one row per request kind and,
last, ``valid_tool_call_share: X`` over all requests.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = Path.home() / ".cache" / "pagedjax" / "bench_models" / "smollm2-135m-f32"


def _fn(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


_OBJ = {"type": "object", "additionalProperties": False}
TOOLS = [
    _fn(
        "get_weather",
        {
            **_OBJ,
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    ),
    _fn(
        "add",
        {
            **_OBJ,
            "properties": {
                "a": {"type": "integer", "minimum": -100, "maximum": 100},
                "b": {"type": "integer", "minimum": -100, "maximum": 100},
            },
            "required": ["a", "b"],
        },
    ),
    _fn(
        "set_alarm",
        {
            **_OBJ,
            "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "am": {"type": "boolean"},
            },
            "required": ["hour", "am"],
        },
    ),
    _fn(
        "tag",
        {
            **_OBJ,
            "properties": {
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
            },
            "required": ["tags"],
        },
    ),
    _fn(
        "move",
        {
            **_OBJ,
            "properties": {"to": {"$ref": "#/$defs/point"}},
            "required": ["to"],
            "$defs": {
                "point": {
                    **_OBJ,
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                }
            },
        },
    ),
    _fn("beep", {**_OBJ, "properties": {}}),
    _fn(
        "rate",
        {
            **_OBJ,
            "properties": {
                "stars": {"enum": [1, 2, 3, 4, 5]},
                "note": {"type": "string", "maxLength": 12},
            },
            "required": ["stars"],
        },
    ),
    _fn(
        "lookup",
        {
            **_OBJ,
            "properties": {"id": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["id"],
        },
    ),
    _fn("toggle", {**_OBJ, "properties": {"on": {"type": "boolean"}}, "required": ["on"]}),
    _fn(
        "order",
        {
            **_OBJ,
            "properties": {
                "item": {"enum": ["tea", "cake"]},
                "count": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["item", "count"],
        },
    ),
]
PROMPTS = {
    "get_weather": "What is the weather in Paris in celsius?",
    "add": "Add 3 and 4.",
    "set_alarm": "Wake me at 7 in the morning.",
    "tag": "Tag this post with a and c.",
    "move": "Move the robot to (2, 5).",
    "beep": "Make a beep.",
    "rate": "Give it four stars.",
    "lookup": "Look up record 042.",
    "toggle": "Turn the light on.",
    "order": "Order two cakes.",
}


def valid(value: Any, schema: dict, root: dict) -> bool:
    """The JSON-schema keywords TOOLS use: type, enum, properties, required,
    additionalProperties false, items, maxItems, minimum / maximum, maxLength, $ref."""
    import re

    if "$ref" in schema:
        return valid(value, root["$defs"][schema["$ref"].split("/")[-1]], root)
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return False
    if kind in types and not isinstance(value, types[kind]):
        return False
    if isinstance(value, int) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            return False
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)):
            return False
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return False
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            return False
        return all(valid(v, schema.get("items", {}), root) for v in value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(valid(v, props[k], root) for k, v in value.items() if k in props)
    return True


def check(calls: list[tuple[str, str]], tools: list[dict]) -> bool:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if not calls:
        return False
    for name, args in calls:
        if name not in by_name:
            return False
        try:
            value = json.loads(args)
        except ValueError:
            return False
        if not valid(value, by_name[name], by_name[name]):
            return False
    return True


def run_one(client, kind: str, i: int, stream: bool, max_tokens: int) -> dict:
    tool = TOOLS[i]
    name = tool["function"]["name"]
    tools = [tool] if kind == "named" else [tool, TOOLS[(i + 1) % len(TOOLS)]]
    choice = {"type": "function", "function": {"name": name}} if kind == "named" else "required"
    messages = [{"role": "user", "content": PROMPTS[name]}]
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="m", messages=messages, tools=tools,
                                       tool_choice=choice, temperature=0,
                                       max_tokens=max_tokens, stream=stream)  # fmt: skip
    calls: dict[int, list[str]] = {}
    finish = None
    if stream:
        for chunk in r:
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    calls.setdefault(tc.index, [tc.function.name or "", ""])
                    calls[tc.index][1] += tc.function.arguments or ""
                finish = ch.finish_reason or finish
        got = [tuple(calls[k]) for k in sorted(calls)]
    else:
        m = r.choices[0].message
        got = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        finish = r.choices[0].finish_reason
    want = "stop" if kind == "named" else "tool_calls"
    ok = finish == want and check(got, tools)
    return dict(kind=kind, tool=name, stream=stream, ok=ok, finish=finish, calls=got,
                seconds=time.perf_counter() - t0)  # fmt: skip


def serve(model: str, max_model_len: int, structured: dict | None):
    import uvicorn

    from pagedjax import LLM
    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.api_server import build_app

    extra = {"structured_outputs_config": structured} if structured else {}
    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, seed=0, **extra)
    engine = AsyncLLMEngine.from_llm(llm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, ["m"]), host="127.0.0.1",
                                           port=port, log_level="warning"))  # fmt: skip
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, engine, f"http://127.0.0.1:{port}/v1"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="the first 3 tools only")
    ap.add_argument(
        "--structured-outputs-config",
        type=json.loads,
        default=None,
        help="the server flag's JSON, e.g. '{\"disable_any_whitespace\": true}'",
    )
    args = ap.parse_args()
    from openai import OpenAI

    t0 = time.perf_counter()
    server, engine, url = serve(args.model, args.max_model_len, args.structured_outputs_config)
    print(f"server up in {time.perf_counter() - t0:.1f} s")
    client = OpenAI(api_key="x", base_url=url, timeout=1800, max_retries=0)
    n = 3 if args.quick else len(TOOLS)
    jobs = [(k, i, s) for k in ("named", "required") for i in range(n) for s in (False, True)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda j: run_one(client, *j, args.max_tokens), jobs))
    wall = time.perf_counter() - t0
    server.should_exit = True
    engine.shutdown()
    for r in results:
        if not r["ok"]:
            print(f"INVALID {r['kind']} {r['tool']} stream={r['stream']} finish={r['finish']}"
                  f" calls={r['calls']}")  # fmt: skip
    print("| kind | streamed | valid / requests |")
    print("|---|---|---|")
    for kind in ("named", "required"):
        for s in (False, True):
            rs = [r for r in results if r["kind"] == kind and r["stream"] == s]
            print(f"| {kind} | {s} | {sum(r['ok'] for r in rs)} / {len(rs)} |")
    print(f"{len(results)} requests in {wall:.1f} s")
    print(f"valid_tool_call_share: {sum(r['ok'] for r in results) / len(results):.3f}")


if __name__ == "__main__":
    main()
