"""pagedjax: vLLM's PagedAttention serving engine in JAX/Pallas.

``from pagedjax import LLM, SamplingParams`` mirrors ``from vllm import LLM, SamplingParams``.
For simulated ablations: the paper's named systems (``build_system``, ``SYSTEMS``), cost
models by GPU and model name (``make_cost_model``), Azure-format traces (``load_trace``)
and one call to simulate a workload under a system (``simulate_system``); README
"Ablations". The names load lazily (PEP 562), so importing a submodule such as
``pagedjax.memory`` (or the simulator names) does not pull in the model, Flax and the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "pagedjax.entrypoints.llm",
    "LLMEngine": "pagedjax.engine",
    "RequestOutput": "pagedjax.engine",
    "CompletionOutput": "pagedjax.engine",
    "SamplingParams": "pagedjax.sampling",
    "BeamSearchParams": "pagedjax.sampling",
    "StructuredOutputsParams": "pagedjax.sampling",
    "SYSTEMS": "pagedjax.simulator.systems",
    "build_system": "pagedjax.simulator.systems",
    "make_cost_model": "pagedjax.simulator.systems",
    "simulate_system": "pagedjax.simulator.systems",
    "load_trace": "pagedjax.workloads",
    "make_workload": "pagedjax.workloads",
    "Workload": "pagedjax.workloads",
}

__all__ = [
    "LLM",
    "SYSTEMS",
    "BeamSearchParams",
    "CompletionOutput",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "Workload",
    "build_system",
    "load_trace",
    "make_cost_model",
    "make_workload",
    "simulate_system",
]

if TYPE_CHECKING:
    from pagedjax.engine import CompletionOutput, LLMEngine, RequestOutput
    from pagedjax.entrypoints.llm import LLM
    from pagedjax.sampling import BeamSearchParams, SamplingParams, StructuredOutputsParams
    from pagedjax.simulator.systems import (
        SYSTEMS,
        build_system,
        make_cost_model,
        simulate_system,
    )
    from pagedjax.workloads import Workload, load_trace, make_workload


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
