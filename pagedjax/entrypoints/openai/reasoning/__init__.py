"""Reasoning parsers (``--reasoning-parser``): the model's thinking -> ``reasoning``.

Models that think first (DeepSeek-R1, Qwen3, QwQ) write ``<think> ... </think>`` before
the answer; the chat template often puts ``<think>`` in the prompt, so the output may
hold only the closing tag. ``split(text, final)`` divides an output into (reasoning,
rest): rest is None while the reasoning has not ended. As the tool parsers'
``parse``, a non-final split is monotonic (a partial tag at the end is held back), so
streamed deltas add up to the non-streamed split. vLLM 0.32's rules:

- ``deepseek_r1``: a leading ``<think>`` is dropped; everything before ``</think>`` is
  reasoning, everything after it is content; no ``</think>`` at all: all reasoning.
- ``qwen3``: the same, unless the request turns thinking off
  (``chat_template_kwargs: {"enable_thinking": false}``): then all content.

Either way, a prompt whose last think tag is ``</think>`` (a template that closes an
empty think block itself) means the reasoning ended before the output began
(``reasoning_ended_in(prompt)``, vLLM's ``is_reasoning_end`` on the prompt).

For structured outputs the engine must apply the constraint only after the reasoning
ends (vLLM's ``structured_outputs_config.enable_in_reasoning=False``, the default): the
server passes the parser's name to the engine as ``structured_outputs_config
["reasoning_parser"]``; the engine applies the token-level rule
(``reasoning_ended_ids``, pagedjax/structured/reasoning.py, re-exported here) with the
tags' ids (``end_token_ids``).
"""

from __future__ import annotations

from typing import Any

from pagedjax.entrypoints.openai.tool_parsers.base import tag_overlap
from pagedjax.structured.reasoning import THINK_TAGS
from pagedjax.structured.reasoning import reasoning_ended_ids as reasoning_ended_ids


class ThinkReasoningParser:
    """``<think> ... </think>`` reasoning (DeepSeek-R1's parser)."""

    name = "deepseek_r1"
    start, end = THINK_TAGS["deepseek_r1"]  # the engine's tags (structured/reasoning.py)

    def thinking(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether this request's output starts in reasoning."""
        return True

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(reasoning, rest): rest None while the reasoning has not ended."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            text = stripped[len(self.start) :]
        elif not final and self.start.startswith(stripped):
            return "", None  # empty, or a part of <think>: undecided
        k = text.find(self.end)
        if k >= 0:
            return text[:k], text[k + len(self.end) :]
        if final:
            return text, None
        return text[: len(text) - tag_overlap(text, self.end)], None

    def reasoning_ended_in(self, prompt: str) -> bool:
        """True when the prompt's last think tag closes the block (the output is all
        content), as vLLM's ``is_reasoning_end`` on the prompt's token ids."""
        return prompt.rfind(self.end) > prompt.rfind(self.start)

    def end_token_ids(self, tokenizer: Any) -> tuple[list[int], list[int]]:
        """(start ids, end ids): the token ids of the think tags, for the engine's
        token-level rule (``reasoning_ended_ids``)."""
        enc = tokenizer.encode
        return (list(enc(self.start, add_special_tokens=False)),
                list(enc(self.end, add_special_tokens=False)))  # fmt: skip


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3: as DeepSeek-R1, but ``enable_thinking: false`` makes the output content."""

    name = "qwen3"

    def thinking(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return bool((chat_template_kwargs or {}).get("enable_thinking", True))


REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "deepseek_r1": ThinkReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
