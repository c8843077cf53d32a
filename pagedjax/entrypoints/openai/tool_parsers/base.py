"""What every tool-call parser returns, and the helpers they share.

A parser reads the model's text (after any reasoning) and returns ``ToolParse``: the
content meant for the user and the calls found. ``parse(text, final=False)`` is asked
again and again while a stream grows and must be *monotonic*: each field of a later
answer extends the earlier one (content and a call's arguments only grow, calls are
only appended, a call's name never changes), so the stream can send differences and
the pieces add up to ``parse(full_text, final=True)``, the non-streamed answer. A
parser therefore holds back text that could still turn into a tag (``tag_overlap``)
and slices a call's ``arguments`` from the model's own text (json_scan.py) instead of
re-serialising the parsed value. The one exception is an output that turns out
invalid at the end (unparseable JSON): the final answer then falls back to the whole
text as content, as vLLM's parsers do, and a stream cannot take back what it sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Call:
    """One function call: ``arguments`` is JSON text (a prefix of it while streaming)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolParse:
    content: str
    calls: list[Call] = field(default_factory=list)


def tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ends ``text`` (text a
    stream must hold back because the next delta could complete the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def json_name(text: str, start: int, end: int | None) -> str | None:
    """The string value text[start:end] decodes to, or None (incomplete or not a str)."""
    if end is None:
        return None
    try:
        v = json.loads(text[start:end])
    except ValueError:
        return None
    return v if isinstance(v, str) else None


def scanned_call(text: str, obj: Any, *arg_keys: str) -> Call | None:
    """The call in ``obj`` (a ``json_scan.ScannedObject`` over ``text``): its string name
    and the raw text of the first member named by ``arg_keys`` (to the end of ``text``
    while that value is open; ``"{}"`` once the object closed without one, ``""`` while
    it is open). None when the object is malformed or has no string name."""
    name_m = obj.get("name")
    name = json_name(text, name_m.start, name_m.end) if name_m else None
    if obj.error or name is None:
        return None
    args_m = obj.get(*arg_keys)
    if args_m is not None:
        return Call(name, text[args_m.start : args_m.end if args_m.end is not None else len(text)])
    return Call(name, "{}" if obj.end is not None else "")


class ToolParser:
    """A named ``--tool-call-parser``: ``parse(text, final)`` as the module says."""

    name = ""

    def parse(self, text: str, final: bool) -> ToolParse:
        raise NotImplementedError
