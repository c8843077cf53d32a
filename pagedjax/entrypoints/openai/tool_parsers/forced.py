"""Outputs of ``tool_choice="required"`` and of a named function (vLLM's rules; the
structured-output constraint that produces them is built in ``tools.py``).

- named function: the whole output is that function's arguments (JSON text);
- required: the output is a JSON array of ``{"name": ..., "parameters": {...}}``, one
  element per call; an output that is not such an array (an engine without the
  constraint, a truncated output) is returned as content with no calls.
"""

from __future__ import annotations

import json

from pagedjax.entrypoints.openai.tool_parsers.base import Call, ToolParse, ToolParser, scanned_call
from pagedjax.entrypoints.openai.tool_parsers.json_scan import scan_object, skip_ws


class NamedFunctionParser(ToolParser):
    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> ToolParse:
        return ToolParse("", [Call(self.function, text)])


class RequiredParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> ToolParse:
        calls, ok = _scan_array(text, final)
        if final and not (ok and _valid(text)):
            return ToolParse(text)
        return ToolParse("", calls)


def _scan_array(text: str, final: bool) -> tuple[list[Call], bool]:
    calls: list[Call] = []
    i = skip_ws(text, 0)
    if i >= len(text):
        return calls, False
    if text[i] != "[":
        return calls, False
    i = skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "]":
            return calls, not text[i + 1 :].strip()
        obj = scan_object(text, i, final)
        call = scanned_call(text, obj, "parameters")
        if call is None:
            return calls, False
        calls.append(call)
        if obj.end is None:
            return calls, False
        i = skip_ws(text, obj.end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(text, i + 1)
        elif i < len(text) and text[i] != "]":
            return calls, False
    return calls, False


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in value)
    )
