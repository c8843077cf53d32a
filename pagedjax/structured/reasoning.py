"""The constraint starts after the reasoning (vLLM's ``enable_in_reasoning=False``).

A reasoning model (DeepSeek-R1, Qwen3) writes ``<think> ... </think>`` before its answer.
With ``StructuredOutputsConfig.reasoning_parser`` set (the server writes its
``--reasoning-parser`` there) and ``enable_in_reasoning`` false (vLLM's default), a
constrained sample runs unconstrained (no mask, no grammar advance) until its output ends
with the end tag's token ids; from the next token on the grammar applies, from its start
state (the tag's own tokens are never fed to the grammar). A prompt that already ended
the reasoning (``reasoning_ended_ids``: Qwen3's ``enable_thinking: false`` template
closes an empty think block itself) constrains from the first output token, as without a
parser. docs/structured_outputs.md, "What the engine must do".

Three pieces, one owner each:

- ``ThinkTags``: per engine, the tags' token ids (``tokenizer.encode(tag,
  add_special_tokens=False)``, one or several tokens each) and the prompt rule.
  ``for_config`` is None when nothing is gated (no parser, or enable_in_reasoning).
- ``ReasoningGate``: per sample, whether its reasoning is still open; ``feed`` records an
  output token while it is and says when the end tag completed; ``unfeed`` takes tokens
  back (speculative rollback), reopening it.
- ``GatedGuide``: a ``Guide`` (manager.py) that holds a gate in front of the request's
  matcher: while open, ``fill_mask`` allows every token, ``accept`` feeds the gate,
  ``jump_forward`` forces nothing; once closed, it is the matcher. ``rollback`` undoes
  across the boundary. The host-mask path uses it; the device FSM path keeps the gate
  beside the FSM state (``SequenceState.reasoning``: the row has no FSM state, -1, and
  needs the host, while the gate is open).

Cost: O(len(end tag)) per token while open (a suffix compare over a bounded tail); nothing
once closed beyond one attribute check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# The parsers' think tags (pagedjax/entrypoints/openai/reasoning: both use <think>).
THINK_TAGS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
}


def reasoning_ended_ids(token_ids: Sequence[int], start: Sequence[int], end: Sequence[int]) -> bool:
    """The rule on token ids (a prompt, or prompt + output so far): the reasoning has
    ended when the last occurrence of the end tag's ids comes after the last occurrence
    of the start tag's ids (vLLM's ``is_reasoning_end`` on the prompt). O(len(token_ids)
    x tag length); tags are 1-3 tokens."""

    def last(seq: Sequence[int]) -> int:
        n = len(seq)
        if n == 0:
            return -1
        for i in range(len(token_ids) - n, -1, -1):
            if list(token_ids[i : i + n]) == list(seq):
                return i
        return -1

    return last(end) > last(start)


class ReasoningGate:
    """One sample's reasoning: open until its output ends with ``end`` (token ids).
    max_rollback: how many fed tokens ``unfeed`` may take back (speculative drafts)."""

    def __init__(self, end: Sequence[int], max_rollback: int = 0):
        self._end = list(end)
        self._keep = len(self._end) - 1 + max_rollback  # the tail a suffix check needs
        self._tail: list[int] = []
        self._max_rollback = max_rollback
        self.open = True

    def feed(self, tok: int) -> bool:
        """Record an output token of the open reasoning. True when it completed the end
        tag (the gate is then closed: the next token is the constraint's first)."""
        assert self.open, "feed after the reasoning ended"
        self._tail.append(tok)
        n = len(self._end)
        if self._tail[-n:] == self._end:
            self.open = False
        if len(self._tail) > 2 * self._keep + n:  # amortised trim to the bounded tail
            del self._tail[: len(self._tail) - self._keep - n]
        return not self.open

    def unfeed(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` fed tokens (the gate is open again: before
        them it was). ValueError beyond max_rollback."""
        if num_tokens > self._max_rollback or num_tokens > len(self._tail):
            raise ValueError(f"cannot take back {num_tokens} reasoning tokens"
                             f" (max_rollback={self._max_rollback})")  # fmt: skip
        if num_tokens:
            del self._tail[-num_tokens:]
            self.open = True


class GatedGuide:
    """A ``Guide`` whose constraint starts once the gate closes (module docstring).
    inner: the request's matcher, at its start state."""

    def __init__(self, inner: Any, gate: ReasoningGate):
        self.inner = inner
        self.gate = gate
        self.backend = inner.backend
        self._since = 0  # tokens the inner matcher accepted since the gate closed

    @property
    def in_reasoning(self) -> bool:
        return self.gate.open

    def accept(self, token: int) -> bool:
        if self.gate.open:
            self.gate.feed(token)
            return True
        ok = self.inner.accept(token)
        self._since += ok
        return ok

    def fill_mask(self, out: np.ndarray) -> None:
        if self.gate.open:
            out.fill(-1)  # every token: the thinking is free text
        else:
            self.inner.fill_mask(out)

    def is_terminated(self) -> bool:
        return not self.gate.open and self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens: the matcher's first, then the
        reasoning's (reopening the gate; the matcher is then back at its start)."""
        k = min(num_tokens, self._since)
        if k:
            self.inner.rollback(k)
            self._since -= k
        if num_tokens > k:
            self.gate.unfeed(num_tokens - k)

    def jump_forward(self) -> list[int]:
        if self.gate.open:
            return []  # nothing is forced in free text
        forced = self.inner.jump_forward()
        self._since += len(forced)
        return forced


@dataclass(frozen=True)
class ThinkTags:
    """The think tags' token ids of one engine's tokenizer."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    @classmethod
    def for_config(cls, config: Any, tokenizer: Any) -> ThinkTags | None:
        """The tags when ``config`` (a StructuredOutputsConfig) gates constraints behind
        the reasoning, else None. ValueError for a parser this engine does not know or a
        tag that encodes to no tokens."""
        name = config.reasoning_parser
        if not name or config.enable_in_reasoning:
            return None
        if name not in THINK_TAGS:
            raise ValueError(f"structured_outputs_config.reasoning_parser must be one of"
                             f" {sorted(THINK_TAGS)}, got {name!r}")  # fmt: skip
        ids = [tuple(tokenizer.encode(tag, add_special_tokens=False)) for tag in THINK_TAGS[name]]
        if not all(ids):
            raise ValueError(f"structured_outputs_config.reasoning_parser={name!r}: the"
                             f" tokenizer encodes a tag of {THINK_TAGS[name]} to no tokens")
        return cls(*ids)

    def gate(self, prompt_ids: Sequence[int], max_rollback: int = 0) -> ReasoningGate | None:
        """A sample's gate, or None when the prompt already ended the reasoning (the
        constraint applies from the first output token)."""
        if reasoning_ended_ids(prompt_ids, self.start, self.end):
            return None
        return ReasoningGate(self.end, max_rollback)


__all__ = ["THINK_TAGS", "GatedGuide", "ReasoningGate", "ThinkTags", "reasoning_ended_ids"]
