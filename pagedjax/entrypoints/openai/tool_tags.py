"""vLLM 0.32's default tool-call constraint for parsers with a structural tag (hermes).

With ``--enable-auto-tool-choice --tool-call-parser hermes`` vLLM 0.32 does not constrain
``tool_choice="required"`` / a named function with ``get_json_schema_from_tools``' JSON
array (tools.py); its parser's ``structural_tag_model`` ("hermes") turns that off
(``supports_required_and_named=False`` while ``VLLM_ENFORCE_STRICT_TOOL_CALLING`` is
true, its default) and ``DelegatingParser._apply_structural_tag`` sets an xgrammar
structural tag instead: the model writes ``<tool_call>`` envelopes, which the hermes
parser reads back (chat_output.py). ``tool_structural_tag`` builds that tag as vLLM's
``get_hermes_structural_tag`` dumps it (``StructuralTag.model_dump()``), at vLLM's
default ``--tool-strict-level auto``:

- each tool gives two tags, ``<tool_call>\\n{"name": "<name>", "arguments": `` ...
  ``}\\n</tool_call>`` and the same without the newlines; their content is the tool's
  ``parameters`` schema only when the tool says ``"strict": true`` (a strict tool without
  parameters: any JSON), otherwise any JSON (``json_schema: true``);
- "required": ``tags_with_separator`` (no separator, at least one call); a named
  function: the same over that function's tags, stopping after the first call; "auto":
  ``triggered_tags`` on ``<tool_call>``, but only when some tool says ``"strict": true``
  (else no tag: free text, as before);
- ``parallel_tool_calls: false`` stops every call list after its first call.

The same variable switches it off here: ``VLLM_ENFORCE_STRICT_TOOL_CALLING=0`` (vLLM's
reading: "1" or "true", any case, is on; unset is on) gives the JSON-schema path of
tools.py, which is also what pagedjax does without a tool parser (where vLLM refuses
"required" and named functions with a 400). ``llama3_json`` (vLLM's xgrammar builtin
"llama" tag) is not built: that parser keeps the JSON-schema path. vLLM's
``--tool-strict-level function|parameter`` is not built (auto only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pagedjax.entrypoints.openai.protocol import bad
from pagedjax.entrypoints.openai.tools import ToolRequest

STRICT_ENV = "VLLM_ENFORCE_STRICT_TOOL_CALLING"
TAG_PARSERS = ("hermes",)  # parsers whose vLLM class sets structural_tag_model (built here)
_FORMATS = (("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>"))


def strict_tool_calling(environ: Mapping[str, str] = os.environ) -> bool:
    """vLLM's ``VLLM_ENFORCE_STRICT_TOOL_CALLING``: true unless set to something other than
    "1" / "true" (any case)."""
    return environ.get(STRICT_ENV, "True").lower() in ("true", "1")


def _content(fn: dict) -> dict[str, Any]:
    # vLLM's get_function_parameters after resolve_tool_strictness pinned "strict".
    schema: Any = True
    if fn.get("strict") is True and fn.get("parameters") is not None:
        schema = fn["parameters"]
    return {"type": "json_schema", "json_schema": schema, "style": "json",
            "any_order": False, "max_whitespace_cnt": None, "excludes": []}  # fmt: skip


def tool_structural_tag(
    parser: str | None, req: ToolRequest, user_constraint: bool = False
) -> dict | None:
    """The structural tag vLLM 0.32 sets for this request under ``parser`` (module
    docstring), as a dict for ``StructuredOutputsParams(structural_tag=json.dumps(..))``;
    None when vLLM sets none (another parser, "none", or "auto" without a strict tool).
    ``user_constraint``: the request has response_format / structured_outputs; with
    "auto" and a tag vLLM joins the two (``OrFormat``), which is not built here: a 400."""
    if parser not in TAG_PARSERS or req.choice == "none" or not req.tools:
        return None
    fns = [t["function"] for t in req.tools]
    # vLLM: parallel_tool_calls false raises the strict level to "function" (a tag for
    # every request with tools), except "auto" beside the user's own constraint.
    level_function = not req.parallel and not (req.choice == "auto" and user_constraint)
    if req.choice == "auto" and not level_function and not any(f.get("strict") is True
                                                               for f in fns):  # fmt: skip
        return None  # resolve_tool_strictness: no tag at strict level auto
    if req.choice == "auto" and user_constraint:
        raise bad("tool_choice \"auto\" with a strict tool and a response_format /"
                  " structured_outputs constraint (vLLM joins the two) is not supported",
                  "tool_choice")  # fmt: skip
    if req.choice == "named":
        fns = [f for f in fns if f["name"] == req.function]
    tags = [
        {"type": "tag", "begin": f'{begin}{{"name": "{f["name"]}", "arguments": ',
         "content": _content(f), "end": end}
        for f in fns
        for begin, end in _FORMATS
    ]  # fmt: skip
    single = req.choice == "named" or not req.parallel
    if req.choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
               "at_least_one": False, "stop_after_first": single, "excludes": []}  # fmt: skip
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "",
               "at_least_one": True, "stop_after_first": single}  # fmt: skip
    return {"type": "structural_tag", "format": fmt}


__all__ = ["STRICT_ENV", "TAG_PARSERS", "strict_tool_calling", "tool_structural_tag"]
