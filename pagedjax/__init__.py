"""pagedjax: vLLM's PagedAttention serving engine in JAX/Pallas.

``from pagedjax import LLM, SamplingParams`` mirrors ``from vllm import LLM, SamplingParams``.
"""

from pagedjax.engine import LLM, CompletionOutput, LLMEngine, RequestOutput
from pagedjax.sampling import BeamSearchParams, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
