"""Where JSON values begin and end in text that may still be growing (a stream).

Tool-call parsers need the raw text of a call's ``arguments`` while the model is still
writing it: a streamed argument delta must be a prefix of the final arguments string,
so the parsers slice the model's own text instead of re-serialising a parsed value
(re-serialising would change whitespace between the partial and the final parse).

``value_end(text, i)`` is the end (exclusive) of the JSON value starting at ``text[i]``,
or None while it is incomplete; ``scan_object(text, i)`` reads an object's top-level
members as raw spans, complete or not. Both are pure and linear in the text scanned;
they do not validate numbers or literals (``json.loads`` on the final span does).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"
# A bare value (number, true, false, null) ends at whitespace or one of ,]}:;< (_BARE).


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


# The rest of a string after its opening quote: any run of plain characters or escapes,
# then the closing quote. A stream re-scans its text at every delta (O(length) each, as
# vLLM's partial-JSON parsing); the regexes jump over string contents in C, which took a
# 3.3 kB call from ~500 to ~350-430 us a delta (1-minute load 11; python loop per char
# before). The remaining cost is one Python step per string and bracket.
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STRUCTURAL = re.compile(r'["{}\[\]]')
_BARE = re.compile(r"[^ \t\n\r,\]}:;<]*")


def _string_end(text: str, i: int) -> int | None:
    """End of the string whose opening quote is text[i]."""
    m = _STRING_REST.match(text, i + 1)
    return m.end() if m else None


def value_end(text: str, i: int, final: bool = False) -> int | None:
    """End (exclusive) of the JSON value that starts at text[i] (no leading whitespace),
    or None if the text ends first. A bare value (number, literal) running to the end of
    the text is complete only when ``final`` (more digits could follow)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while (m := _STRUCTURAL.search(text, j)) is not None:
            c, j = m.group(), m.start()
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if c in "{[" else -1
            j += 1
            if depth == 0:
                return j
        return None
    j = _BARE.match(text, i).end()
    return j if j < len(text) or final else None


@dataclass
class Member:
    """One top-level member of an object: its key and the raw span of its value
    (``end`` None while the value is incomplete)."""

    key: str
    start: int
    end: int | None


@dataclass
class ScannedObject:
    """An object's members found so far; ``end`` is set once its closing brace is read,
    ``error`` when the text cannot be a JSON object."""

    members: list[Member] = field(default_factory=list)
    end: int | None = None
    error: bool = False

    def get(self, *keys: str) -> Member | None:
        """The first member named by any of ``keys`` (in that order of preference)."""
        for k in keys:
            for m in self.members:
                if m.key == k:
                    return m
        return None


def scan_object(text: str, i: int, final: bool = False) -> ScannedObject:
    """The members of the JSON object whose ``{`` is text[i], as far as the text goes."""
    out = ScannedObject()
    if i >= len(text) or text[i] != "{":
        out.error = i < len(text)
        return out
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        out.end = j + 1
        return out
    while j < len(text):
        if text[j] != '"':
            out.error = True
            return out
        kend = _string_end(text, j)
        if kend is None:
            return out
        try:
            key = json.loads(text[j:kend])
        except ValueError:
            out.error = True
            return out
        j = skip_ws(text, kend)
        if j >= len(text):
            return out
        if text[j] != ":":
            out.error = True
            return out
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return out
        vend = value_end(text, j, final)
        out.members.append(Member(key, j, vend))
        if vend is None:
            return out
        j = skip_ws(text, vend)
        if j >= len(text):
            return out
        if text[j] == "}":
            out.end = j + 1
            return out
        if text[j] != ",":
            out.error = True
            return out
        j = skip_ws(text, j + 1)
    return out
