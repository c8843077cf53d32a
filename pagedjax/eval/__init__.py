"""Quality checks that need real weights: perplexity on a fixed public-domain text,
teacher-forced top-1 agreement and KL against a reference, greedy chat answers against
transformers. ``compare(reference, candidate, text)`` is the reusable entry point
(docs/real_model.md)."""

from pagedjax.eval.chat import (
    QUESTIONS,
    compare_answers,
    engine_greedy_answers,
    hf_greedy_answers,
    hf_prompt_ids,
)
from pagedjax.eval.compare import compare, score_text, tokenize_text
from pagedjax.eval.hf_reference import load_hf_gguf, load_hf_gguf_tokenizer
from pagedjax.eval.metrics import binned_kl, quality_report, top1_agreement
from pagedjax.eval.scoring import EngineScorer, HFScorer, TokenScores, as_scorer, windows
from pagedjax.eval.texts import TEXTS, load_text, text_source

__all__ = [
    "QUESTIONS",
    "TEXTS",
    "EngineScorer",
    "HFScorer",
    "TokenScores",
    "as_scorer",
    "binned_kl",
    "compare",
    "compare_answers",
    "engine_greedy_answers",
    "hf_greedy_answers",
    "hf_prompt_ids",
    "load_hf_gguf",
    "load_hf_gguf_tokenizer",
    "load_text",
    "quality_report",
    "score_text",
    "text_source",
    "tokenize_text",
    "top1_agreement",
    "windows",
]
