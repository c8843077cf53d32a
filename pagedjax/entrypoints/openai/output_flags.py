"""Server flags for structured outputs, tool calling and reasoning (vLLM 0.32's names).

    --structured-outputs-config '{"backend": "xgrammar", ...}'   the engine's config
    --enable-auto-tool-choice --tool-call-parser hermes|llama3_json
    --reasoning-parser deepseek_r1|qwen3

``--structured-outputs-config`` takes vLLM's StructuredOutputsConfig keys (below; an
unknown key or a wrong type exits naming it) and reaches the engine as
``LLM(structured_outputs_config={...})``; ``--reasoning-parser`` is also written into
it as ``reasoning_parser``, as vLLM does, so the engine can start a constraint after the
reasoning (``enable_in_reasoning``, default false). An engine without that argument
(before issue 33's engine work) gets nothing when neither flag asks for it, and a clear
exit when ``--structured-outputs-config`` is given.
"""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any

from pagedjax.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedjax.entrypoints.openai.tool_parsers import TOOL_PARSERS

BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
# vLLM 0.32's StructuredOutputsConfig fields and their types (the engine checks values).
CONFIG_KEYS: dict[str, type | tuple[type, ...]] = {
    "backend": str,
    "disable_fallback": bool,
    "disable_any_whitespace": bool,
    "disable_additional_properties": bool,
    "reasoning_parser": str,
    "enable_in_reasoning": bool,
    # pagedjax's own (config.StructuredOutputsConfig): compilation time limit, cache size,
    # jump-forward decoding, the device-side token FSM
    "compile_timeout_s": (int, float),
    "cache_size": int,
    "jump_forward": bool,
    "device_fsm": bool,
    "device_fsm_max_bytes": int,
}


def structured_outputs_config(text: str) -> dict[str, Any]:
    """--structured-outputs-config's value: a JSON object of vLLM's keys, checked."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    for key, v in value.items():
        if key not in CONFIG_KEYS:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r} (vLLM's StructuredOutputsConfig keys: {list(CONFIG_KEYS)};"
                " reasoning_parser_plugin is not built)"
            )
        want = CONFIG_KEYS[key]
        if isinstance(v, bool) != (want is bool) or not isinstance(v, want):
            raise argparse.ArgumentTypeError(f"{key}: wrong type, got {v!r}")
    if value.get("backend", "auto") not in BACKENDS:
        raise argparse.ArgumentTypeError(
            f"backend must be one of {list(BACKENDS)}, got {value['backend']!r}"
        )
    if value.get("reasoning_parser", "") not in ("", *REASONING_PARSERS):
        raise argparse.ArgumentTypeError(
            f"reasoning_parser must be one of {list(REASONING_PARSERS)}"
        )
    return value


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--structured-outputs-config",
        type=structured_outputs_config,
        default=None,
        help='structured outputs, JSON: \'{"backend": "xgrammar"}\'; vLLM\'s keys'
        f" {list(CONFIG_KEYS)} (docs/structured_outputs.md)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let the model call tools on its own (tool_choice 'auto'); needs --tool-call-parser",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how calls are read from the model's text (for tool_choice 'auto')",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split the model's thinking into the message's 'reasoning' field",
    )


def engine_accepts_config() -> bool:
    """Whether LLM(...) takes structured_outputs_config (issue 33's engine work)."""
    from pagedjax.entrypoints.llm import LLM

    return "structured_outputs_config" in inspect.signature(LLM.__init__).parameters


def check_output_args(args: argparse.Namespace) -> None:
    """SystemExit for a combination that cannot be served."""
    if getattr(args, "enable_auto_tool_choice", False) and args.tool_call_parser is None:
        raise SystemExit("error: --enable-auto-tool-choice needs --tool-call-parser"
                         f" ({', '.join(sorted(TOOL_PARSERS))})")  # fmt: skip
    if getattr(args, "structured_outputs_config", None) is not None and not (
        engine_accepts_config()
    ):
        raise SystemExit("error: --structured-outputs-config needs an engine with structured"
                         " outputs (LLM(structured_outputs_config=...)), which this build"
                         " does not have yet")  # fmt: skip


def output_llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """{"structured_outputs_config": {...}} for LLM(...), when asked for and accepted."""
    config = dict(getattr(args, "structured_outputs_config", None) or {})
    if getattr(args, "reasoning_parser", None):
        config.setdefault("reasoning_parser", args.reasoning_parser)
    if not config or not engine_accepts_config():
        return {}
    return {"structured_outputs_config": config}
