"""What a StructuredOutputsParams asks for, in the forms the backends take.

Backend-neutral helpers: the JSON schema as a dict (``additionalProperties: false`` added
where asked), choices as an EBNF grammar, EBNF-or-Lark detection, and vLLM's list of
JSON-schema keywords xgrammar does not enforce (its ``auto`` rule sends such a schema to
llguidance instead of letting xgrammar silently ignore the keyword).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from pagedjax.sampling.params import StructuredOutputsParams

# String "format"s xgrammar enforces; any other is a keyword it would ignore.
XGRAMMAR_STRING_FORMATS = frozenset(
    ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
     "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
)  # fmt: skip


def schema_dict(p: StructuredOutputsParams, disable_additional_properties: bool) -> dict:
    """The request's JSON schema (json, or {"type": "object"} for json_object) as a dict;
    with ``disable_additional_properties`` every object schema that lists ``properties`` (or
    ``patternProperties``) without an explicit ``additionalProperties`` gets ``false``
    (vLLM's option and walk: ``_close_objects``). ValueError if not JSON."""
    if p.json_object:
        schema: Any = {"type": "object"}
    elif isinstance(p.json, str):
        try:
            schema = json.loads(p.json)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
    else:
        schema = copy.deepcopy(p.json)
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON object schema, got {schema!r}")
    if disable_additional_properties:
        _close_objects(schema)
    return schema


# vLLM's walk for disable_additional_properties (v1/structured_output/backend_guidance.py,
# _walk_json_for_additional_properties): only schema positions are visited (never data
# such as enum / const / default values, or a property that happens to be named
# "properties"), and only objects that list properties or patternProperties are closed:
# a bare {"type": "object"} (json_object) keeps allowing any object.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas", "dependencies")  # fmt: skip
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
               "additionalItems", "unevaluatedItems", "not", "if", "then", "else",
               "contentSchema", "items", "prefixItems", "allOf", "anyOf", "oneOf")  # fmt: skip


def _close_objects(node: Any) -> None:
    if isinstance(node, dict):
        for key in _SCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                for sub in value.values():
                    if isinstance(sub, dict):
                        _close_objects(sub)
        for key in _SUBSCHEMAS:
            value = node.get(key)
            if isinstance(value, (dict, list)):
                _close_objects(value)
        if "additionalProperties" not in node and (
            isinstance(node.get("properties"), dict)
            or isinstance(node.get("patternProperties"), dict)
        ):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for item in node:
            if isinstance(item, dict):
                _close_objects(item)


def xgrammar_unsupported(schema: Any) -> str | None:
    """The first JSON-schema keyword xgrammar would not enforce (vLLM's list), or None."""
    if isinstance(schema, list):
        return next((k for k in map(xgrammar_unsupported, schema) if k), None)
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if kind in ("integer", "number") and "multipleOf" in schema:
        return "multipleOf"
    if kind == "array":
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):
            if key in schema:
                return key
    if kind == "string" and "format" in schema and schema["format"] not in XGRAMMAR_STRING_FORMATS:
        return f"format {schema['format']!r}"
    if kind == "object":
        for key in ("patternProperties", "propertyNames"):
            if key in schema:
                return key
    return next((k for k in map(xgrammar_unsupported, schema.values()) if k), None)


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (vLLM's choice_as_grammar)."""

    def lit(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    return "root ::= " + " | ".join(lit(c) for c in choices)


def looks_like_lark(grammar: str) -> bool:
    """True for a Lark grammar (rules ``name: ...``), False for GBNF / EBNF (``::=``)."""
    return "::=" not in grammar


def constraint_text(p: StructuredOutputsParams) -> str:
    """A canonical text of the constraint and its options: the compile cache's key."""
    value = getattr(p, p.kind)
    if isinstance(value, dict):
        value = json.dumps(value, sort_keys=True)
    opts = (p.disable_any_whitespace, p.disable_additional_properties, p.whitespace_pattern)
    return json.dumps([p.kind, value if not isinstance(value, tuple) else list(value), opts])


__all__ = [
    "choice_ebnf",
    "constraint_text",
    "looks_like_lark",
    "schema_dict",
    "xgrammar_unsupported",
]
