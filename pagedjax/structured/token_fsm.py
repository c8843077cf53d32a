"""Token-level DFAs for the device-side FSM (``StructuredOutputsConfig.device_fsm``).

A regex or choice constraint is a regular language, so the tokens allowed after any
output prefix depend only on a DFA state: a transition table ``next[state, token]``
(-1: the token is not allowed) replaces the matcher on the host. The jitted step takes
``allowed = next[state] >= 0`` as its mask and ``next[state, sampled]`` as the new
state, so rows under such a constraint need no host round trip between steps and can
run inside the fused K-step decode loop (docs/structured_outputs.md, "Device FSM").

Build (host, once per (constraint, tokenizer), cached by the manager):

1. outlines-core's ``Index`` (Rust; byte-level, so a token that is part of a UTF-8
   character is handled as the bytes it is) over the vocabulary's token bytes (taken
   from xgrammar's ``TokenizerInfo.decoded_vocab``, the byte tokenizer's ids 0..255,
   special tokens left out) gives the transitions; choices are the alternation of their
   escaped texts.
2. Dense ``int32[states, V]``, then EOS: every EOS id self-loops in accepting states
   and is refused elsewhere (the host path's rule: EOS only where the grammar accepts
   termination).
3. Compressed by token classes: tokens whose columns are equal in every state share a
   class (``np.unique`` over columns), so the table is ``int32[states, C]`` plus
   ``class_of int32[V]``: e.g. ``[a-z ]{400}`` over SmolLM2's 49,152 tokens has 401
   states but ~17 classes (a token moves the state by its length, or is refused), 27 KB
   instead of 79 MB dense.
4. Trimmed: a transition into a state from which no token sequence reaches an accepting
   state is removed (iterated to a fixpoint), so no reachable state is a dead end and
   the device never samples from an empty distribution.

Refusals (``FsmUnavailable``, the caller falls back to host masks and reports the
reason): outlines-core missing, a regex it cannot compile, the dense build over
``DENSE_LIMIT`` or the compressed table over ``max_bytes``, a constraint no token
sequence satisfies.

Cost: the dense build is O(states * V) host memory and time (the transitions come from
Rust; the Python loop is per state); ~0.1 s for small constraints over 256 tokens, a few
seconds for SmolLM2's vocabulary at hundreds of states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# The dense table built on the host before compression (bytes): ~1,300 states at a
# 49k vocabulary. Larger constraints take the host path (their build would also take
# seconds per request).
DENSE_LIMIT = 256 << 20


class FsmUnavailable(ValueError):
    """Why a constraint gets no device FSM (it then takes the host-mask path)."""


@dataclass(frozen=True)
class TokenFsm:
    """One constraint's compressed token DFA over a vocabulary of V tokens.

    table: int32[n, C], the next state of (state, token class), -1 = not allowed.
    class_of: int32[V], each token's class (column of ``table``).
    initial: the start state. final: bool[n], accepting states (EOS allowed there).
    """

    table: np.ndarray
    class_of: np.ndarray
    initial: int
    final: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes + self.class_of.nbytes)

    def next_state(self, state: int, token: int) -> int:
        """The state after ``token`` (-1: refused)."""
        return int(self.table[state, self.class_of[token]])

    def allowed(self, state: int) -> np.ndarray:
        """bool[V]: the tokens allowed in ``state``."""
        return self.table[state][self.class_of] >= 0


_META = set("\\.+*?()|[]{}^$")


def choice_regex(choices: tuple[str, ...] | list[str]) -> str:
    """A regex whose language is exactly ``choices`` (outlines-core's syntax: only the
    regex metacharacters are escaped)."""
    return "|".join("(" + "".join("\\" + c if c in _META else c for c in s) + ")"
                    for s in choices)  # fmt: skip


def vocab_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """Each token id's bytes (None: a special or padding id, never allowed by a regex):
    the byte tokenizer's ids 0..255, or xgrammar's decoded vocabulary of a Hugging Face
    tokenizer (its byte-level / SentencePiece decoding)."""
    out: list[bytes | None] = [None] * vocab_size
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is None:
        if type(tokenizer).__name__ != "ByteTokenizer":
            raise FsmUnavailable(f"no token bytes for a {type(tokenizer).__name__}")
        for i in range(min(256, vocab_size)):
            out[i] = bytes([i])
        return out
    from pagedjax.structured.backend_xgrammar import import_xgrammar

    info = import_xgrammar().TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    special = set(info.special_token_ids)
    for i, b in enumerate(info.decoded_vocab[:vocab_size]):
        if i not in special and b:
            out[i] = bytes(b)
    return out


def build_token_fsm(regex: str, vocab: list[bytes | None], eos_ids: list[int],
                    max_bytes: int) -> TokenFsm:  # fmt: skip
    """The compressed, trimmed token DFA of ``regex`` (see the module docstring).
    vocab: ``vocab_bytes``; eos_ids: the ids that end an output where it is accepted.
    FsmUnavailable naming the reason when it cannot be built within ``max_bytes``."""
    try:
        from outlines_core import Index, Vocabulary
    except ImportError as e:
        raise FsmUnavailable("outlines-core is not installed (pip install outlines-core)") from e
    v = len(vocab)
    eos = sorted(set(eos_ids))
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab):
        if b is not None and i not in eos:
            by_bytes.setdefault(b, []).append(i)
    eos0 = eos[0] if eos else v
    try:
        # A probe over the 256 single bytes first (milliseconds): its states are the
        # regex's byte-DFA states, which the vocabulary's index cannot exceed, so a
        # constraint over the dense cap is refused before the full build (seconds per
        # hundred states at a 49k vocabulary).
        probe = Index(regex, Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
        n = len(probe.get_transitions())
        if n * v * 4 > DENSE_LIMIT:
            raise FsmUnavailable(
                f"{n} DFA states x {v} tokens dense is over {DENSE_LIMIT} bytes (DENSE_LIMIT)"
            )
        index = Index(regex, Vocabulary(eos0, by_bytes))
    except FsmUnavailable:
        raise
    except Exception as e:  # outlines-core raises ValueError / its own errors
        raise FsmUnavailable(f"outlines-core cannot compile the regex: {e}") from e
    trans = index.get_transitions()
    names = sorted(trans)
    n = len(names)
    if n * v * 4 > DENSE_LIMIT:
        raise FsmUnavailable(f"{n} states x {v} tokens dense is over {DENSE_LIMIT} bytes"
                             " (DENSE_LIMIT)")  # fmt: skip
    ids = {s: k for k, s in enumerate(names)}
    dense = np.full((n, v), -1, np.int32)
    for s, row in trans.items():
        toks = np.fromiter(row.keys(), np.int64, len(row))
        nxt = np.fromiter((ids[x] for x in row.values()), np.int32, len(row))
        keep = toks < v
        dense[ids[s], toks[keep]] = nxt[keep]
    final = np.zeros(n, bool)
    for s in index.get_final_states():
        final[ids[s]] = True
    if eos:
        eos_arr = np.asarray([e for e in eos if e < v], np.int64)
        dense[:, eos_arr] = -1
        dense[np.ix_(np.flatnonzero(final), eos_arr)] = np.flatnonzero(final)[:, None]
    table, class_of = _token_classes(dense)
    _trim(table, final)
    initial = ids[index.get_initial_state()]
    if not (table[initial] >= 0).any():
        raise FsmUnavailable("no token sequence of this vocabulary satisfies the constraint")
    fsm = TokenFsm(table, class_of.reshape(-1).astype(np.int32), initial, final)
    if fsm.nbytes > max_bytes:
        raise FsmUnavailable(
            f"the table is {fsm.nbytes} bytes ({n} states x {table.shape[1]} token classes),"
            f" over device_fsm_max_bytes={max_bytes}"
        )
    return fsm


def _token_classes(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int32[n, C] distinct columns of ``dense`` int32[n, V], int[V] each token's
    column). Columns are grouped by a random linear hash (one [V, n] x [n] product; 4 s
    -> 0.1 s against ``np.unique(axis=0)`` at 401 x 49,152), then checked exactly; a
    collision (never seen) falls back to the exact sort."""
    weights = np.random.default_rng(0).integers(1, 1 << 62, dense.shape[0], dtype=np.int64)
    with np.errstate(over="ignore"):  # the hash wraps modulo 2**64 on purpose
        h = (dense.T.astype(np.int64) + 1) @ weights
    _, first, class_of = np.unique(h, return_index=True, return_inverse=True)
    table = np.ascontiguousarray(dense[:, first])
    if not np.array_equal(table[:, class_of.reshape(-1)], dense):
        uniq, class_of = np.unique(dense.T, axis=0, return_inverse=True)
        table = np.ascontiguousarray(uniq.T)
    return table.astype(np.int32), class_of.reshape(-1)


def _trim(table: np.ndarray, final: np.ndarray) -> None:
    """Remove (in place) transitions into states that cannot reach an accepting one."""
    live = final.copy()
    while True:
        ok = (table >= 0) & live[np.maximum(table, 0)]
        new = final | ok.any(axis=1)
        if (new == live).all():
            break
        live = new
    table[(table >= 0) & ~live[np.maximum(table, 0)]] = -1


def combine(fsms: list[TokenFsm], min_rows: int = 16,
            min_classes: int = 16) -> tuple[np.ndarray, np.ndarray, list[int]]:  # fmt: skip
    """One table for several constraints (the rows of one step): joint token classes
    (tokens equal in every constraint's classes), each constraint's rows re-indexed by
    them and offset into one ``int32[R, C]`` (R, C padded up to powers of two, at least
    ``min_rows`` / ``min_classes``, so the programs compile once per bucket), the joint
    ``class_of int32[V]``, and each constraint's first row (its state s is row
    offset + s)."""
    joint, class_of = np.unique(np.stack([f.class_of for f in fsms], axis=1), axis=0,
                                return_inverse=True)  # fmt: skip
    class_of = class_of.reshape(-1)
    rows = sum(f.table.shape[0] for f in fsms)
    r_pad, c_pad = _pow2(max(rows, min_rows)), _pow2(max(len(joint), min_classes))
    out = np.full((r_pad, c_pad), -1, np.int32)
    offsets, at = [], 0
    for g, f in enumerate(fsms):
        part = f.table[:, joint[:, g]]
        out[at : at + len(part), : len(joint)] = np.where(part >= 0, part + at, -1)
        offsets.append(at)
        at += len(part)
    return out, class_of.astype(np.int32), offsets


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# xgrammar's (ECMAScript's) ASCII shorthand classes; outlines-core's (Rust's) are Unicode.
_CLASSES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(regex: str) -> str:
    """``regex`` with \\d, \\w, \\s spelled as xgrammar reads them (ASCII sets), for
    outlines-core; FsmUnavailable for their negations (\\D, \\W, \\S), which would match
    non-ASCII characters differently."""
    out, i, depth = [], 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            e = regex[i + 1]
            if e in _CLASSES:
                out.append(_CLASSES[e] if depth else "[" + _CLASSES[e] + "]")
            elif e in "DWS":
                raise FsmUnavailable(f"\\{e} is not translated for the device FSM")
            else:
                out.append(c + e)
            i += 2
            continue
        if c == "[" and not depth:
            depth = 1
        elif c == "]" and depth and out and out[-1] not in ("[", "[^"):
            depth = 0
        out.append(c)
        i += 1
    return "".join(out)


def regex_of(kind: str, value: Any) -> str | None:
    """The regex of a constraint the device FSM takes (regex, choice), else None."""
    if kind == "regex":
        return ascii_classes(value)
    if kind == "choice":
        return choice_regex(value)
    return None


__all__ = ["FsmUnavailable", "TokenFsm", "build_token_fsm", "choice_regex", "combine",
           "regex_of", "vocab_bytes"]  # fmt: skip
