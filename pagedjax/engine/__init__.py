"""The serving engine: model runner (buckets, donation), LLMEngine (step loop) and LLM API."""

from pagedjax.engine.beam_group import BeamSearchOutput, BeamSearchSequence
from pagedjax.engine.llm import LLM
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "CompletionOutput",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
]
