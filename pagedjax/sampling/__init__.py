"""Sampling: user options (SamplingParams), their per-row arrays, and the jitted sampler."""

from pagedjax.sampling.params import (
    SAMPLING_EPS,
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedjax.sampling.sampler import (
    DEFAULT_MAX_LOGPROBS,
    PromptLogprobs,
    SamplerOutput,
    apply_penalties,
    output_for,
    process_logits,
    processed_probs,
    prompt_logprobs,
    row_keys,
    sample,
    token_counts,
)
from pagedjax.sampling.tensors import SamplingTensors, TokenHistory

__all__ = [
    "DEFAULT_MAX_LOGPROBS",
    "SAMPLING_EPS",
    "BeamSearchParams",
    "PromptLogprobs",
    "SamplerOutput",
    "SamplingParams",
    "SamplingTensors",
    "StructuredOutputsParams",
    "TokenHistory",
    "apply_penalties",
    "output_for",
    "process_logits",
    "processed_probs",
    "prompt_logprobs",
    "row_keys",
    "sample",
    "token_counts",
]
