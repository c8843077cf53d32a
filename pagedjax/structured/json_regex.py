"""A JSON schema as a regex whose language is xgrammar's, for the device FSM.

The device FSM (token_fsm.py) needs a regular expression; a JSON schema becomes one
here. The regex is not written from the schema but read off xgrammar's own grammar for
it (``xgrammar.Grammar.from_json_schema`` with the engine's options: ``any_whitespace``,
``strict_mode=True`` as vLLM compiles it), so the FSM allows exactly the strings the
host path's xgrammar matcher allows: the same whitespace rule (any ``[ \\n\\r\\t]*``
between tokens by default, vLLM's; ``", "`` and ``": "`` only with
``disable_any_whitespace``), string escapes, number syntax, property order, optional
properties, ``additionalProperties`` (closed by xgrammar's strict mode), and the same
integer ranges and string lengths. A regex read off the grammar is an unbounded loop
where the grammar has one (``*``, ``{n, -1}``, a rule calling itself at its end, e.g. a
string's characters, an array's items): a DFA takes those without growing.

Why not outlines-core's ``build_regex_from_schema``: its language is not xgrammar's
(whitespace ``[ ]?`` by default; strings without ``\\uXXXX`` escapes and refusing
U+007F..U+009F; exponents only with a sign), so device-FSM outputs would differ from
host-mask outputs of the same request.

Refused (``FsmUnavailable``: the request keeps host masks, with the reason):

- recursion other than a rule calling itself as its last element (a ``$ref`` cycle, and
  every schema that allows arbitrary JSON somewhere: ``{}`` / ``json_object``,
  untyped items, ``additionalProperties: true``, ``type: object`` without properties)
  is not regular; it is refused rather than cut at a depth, which would change the
  language;
- a string ``pattern`` (xgrammar's ``Regex(...)`` rule) outside a safe subset: printable
  ASCII literals other than ``"`` and ``\\``, escaped punctuation, ``\\d`` / ``\\w``,
  classes that are not negated, groups, ``|`` and quantifiers; ``.``, negated classes,
  ``\\s`` and the like would need xgrammar's JSON-string escaping rules;
- grammar constructs ``_Parser`` does not read (a newer xgrammar's), and a regex over
  ``MAX_REGEX_CHARS`` (inlining shared ``$defs`` repeats them).

One difference is left (tests/test_device_fsm.py pins it): xgrammar's string characters
admit UTF-16 surrogates as raw bytes (``ED A0..BF ..``, not valid UTF-8); outlines-core's
DFA, built with Rust's UTF-8 classes, does not (and refuses patterns that could say so).

Size is the FSM's: a bounded string of n characters is ~n DFA states, an integer range a
few per digit, so a schema's table is states x token classes (token_fsm.py caps it).

Cost: xgrammar's grammar for a schema is milliseconds; the regex is linear in the
inlined grammar; paid once per schema (the manager caches the FSM).
"""

from __future__ import annotations

import json
import re

from pagedjax.structured.token_fsm import FsmUnavailable, ascii_classes

# Inlining repeats a rule at every use; past this the FSM build would be slow anyway.
MAX_REGEX_CHARS = 200_000

# A grammar node: ("alt", [n]), ("seq", [n]), ("lit", str), ("cls", negated, [(lo, hi)]),
# ("ref", name), ("rep", n, lo, hi) (hi -1: unbounded), ("re", pattern).
Node = tuple


def json_schema_regex(schema: dict, any_whitespace: bool) -> str:
    """The regex of xgrammar's language for ``schema`` (see the module docstring);
    FsmUnavailable naming why there is none."""
    from pagedjax.structured.backend_xgrammar import import_xgrammar

    xgr = import_xgrammar()
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace)
    except Exception as e:  # the host path's compile reports the schema's error itself
        raise FsmUnavailable(f"xgrammar cannot convert the schema: {e}") from e
    return grammar_regex(str(grammar))


def grammar_regex(ebnf: str, root: str = "root") -> str:
    """The regex of a non-recursive xgrammar EBNF grammar (its printed form)."""
    rules = {}
    for line in ebnf.splitlines():
        if line.strip():
            name, sep, body = line.partition(" ::= ")
            if not sep:
                raise FsmUnavailable(f"unexpected grammar line {line[:80]!r}")
            rules[name.strip()] = _Parser(body).rule()
    if root not in rules:
        raise FsmUnavailable("the grammar has no root rule")
    return _Writer(rules).rule(root)


class _Parser:
    """xgrammar's printed EBNF: alternation, sequence, strings, character classes, rule
    references, ``* + ?``, ``{n, m}``, ``Regex("...", json_string=true)`` and a trailing
    lookahead ``(=(...))``, which is dropped: in a JSON grammar it restates what the
    enclosing rules require next (random walks against xgrammar's masks check this,
    tests/test_device_fsm.py)."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def _ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def _peek(self, k: int = 1) -> str:
        self._ws()
        return self.s[self.i : self.i + k]

    def _fail(self, what: str) -> FsmUnavailable:
        return FsmUnavailable(
            f"unsupported grammar construct ({what}) at {self.s[self.i :][:40]!r}"
        )

    def rule(self) -> Node:
        node = self.alt()
        if self._peek(2) == "(=":  # a lookahead ends the rule: dropped (class docstring)
            self.i = len(self.s)
        if self._peek():
            raise self._fail("trailing text")
        return node

    def alt(self) -> Node:
        items = [self.seq()]
        while self._peek() == "|":
            self.i += 1
            items.append(self.seq())
        return items[0] if len(items) == 1 else ("alt", items)

    def seq(self) -> Node:
        items = []
        while (c := self._peek()) and c not in "|)" and self._peek(2) != "(=":
            items.append(self.postfix())
        return items[0] if len(items) == 1 else ("seq", items)

    def postfix(self) -> Node:
        node = self.atom()
        while True:
            c = self.s[self.i : self.i + 1]  # postfix operators follow without a space
            if c in ("*", "+", "?") and c:
                node = ("rep", node, 1 if c == "+" else 0, 1 if c == "?" else -1)
                self.i += 1
            elif c == "{":
                m = re.match(r"\{\s*(\d+)\s*,\s*(-?\d+)\s*\}", self.s[self.i :])
                if not m:
                    raise self._fail("repetition")
                node = ("rep", node, int(m[1]), int(m[2]))
                self.i += m.end()
            else:
                return node

    def atom(self) -> Node:
        c = self._peek()
        if c == "(":
            self.i += 1
            node = self.alt()
            if self._peek() != ")":
                raise self._fail("unclosed group")
            self.i += 1
            return node
        if c == '"':
            return ("lit", self._string())
        if c == "[":
            return self._class()
        m = re.match(r'Regex\("((?:[^"\\]|\\.)*)", json_string=true\)', self.s[self.i :])
        if m:
            self.i += m.end()
            return ("re", _unescape(m[1]))
        m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", self.s[self.i :])
        if m and self.s[self.i + m.end() : self.i + m.end() + 1] != "(":
            self.i += m.end()
            return ("ref", m[0])
        raise self._fail("unknown atom")

    def _string(self) -> str:
        self.i += 1
        out = []
        while self.s[self.i] != '"':
            ch, self.i = _char(self.s, self.i)
            out.append(ch)
        self.i += 1
        return "".join(out)

    def _class(self) -> Node:
        self.i += 1
        negated = self.s[self.i] == "^"
        self.i += negated
        ranges = []
        while self.s[self.i] != "]":
            lo, self.i = _char(self.s, self.i)
            hi = lo
            if self.s[self.i] == "-" and self.s[self.i + 1] != "]":
                hi, self.i = _char(self.s, self.i + 1)
            ranges.append((ord(lo), ord(hi)))
        self.i += 1
        return ("cls", negated, ranges)


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "0": "\0", "b": "\b", "f": "\f", "v": "\v"}


def _char(s: str, i: int) -> tuple[str, int]:
    """One (possibly escaped) character of an EBNF string or class at s[i]."""
    if s[i] != "\\":
        return s[i], i + 1
    e = s[i + 1]
    for prefix, n in (("x", 2), ("u", 4), ("U", 8)):
        if e == prefix:
            return chr(int(s[i + 2 : i + 2 + n], 16)), i + 2 + n
    return _ESCAPES.get(e, e), i + 2


def _unescape(text: str) -> str:
    # The Regex(...) argument is printed as a C string: \" and \\ are escapes.
    return re.sub(r"\\(.)", lambda m: m[1] if m[1] in '"\\' else m[0], text)


def _lit(ch: str) -> str:
    return ch if ch.isascii() and ch.isalnum() else f"\\x{{{ord(ch):x}}}"


# A pattern character outside classes that is safe to copy (printable ASCII, not " or \).
_SAFE_PATTERN_ESCAPES = set("dw.-+*?()[]{}|^$/:,#@!&%=<>~_'")


def _pattern_regex(pattern: str) -> str:
    """A ``pattern`` keyword's regex, when inside the safe subset (module docstring)."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    i, depth = 0, 0
    while i < len(body):
        c = body[i]
        if not (c.isascii() and c.isprintable()) or c == '"':
            raise FsmUnavailable(f"pattern {pattern!r}: character {c!r}")
        if c == "\\":
            if i + 1 >= len(body) or body[i + 1] not in _SAFE_PATTERN_ESCAPES:
                raise FsmUnavailable(f"pattern {pattern!r}: escape \\{body[i + 1 : i + 2]}")
            i += 2
            continue
        if c == "[":
            if body[i + 1 : i + 2] == "^":
                raise FsmUnavailable(f"pattern {pattern!r}: a negated class")
            depth = 1
        elif c == "]":
            depth = 0
        elif not depth and (c in "^$" or c == "."):
            raise FsmUnavailable(f"pattern {pattern!r}: {c!r}")
        i += 1
    return ascii_classes(body)


class _Writer:
    """Inlines rules into one regex; a rule calling itself as the last element of some
    of its alternatives becomes a loop: R ::= A | B R  ->  (B)*(A)."""

    def __init__(self, rules: dict[str, Node]):
        self.rules = rules
        self.done: dict[str, str] = {}
        self.stack: list[str] = []

    def rule(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        if name in self.stack:
            raise FsmUnavailable(
                f"the schema is recursive (rule {name!r} through {' -> '.join(self.stack)}),"
                " not a regular language"
            )
        if name not in self.rules:
            raise FsmUnavailable(f"the grammar has no rule {name!r}")
        self.stack.append(name)
        body = self.rules[name]
        alts = body[1] if body[0] == "alt" else [body]
        loops, bases = [], []
        for a in alts:
            items = a[1] if a[0] == "seq" else [a]
            if items[-1] == ("ref", name):
                loops.append(self.node(("seq", items[:-1])))
            else:
                bases.append(self.node(a))
        base = "(?:" + "|".join(bases) + ")"
        out = f"(?:(?:{'|'.join(loops)})*{base})" if loops else base
        self.stack.pop()
        if sum(len(v) for v in self.done.values()) + len(out) > MAX_REGEX_CHARS:
            raise FsmUnavailable(f"the schema's regex is over {MAX_REGEX_CHARS} characters")
        self.done[name] = out
        return out

    def node(self, n: Node) -> str:
        kind = n[0]
        if kind == "alt":
            return "(?:" + "|".join(self.node(x) for x in n[1]) + ")"
        if kind == "seq":
            return "".join(self.node(x) for x in n[1])
        if kind == "lit":
            return "".join(_lit(c) for c in n[1])
        if kind == "cls":
            body = "".join(_lit(chr(lo)) if lo == hi else f"{_lit(chr(lo))}-{_lit(chr(hi))}"
                           for lo, hi in n[2])  # fmt: skip
            return f"[{'^' if n[1] else ''}{body}]"
        if kind == "ref":
            return self.rule(n[1])
        if kind == "rep":
            lo, hi = n[2], n[3]
            q = {(0, -1): "*", (1, -1): "+", (0, 1): "?"}.get((lo, hi))
            q = q or (f"{{{lo},}}" if hi < 0 else f"{{{lo},{hi}}}")
            return f"(?:{self.node(n[1])}){q}"
        if kind == "re":
            return f"(?:{_pattern_regex(n[1])})"
        raise FsmUnavailable(f"unsupported grammar node {kind!r}")


__all__ = ["MAX_REGEX_CHARS", "grammar_regex", "json_schema_regex"]
