"""Replay of a conversation trace: one JSON object per line (JSONL), with conversation ids.

Format (docs/workloads.md, "Conversation traces"); one request per line, blank lines
skipped:

    {"arrival_s": 0.0, "conversation": "c1", "prompt_len": 812, "output_len": 120}
    {"arrival_s": 4.2, "conversation": "c1", "prompt_len": 1001, "output_len": 64}
    {"arrival_s": 0.5, "conversation": 7, "prompt_tokens": [1, 2, 3, 4], "output_len": 16}
    {"arrival_s": 1.0, "conversation": "a2", "prompt_len": 4400, "output_len": 30,
     "shared_prefix": "repo-context", "shared_prefix_len": 4096}

Keys: ``arrival_s`` (seconds, finite, >= 0), ``conversation`` (a string or an integer),
``output_len`` (integer >= 1), exactly one of ``prompt_len`` (integer >= 1: the prompt is
the first prompt_len tokens of the conversation's stream, as ``conversations.py``
describes; its output the next output_len tokens) and ``prompt_tokens`` (a non-empty list
of integer ids >= 0); optionally ``shared_prefix`` (a string or integer naming a prefix
several conversations' streams start with) with ``shared_prefix_len`` (integer >= 1; one
value per name), for ``prompt_len`` rows only. Any other key is refused. One conversation
uses one kind of row (lengths or tokens) and at most one shared prefix.

Requests are sorted by arrival (stably: equal times keep file order); a conversation's
turns are numbered in that order. Every refusal is a ``ValueError`` naming the file, the
line number (from 1) and the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pagedjax.workloads.conversations import ConversationWorkload
from pagedjax.workloads.record import Workload

REQUIRED = ("arrival_s", "conversation", "output_len")
OPTIONAL = ("prompt_len", "prompt_tokens", "shared_prefix", "shared_prefix_len")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_row(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: must be a JSON object, got {type(row).__name__}")
    for k in REQUIRED:
        if k not in row:
            raise ValueError(f"{where}: missing key {k!r}")
    extra = sorted(set(row) - set(REQUIRED) - set(OPTIONAL))
    if extra:
        raise ValueError(f"{where}: unknown key(s) {extra} (allowed: {[*REQUIRED, *OPTIONAL]})")
    t = row["arrival_s"]
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
            and t >= 0):  # fmt: skip
        raise ValueError(f"{where}: arrival_s must be a finite number >= 0, got {t!r}")
    conv = row["conversation"]
    if not (isinstance(conv, str) or _is_int(conv)):
        raise ValueError(f"{where}: conversation must be a string or an integer, got {conv!r}")
    if not (_is_int(row["output_len"]) and row["output_len"] >= 1):
        raise ValueError(f"{where}: output_len must be an integer >= 1, got {row['output_len']!r}")
    has_len, has_tok = "prompt_len" in row, "prompt_tokens" in row
    if has_len == has_tok:
        raise ValueError(f"{where}: give exactly one of prompt_len and prompt_tokens")
    if has_len and not (_is_int(row["prompt_len"]) and row["prompt_len"] >= 1):
        raise ValueError(f"{where}: prompt_len must be an integer >= 1, got {row['prompt_len']!r}")
    if has_tok:
        tok = row["prompt_tokens"]
        if not (isinstance(tok, list) and tok and all(_is_int(x) and x >= 0 for x in tok)):
            raise ValueError(f"{where}: prompt_tokens must be a non-empty list of integers >= 0")
    has_sp, has_sp_len = "shared_prefix" in row, "shared_prefix_len" in row
    if has_sp != has_sp_len:
        raise ValueError(f"{where}: shared_prefix and shared_prefix_len go together")
    if has_sp:
        if has_tok:
            raise ValueError(f"{where}: shared_prefix is for prompt_len rows (token rows "
                             "share through their ids)")  # fmt: skip
        sp = row["shared_prefix"]
        if not (isinstance(sp, str) or _is_int(sp)):
            raise ValueError(f"{where}: shared_prefix must be a string or an integer, got {sp!r}")
        if not (_is_int(row["shared_prefix_len"]) and row["shared_prefix_len"] >= 1):
            raise ValueError(f"{where}: shared_prefix_len must be an integer >= 1, got "
                             f"{row['shared_prefix_len']!r}")  # fmt: skip
    return row


def load_conversation_trace(path: str | Path, name: str | None = None) -> ConversationWorkload:
    """Reads a JSONL conversation trace (module docstring) into a ConversationWorkload.

    Raises:
        ValueError: no such file, an empty trace, or a bad row (file and line number).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: no trace file at {path}")
    rows: list[tuple[int, dict[str, Any]]] = []
    conv_kind: dict[Any, tuple[bool, Any, int]] = {}  # conversation -> (tokens?, prefix, line)
    prefix_len: dict[Any, tuple[int, int]] = {}  # shared prefix -> (len, first line)
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            row = _parse_row(line, where)
            # JSON "7" and 7 are different conversations: key by (type, value).
            conv = (type(row["conversation"]).__name__, row["conversation"])
            kind = ("prompt_tokens" in row, row.get("shared_prefix"))
            if conv in conv_kind and conv_kind[conv][:2] != kind:
                raise ValueError(
                    f"{where}: conversation {row['conversation']!r} mixes token and length "
                    f"rows or shared prefixes (its first row is line {conv_kind[conv][2]})"
                )
            conv_kind.setdefault(conv, (*kind, lineno))
            if "shared_prefix" in row:
                sp = (type(row["shared_prefix"]).__name__, row["shared_prefix"])
                n = row["shared_prefix_len"]
                if sp in prefix_len and prefix_len[sp][0] != n:
                    raise ValueError(
                        f"{where}: shared_prefix {row['shared_prefix']!r} has length {n} here "
                        f"but {prefix_len[sp][0]} on line {prefix_len[sp][1]}"
                    )
                prefix_len.setdefault(sp, (n, lineno))
            rows.append((lineno, row))
    if not rows:
        raise ValueError(f"path: {path} holds no requests")
    order = sorted(range(len(rows)), key=lambda i: rows[i][1]["arrival_s"])  # stable
    conv_ids: dict[Any, int] = {}
    group_ids: dict[Any, int] = {}
    turns: dict[int, int] = {}
    arrival, prompt, output, conv, turn, group, plen, tokens = ([] for _ in range(8))
    for i in order:
        row = rows[i][1]
        c = conv_ids.setdefault((type(row["conversation"]).__name__, row["conversation"]),
                                len(conv_ids))  # fmt: skip
        conv.append(c)
        turn.append(turns.get(c, 0))
        turns[c] = turn[-1] + 1
        arrival.append(float(row["arrival_s"]))
        output.append(row["output_len"])
        if "prompt_tokens" in row:
            ids = np.asarray(row["prompt_tokens"], np.int64)
            tokens.append(ids)
            prompt.append(len(ids))
        else:
            tokens.append(None)
            prompt.append(row["prompt_len"])
        if "shared_prefix" in row:
            sp = (type(row["shared_prefix"]).__name__, row["shared_prefix"])
            group.append(group_ids.setdefault(sp, len(group_ids)))
            plen.append(row["shared_prefix_len"])
        else:
            group.append(-1)
            plen.append(0)
    prompt_arr = np.array(prompt, np.int32)
    output_arr = np.array(output, np.int32)
    label = path.stem if name is None else name
    return ConversationWorkload(
        Workload(
            np.array(arrival),
            prompt_arr,
            output_arr,
            source_len=int((prompt_arr + output_arr).max()),
            name=label,
        ),  # fmt: skip
        np.array(conv, np.int32),
        np.array(turn, np.int32),
        np.array(group, np.int32),
        np.array(plen, np.int32),
        prompt_tokens=tuple(tokens) if any(t is not None for t in tokens) else None,
        name=label,
    )


def write_conversation_trace(path: str | Path, w: ConversationWorkload) -> Path:
    """Writes ``w`` in this format (stream rows as prompt_len, token rows as prompt_tokens;
    conversation ids and shared prefixes as integers): load_conversation_trace reads
    back the same requests."""
    path = Path(path)
    lines = []
    for i in range(len(w)):
        row: dict[str, Any] = {
            "arrival_s": float(w.requests.arrival_time[i]),
            "conversation": int(w.conversation[i]),
            "output_len": int(w.requests.output_len[i]),
        }
        tokens = None if w.prompt_tokens is None else w.prompt_tokens[i]
        if tokens is not None:
            row["prompt_tokens"] = [int(x) for x in tokens]
        else:
            row["prompt_len"] = int(w.requests.prompt_len[i])
            if w.prefix_group[i] >= 0:
                row["shared_prefix"] = int(w.prefix_group[i])
                row["shared_prefix_len"] = int(w.prefix_len[i])
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path
