"""Chat ``tools`` and ``tool_choice``: validation, the constraint, the template's view.

vLLM 0.32's rules, field by field:

- ``tools``: a non-empty array of ``{"type": "function", "function": {"name",
  "description"?, "parameters"?, "strict"?}}``; the chat template gets them as given
  (``tools=``), whatever ``tool_choice`` is;
- ``tool_choice``: ``"none"``, ``"auto"`` (the default when tools are given),
  ``"required"`` or ``{"type": "function", "function": {"name": ...}}`` naming one of
  the tools; anything but "none" needs ``tools``. ``"auto"`` needs the server's
  ``--enable-auto-tool-choice --tool-call-parser NAME`` (else a 400, as vLLM);
- ``"required"`` constrains the output to a JSON array of ``{"name", "parameters"}``
  objects, one ``anyOf`` branch per tool (``tool_schema``; the tools' ``$defs`` are
  hoisted to the top, a name defined twice differently is a 400), at most one item when
  the request says ``parallel_tool_calls: false`` (``maxItems: 1``); a named function
  constrains the output to its ``parameters`` schema. A tool without ``parameters`` (or
  with ``{}``) is constrained to a JSON object (``{"type": "object", "properties": {}}``,
  vLLM's ``_params_or_empty_object``) in both. These are vLLM 0.32's
  ``get_json_schema_from_tools``, which vLLM applies when its tool parser has no
  structural tag or ``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``; under the hermes parser
  vLLM's default is a structural tag instead (tool_tags.py, chosen in chat_output.py).
  Either together with ``response_format`` / ``structured_outputs`` is a 400: one
  constraint per request (vLLM 0.32 replaces the user's constraint by the tool
  constraint on both of its paths, with only a log line; read in its parsers'
  ``adjust_request``);
- ``parallel_tool_calls: false`` keeps only the first call (vLLM's filter) besides the
  ``maxItems: 1`` above;
- the deprecated ``functions`` / ``function_call`` are refused by name.

Assistant messages may carry ``tool_calls`` (their ``arguments`` JSON text is decoded
to an object for the template, as vLLM does) and tool messages ``tool_call_id``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from pagedjax.entrypoints.openai.protocol import bad

CHOICES = ("none", "auto", "required")
# What a tool without parameters constrains its arguments to (vLLM's
# _params_or_empty_object): still a JSON object, so the call parses as one.
EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """The validated tool fields. choice: "none" | "auto" | "required" | "named"."""

    tools: list[dict] | None
    choice: str
    function: str | None = None
    parallel: bool = True

    def function_parameters(self, name: str) -> dict | None:
        for t in self.tools or []:
            if t["function"]["name"] == name:
                return t["function"].get("parameters")
        return None


def parse_tools(body: dict) -> ToolRequest:
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise bad(f"'{old}' (OpenAI's deprecated function calling) is not supported; use"
                      " 'tools' and 'tool_choice'", old)  # fmt: skip
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be an array", "tools")
        if not tools:
            raise bad("'tools' must not be an empty array; give at least one tool or omit the"
                      " field", "tools")  # fmt: skip
        tools = [_tool(t, i) for i, t in enumerate(tools)]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise bad(f"'tools' names a function twice: {names}", "tools")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if choice == "none":
        return ToolRequest(tools, "none", parallel=parallel)
    if not tools:
        raise bad("'tool_choice' needs 'tools'", "tool_choice")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad(f"'tool_choice' must be one of {list(CHOICES)} or a named function"
                      f" ({{\"type\": \"function\", \"function\": {{\"name\": ...}}}}), got"
                      f" {choice!r}", "tool_choice")  # fmt: skip
        return ToolRequest(tools, choice, parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name or choice.get("type", "function") != "function":
        raise bad("'tool_choice' as an object must be {\"type\": \"function\", \"function\":"
                  " {\"name\": ...}}", "tool_choice")  # fmt: skip
    if name not in {t["function"]["name"] for t in tools}:
        raise bad(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    return ToolRequest(tools, "named", name, parallel)


def _tool(t: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise bad(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    fn = t.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(f"{where}.function needs a non-empty string 'name'", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad(f"{where}.function.parameters must be a JSON schema object", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad(f"{where}.function.description must be a string", "tools")
    return {**t, "type": "function"}


def tool_schema(req: ToolRequest) -> dict | None:
    """The JSON schema the output must follow (vLLM's get_json_schema_from_tools):
    required -> an array of {name, parameters} (``maxItems: 1`` under
    ``parallel_tool_calls: false``); named -> the function's parameters; missing or
    empty parameters -> EMPTY_OBJECT; None for "none" / "auto"."""
    if req.choice == "named":
        assert req.function is not None
        return copy.deepcopy(req.function_parameters(req.function) or EMPTY_OBJECT)
    if req.choice != "required":
        return None
    branches, defs = [], {}
    for t in req.tools or []:
        fn = t["function"]
        params = copy.deepcopy(fn.get("parameters") or EMPTY_OBJECT)
        for name, schema in params.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise bad(f"tools define '$defs.{name}' twice, differently", "tools")
            defs[name] = schema
        branches.append({
            "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                           "parameters": params},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": branches}}  # fmt: skip
    if not req.parallel:  # vLLM: only an explicit false bounds the array
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def extend_messages(messages: list[dict], raw: list[Any]) -> None:
    """Copy the tool fields of the request's messages (``raw``) onto the parsed ones:
    an assistant's ``tool_calls`` (arguments decoded to objects for the template), a
    tool message's ``tool_call_id``, an assistant's earlier ``reasoning``."""
    for i, (msg, m) in enumerate(zip(messages, raw, strict=True)):
        calls = m.get("tool_calls")
        if calls is not None and msg["role"] == "assistant":
            if not isinstance(calls, list):
                raise bad(f"messages[{i}].tool_calls must be an array", "messages")
            msg["tool_calls"] = [_message_call(c, i) for c in calls]
        if isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        reasoning = m.get("reasoning", m.get("reasoning_content"))
        if isinstance(reasoning, str) and msg["role"] == "assistant":
            msg["reasoning"] = msg["reasoning_content"] = reasoning


def _message_call(c: Any, i: int) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"messages[{i}].tool_calls entries need function.name", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # the template gets the text as sent
    return {**c, "type": "function", "function": {**fn, "arguments": args}}
