"""``--tool-call-parser llama3_json``: Llama 3.1/3.2 JSON calls, vLLM's rules. The output
is calls only when it starts with ``<|python_tag|>`` or ``{`` (else it is all content):
one or more objects ``{"name": ..., "parameters": {...}}`` (``arguments`` is accepted
too) separated by ``;``, plain text after them dropped; an object that does not parse
(or is cut off) makes the whole output content. vLLM 0.32's non-streamed parser also
finds calls after leading text (its streamed one does not); here both follow the
streamed rule, so a stream and the full answer agree.
``<|python_tag|>`` is a special token, so it is usually gone from text decoded with
``skip_special_tokens`` and the output starts with ``{``.
"""

from __future__ import annotations

import json

from pagedjax.entrypoints.openai.tool_parsers.base import Call, ToolParse, ToolParser, scanned_call
from pagedjax.entrypoints.openai.tool_parsers.json_scan import scan_object, skip_ws

BOT = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ToolParse:
        if not final and BOT.startswith(text):  # "" or a part of the tag: undecided
            return ToolParse("")
        if text.startswith(BOT):
            i = len(BOT)
        elif text.startswith("{"):
            i = 0
        else:
            return ToolParse(text)
        calls, spans, ok = _scan(text, i, final)
        if final and not (ok and _valid(text, spans)):
            return ToolParse(text)
        return ToolParse("", calls)


def _scan(text: str, i: int, final: bool) -> tuple[list[Call], list[tuple[int, int]], bool]:
    """Calls found from text[i] on, the spans of the complete objects, and whether the
    text is objects separated by ';', then anything (meaningful when final)."""
    calls: list[Call] = []
    spans: list[tuple[int, int]] = []
    i = skip_ws(text, i)
    while i < len(text):
        obj = scan_object(text, i, final)
        call = scanned_call(text, obj, "parameters", "arguments")
        if call is None:
            return calls, spans, False
        calls.append(call)
        if obj.end is None:
            return calls, spans, False
        spans.append((i, obj.end))
        i = skip_ws(text, obj.end)
        if i < len(text):
            if text[i] != ";":
                return calls, spans, True  # plain text after the calls: dropped, as vLLM
            i = skip_ws(text, i + 1)
    return calls, spans, bool(spans)


def _valid(text: str, spans: list[tuple[int, int]]) -> bool:
    for a, b in spans:
        try:
            obj = json.loads(text[a:b])
        except ValueError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
    return True
