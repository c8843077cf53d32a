"""Incremental detokenization and stop-string matching, on the host.

Decoding the whole output every step costs O(length) per token. Instead, as vLLM does,
each sequence keeps two offsets into its ids: text is produced by decoding a short window
``ids[prefix:]`` and subtracting the window's already-emitted part ``ids[prefix:read]``;
text ending in U+FFFD (an incomplete UTF-8 / byte-fallback sequence) is held back until
the next token completes it. Window decoding matters for tokenizers whose pieces depend
on their neighbours (SentencePiece's leading spaces).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedjax.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of one sequence's output ids, grown one token at a time.

    ``text=False``: keep the ids only (no text, no stop strings): the engine core process,
    whose client detokenizes and matches stop strings in the API process, as vLLM v1.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *, text: bool = True):
        self.tokenizer = tokenizer
        self._stop = tuple(stop)
        self._text = text
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids[:_read] are already in self.text

    @property
    def matches_stop_strings(self) -> bool:
        """Whether ``append`` can end the sequence by a stop string (it has some and
        produces text)."""
        return self._text and bool(self._stop)

    @classmethod
    def holding(cls, tokenizer: Tokenizer, ids: Sequence[int]) -> IncrementalDetokenizer:
        """A detokenizer whose ids are ``ids`` and whose text starts empty at their end
        (beam search: a slot taking another beam's history never reads its per-step text;
        each hypothesis is decoded once at the end)."""
        d = cls(tokenizer)
        d.ids = list(ids)
        d._prefix = d._read = len(d.ids)
        return d

    def append(self, token_id: int) -> str | None:
        """Add one id; returns the stop string found in the new text, if any.

        On a match self.text is truncated right before the stop string (vLLM's default,
        include_stop_str_in_output=False); the id itself stays in self.ids.
        """
        self.ids.append(token_id)
        if not self._text:
            return None
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        window = self.tokenizer.decode(self.ids[self._prefix :])
        if len(window) <= len(before) or window.endswith(_REPLACEMENT):
            return None  # nothing printable yet
        delta = window[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        old_len = len(self.text)
        self.text += delta
        return self._match_stop(old_len)

    def _match_stop(self, old_len: int) -> str | None:
        # Only matches that end in the new text are new: search from where a stop string
        # overlapping the delta could start.
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]
