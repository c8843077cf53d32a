"""``compare(reference, candidate, text)``: one call that scores a fixed text with two
models and reports perplexity, top-1 agreement and KL (the harness the quantization,
KV-cache quantization and speculative-decoding work report their deltas with).

Both sides score the same token ids (the text is tokenized once, by the candidate's
tokenizer unless ids are given) in the same windows (scoring.py), so every difference
is the models' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedjax.eval.metrics import quality_report
from pagedjax.eval.scoring import DEFAULT_TOP_K, DEFAULT_WINDOW, TokenScores, as_scorer


def tokenize_text(model: Any, text: str) -> list[int]:
    """The text's ids with ``model``'s tokenizer (a pagedjax LLM or a transformers
    tokenizer), without special tokens: perplexity is over the text alone."""
    tok = model.get_tokenizer() if hasattr(model, "get_tokenizer") else model
    return list(tok.encode(text, add_special_tokens=False))


def score_text(
    model: Any,
    text: str | Sequence[int],
    *,
    window: int = DEFAULT_WINDOW,
    top_k: int = DEFAULT_TOP_K,
    max_tokens: int | None = None,
) -> TokenScores:
    """Teacher-forced scores of ``text`` (a str, tokenized by ``model``, or ids) by
    ``model`` (a pagedjax LLM, a transformers model or a scorer); ``max_tokens`` keeps
    the first tokens only."""
    ids = tokenize_text(model, text) if isinstance(text, str) else list(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return as_scorer(model).score(ids, window, top_k)


def compare(
    reference: Any,
    candidate: Any,
    text: str | Sequence[int],
    *,
    window: int = DEFAULT_WINDOW,
    top_k: int = DEFAULT_TOP_K,
    max_tokens: int | None = None,
) -> dict[str, float]:
    """Quality of ``candidate`` against ``reference`` on ``text``.

    reference, candidate: a pagedjax ``LLM``, a transformers causal LM, or any object
    with ``score(ids, window, top_k) -> TokenScores``. text: a str (tokenized with the
    candidate's tokenizer, or the reference's when the candidate has none) or token ids.
    window: tokens per independently scored window (each LLM needs max_model_len above
    it). top_k: log-probs kept per position (<= the LLMs' max_logprobs).
    Returns metrics.quality_report's dict: num_tokens, ppl_reference, ppl_candidate,
    ppl_rel_diff, nll_diff, top1_agreement, kl, kl_max, kl_mass.
    """
    if isinstance(text, str):
        owner = candidate if hasattr(candidate, "get_tokenizer") else reference
        if not hasattr(owner, "get_tokenizer"):
            raise ValueError("neither model has a tokenizer: pass token ids")
        text = tokenize_text(owner, text)
    ids = list(text)[:max_tokens] if max_tokens is not None else list(text)
    ref = as_scorer(reference).score(ids, window, top_k)
    cand = as_scorer(candidate).score(ids, window, top_k)
    return quality_report(ref, cand)
