"""pagedjax: vLLM's PagedAttention serving engine in JAX/Pallas.

``from pagedjax import LLM, SamplingParams`` mirrors ``from vllm import LLM, SamplingParams``.
The names load lazily (PEP 562), so importing a submodule such as ``pagedjax.memory``
does not pull in the model, Flax and the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "pagedjax.engine",
    "LLMEngine": "pagedjax.engine",
    "RequestOutput": "pagedjax.engine",
    "CompletionOutput": "pagedjax.engine",
    "SamplingParams": "pagedjax.sampling",
    "BeamSearchParams": "pagedjax.sampling",
}

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]

if TYPE_CHECKING:
    from pagedjax.engine import LLM, CompletionOutput, LLMEngine, RequestOutput
    from pagedjax.sampling import BeamSearchParams, SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
