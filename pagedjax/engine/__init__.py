"""The serving engine core: model runner (buckets, donation), device state, scheduler
driving and LLMEngine (the step loop). ``LLM`` and ``AsyncLLMEngine`` are entry points
(``pagedjax.entrypoints``)."""

from pagedjax.engine.beam_group import BeamSearchOutput, BeamSearchSequence
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = [
    "BeamSearchOutput",
    "BeamSearchSequence",
    "CompletionOutput",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
]
