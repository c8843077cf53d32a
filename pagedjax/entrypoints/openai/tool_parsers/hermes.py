"""``--tool-call-parser hermes``: calls written as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (Hermes 2/3, Qwen2.5/Qwen3 templates), vLLM's rules: the content
is the text before the first ``<tool_call>`` (text after the calls is dropped); every
block must hold a JSON object with a string ``name``, else the whole output is content.
``arguments`` is the model's own JSON text (vLLM re-serialises it with ``json.dumps``:
the same value, whitespace may differ).
"""

from __future__ import annotations

import json
import re

from pagedjax.entrypoints.openai.tool_parsers.base import (
    ToolParse,
    ToolParser,
    scanned_call,
    tag_overlap,
)
from pagedjax.entrypoints.openai.tool_parsers.json_scan import scan_object, skip_ws

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ToolParse:
        first = text.find(START)
        if first < 0:
            held = 0 if final else tag_overlap(text, START)
            return ToolParse(text[: len(text) - held])
        if final and not _valid(text):
            return ToolParse(text)
        calls = []
        pos = first
        while pos >= 0:
            body = skip_ws(text, pos + len(START))
            obj = scan_object(text, body, final)
            call = scanned_call(text, obj, "arguments")
            if call is None:
                break
            calls.append(call)
            if obj.end is None:
                break
            pos = text.find(START, obj.end)
        return ToolParse(text[:first], calls)


def _valid(text: str) -> bool:
    """vLLM's test: every block parses as an object with a string name, and the
    spans the stream reads are those json.loads reads."""
    for m in _BLOCK.finditer(text):
        raw = m.group(1) if m.group(1) is not None else m.group(2)
        try:
            obj = json.loads(raw)
        except ValueError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        start = m.start() + len(START)
        scanned = scan_object(text, skip_ws(text, start), True)
        if (
            scanned.error
            or scanned.end is None
            or text[scanned.end : m.end()].strip() not in ("", END)
        ):
            return False
    return True
