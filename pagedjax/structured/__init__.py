"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar, ...)
compiled once per request by a grammar backend (xgrammar, llguidance), and a per-sequence
matcher that advances on the host with each accepted token and fills the packed token
bitmask the jitted sampler applies (docs/structured_outputs.md)."""

from pagedjax.structured.manager import (
    BACKENDS,
    DEAD_END_REASON,
    Guide,
    StructuredOutputManager,
    missing_backend_message,
)

__all__ = [
    "BACKENDS",
    "DEAD_END_REASON",
    "Guide",
    "StructuredOutputManager",
    "missing_backend_message",
]
