"""A chat choice's text -> OpenAI's message or stream deltas: reasoning, content, tool calls.

``OutputRules`` (one per request) says how a choice's text divides: a reasoning parser
splits off the thinking (reasoning/__init__.py), then a tool parser (tool_parsers/)
reads calls from the rest. ``rules.message(text, finish_reason)`` is the non-streamed
answer; ``rules.stream()`` gives a choice's ``ChoiceStream``, whose ``delta(text,
final)`` parses the text so far and sends what grew since the last call. Because the
parsers' partial answers are monotonic, the deltas of a stream add up to the message,
field by field (tests/test_openai_tools.py checks it for every split of a text).

Shapes follow vLLM 0.32: ``message = {"role", "content", "tool_calls"?, "reasoning"?}``,
with ``reasoning_content`` beside ``reasoning`` (vLLM's old name, which DeepSeek's API,
many clients and this project's issue use); content is null when the output is all
reasoning, or when "auto" calls come with no text. Tool-call deltas:
``{"index", "id", "type": "function", "function": {"name", "arguments"}}`` the first
time a call appears, then ``{"index", "function": {"arguments": more}}``.
``finish_reason`` becomes "tool_calls" when "auto" found calls or "required" stopped
normally; a named function keeps the engine's reason, as OpenAI's API does.

"required" and named calls are read as tools.py's JSON (``RequiredParser``,
``NamedFunctionParser``), or, when the server's tool parser constrained them with its
structural tag (tool_tags.py: hermes, vLLM's default), by that parser.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedjax.entrypoints.openai.protocol import bad
from pagedjax.entrypoints.openai.reasoning import REASONING_PARSERS, ThinkReasoningParser
from pagedjax.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    Call,
    NamedFunctionParser,
    RequiredParser,
    ToolParser,
)
from pagedjax.entrypoints.openai.tool_tags import tool_structural_tag
from pagedjax.entrypoints.openai.tools import (
    ToolRequest,
    extend_messages,
    parse_tools,
    tool_schema,
)
from pagedjax.sampling.params import StructuredOutputsParams

log = logging.getLogger(__name__)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class Parsed:
    reasoning: str
    content: str
    calls: list[Call] = field(default_factory=list)


@dataclass(frozen=True)
class OutputRules:
    """How one request's choices divide. reasoning: the parser, or None when the output
    has no reasoning part (no parser, thinking off, or ended in the prompt);
    report_reasoning: a parser is configured, so messages carry the reasoning keys;
    tools: the tool parser for this request's tool_choice, or None (all content)."""

    reasoning: ThinkReasoningParser | None = None
    report_reasoning: bool = False
    include_reasoning: bool = True
    tools: ToolParser | None = None
    mode: str = "none"
    parallel: bool = True

    def parse(self, text: str, final: bool) -> Parsed:
        reasoning, rest = "", text
        if self.reasoning is not None:
            reasoning, rest_or_none = self.reasoning.split(text, final)
            if rest_or_none is None:
                return Parsed(reasoning, "")
            rest = rest_or_none
        if self.tools is None:
            return Parsed(reasoning, rest)
        tp = self.tools.parse(rest, final)
        calls = tp.calls if self.parallel else tp.calls[:1]
        return Parsed(reasoning, tp.content, calls)

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        if reason is None:
            return None
        if (self.mode == "auto" and called) or (self.mode == "required" and reason == "stop"):
            return "tool_calls"
        return reason

    def message(self, role: str, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(message, finish_reason) of a finished choice."""
        p = self.parse(text, True)
        content: str | None = p.content
        if not content and (
            (p.calls and self.mode == "auto") or (self.report_reasoning and p.reasoning)
        ):
            content = None
        msg: dict[str, Any] = {"role": role, "content": content}
        if p.calls:
            msg["tool_calls"] = [
                {"id": tool_call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in p.calls
            ]  # fmt: skip
        if self.report_reasoning:
            r = p.reasoning if self.include_reasoning and p.reasoning else None
            msg["reasoning"] = msg["reasoning_content"] = r
        return msg, self.finish_reason(bool(p.calls), reason)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """What one streamed choice has sent; ``delta`` sends what grew."""

    def __init__(self, rules: OutputRules):
        self.rules = rules
        self.reasoning = ""
        self.content = ""
        self.args: list[str] = []  # arguments sent, per call

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta fields (reasoning, content, tool_calls) for the text so far."""
        p = self.rules.parse(text, final)
        d: dict[str, Any] = {}
        if self.rules.report_reasoning and self.rules.include_reasoning:
            more, self.reasoning = _grow(self.reasoning, p.reasoning, "reasoning")
            if more:
                d["reasoning"] = d["reasoning_content"] = more
        more, self.content = _grow(self.content, p.content, "content")
        if more:
            d["content"] = more
        calls = []
        for k, c in enumerate(p.calls):
            if k == len(self.args):
                self.args.append(c.arguments)
                calls.append({"index": k, "id": tool_call_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}})  # fmt: skip
                continue
            more, self.args[k] = _grow(self.args[k], c.arguments, "arguments")
            if more:
                calls.append({"index": k, "function": {"arguments": more}})
        if calls:
            d["tool_calls"] = calls
        return d

    def finish_reason(self, reason: str | None) -> str | None:
        return self.rules.finish_reason(bool(self.args), reason)


def _grow(sent: str, now: str, what: str) -> tuple[str, str]:
    """(the new part, what is sent after it). A stream cannot take back text: if the
    parse no longer extends what was sent (an output that turned out invalid), the
    rest of that field is dropped from the stream and logged."""
    if now.startswith(sent):
        return now[len(sent) :], now
    log.warning("streamed %s no longer matches the parse of the output; not resent", what)
    return "", sent


@dataclass(frozen=True)
class ChatExtras:
    """A chat request's tool and reasoning fields, checked (``prepare_chat``)."""

    tools: ToolRequest
    # For the chat template: chat_template_kwargs, tools=, reasoning_effort (and the
    # enable_thinking it implies unless chat_template_kwargs gives one).
    template_kwargs: dict[str, Any]
    include_reasoning: bool
    # The output is constrained by the tool parser's structural tag (tool_tags.py), so
    # "required" and named calls are read back by that parser, not as a JSON array.
    tagged: bool = False


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def prepare_chat(
    body: dict, parsed: Any, *, auto_tools: bool, tool_parser: str | None = None,
    strict_tools: bool = True,
) -> ChatExtras:  # fmt: skip
    """Read the chat body's tool fields, chat_template_kwargs, reasoning_effort and
    include_reasoning;
    add the tool constraint to ``parsed.params_kwargs``; copy the messages' tool fields.
    ``auto_tools``: the server has --enable-auto-tool-choice and a parser, ``tool_parser``
    (its name); with ``strict_tools`` (``VLLM_ENFORCE_STRICT_TOOL_CALLING``, vLLM's
    default on) a parser with a structural tag constrains the calls by it (tool_tags.py)
    instead of by tools.py's JSON schema, as vLLM 0.32 does."""
    req = parse_tools(body)
    tag = None
    if auto_tools and strict_tools:
        user = "structured_outputs" in parsed.params_kwargs
        tag = tool_structural_tag(tool_parser, req, user_constraint=user)
    if req.choice == "auto" and not auto_tools:
        raise bad('"auto" tool choice requires --enable-auto-tool-choice and'
                  " --tool-call-parser to be set (tool_choice defaults to \"auto\" when"
                  ' tools are given; send "none", "required" or a named function)',
                  "tool_choice")  # fmt: skip
    if req.choice in ("required", "named"):
        if "structured_outputs" in parsed.params_kwargs:
            raise bad("use either a structured-output constraint (response_format,"
                      ' structured_outputs) or tool_choice "required" / a named function,'
                      " not both", "tool_choice")  # fmt: skip
        schema = tool_schema(req) if tag is None else None
        if schema is not None:
            parsed.params_kwargs["structured_outputs"] = StructuredOutputsParams(json=schema)
    if tag is not None:
        so = StructuredOutputsParams(structural_tag=json.dumps(tag))
        parsed.params_kwargs["structured_outputs"] = so
    extend_messages(parsed.messages, body["messages"])
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    include = body.get("include_reasoning", True)
    if not isinstance(include, bool):
        raise bad("'include_reasoning' must be a boolean", "include_reasoning")
    kwargs: dict[str, Any] = dict(ctk or {})
    if req.tools is not None:
        kwargs["tools"] = req.tools
    effort = body.get("reasoning_effort")
    if effort is not None:  # vLLM 0.32: the template's reasoning_effort and enable_thinking
        if effort not in REASONING_EFFORTS:
            raise bad(f"'reasoning_effort' must be one of {list(REASONING_EFFORTS)}, got"
                      f" {effort!r}", "reasoning_effort")  # fmt: skip
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    return ChatExtras(req, kwargs, include, tagged=tag is not None)


def build_rules(
    extras: ChatExtras, *, tool_parser: str | None, reasoning_parser: str | None, prompt: str
) -> OutputRules:
    """The rules for one chat request: the server's parser names, the request's tools,
    and the rendered prompt (whose think tags may already end the reasoning)."""
    reasoning = None
    if reasoning_parser is not None:
        parser = REASONING_PARSERS[reasoning_parser]()
        if parser.thinking(extras.template_kwargs) and not parser.reasoning_ended_in(prompt):
            reasoning = parser
    req = extras.tools
    tools: ToolParser | None = None
    if extras.tagged and tool_parser is not None:  # the calls are the parser's envelopes
        tools = TOOL_PARSERS[tool_parser]()
    elif req.choice == "named":
        assert req.function is not None
        tools = NamedFunctionParser(req.function)
    elif req.choice == "required":
        tools = RequiredParser()
    elif req.choice == "auto" and tool_parser is not None:
        tools = TOOL_PARSERS[tool_parser]()
    return OutputRules(
        reasoning=reasoning,
        report_reasoning=reasoning_parser is not None,
        include_reasoning=extras.include_reasoning,
        tools=tools,
        mode=req.choice,
        parallel=req.parallel,
    )
