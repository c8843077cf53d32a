"""Tool-call parsers: the model's text -> OpenAI ``tool_calls`` (``--tool-call-parser``).

``TOOL_PARSERS`` maps vLLM's names to parsers; base.py states the contract (monotonic
partial parses, so streamed deltas add up to the non-streamed answer). ``forced.py``
reads the outputs of ``tool_choice="required"`` and of a named function.
"""

from __future__ import annotations

from pagedjax.entrypoints.openai.tool_parsers.base import Call, ToolParse, ToolParser
from pagedjax.entrypoints.openai.tool_parsers.forced import NamedFunctionParser, RequiredParser
from pagedjax.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedjax.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

# vLLM's names; vLLM registers the Llama JSON parser as both llama3_json and llama4_json.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "Call",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "NamedFunctionParser",
    "RequiredParser",
    "ToolParse",
    "ToolParser",
]
