"""Teacher-forced scoring: what a model predicts at every position of a fixed token
sequence, from pagedjax's engine or from a transformers model, in one shape.

Contract: a *scorer* maps token ids ``int[N]`` to ``TokenScores`` for positions 1..N-1
(position 0 has no context). The sequence is cut into windows of ``window`` tokens, each
scored from a fresh context, so both sides of a comparison see exactly the same
contexts; the first token of every window is context only. The engine scorer uses the
public prompt-logprobs path (``SamplingParams(prompt_logprobs=k)``), so what is measured
is what a user of ``LLM`` gets: paged KV, chunked prefill, the attention backend, and
whatever a quantization or KV-cache option changes.

Why top-k and not full distributions: the engine returns the actual token's log-prob
and the k most likely tokens (vLLM's contract, k <= max_logprobs), never a whole
vocabulary row per token; metrics that need distributions (KL) work from the top-k of
both sides (metrics.py says how, and what that bounds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

DEFAULT_WINDOW = 512
DEFAULT_TOP_K = 20  # vLLM's (and the engine's) default max_logprobs


@dataclasses.dataclass(frozen=True)
class TokenScores:
    """Predictions at the scored positions of one token sequence.

    target_ids: int64[M], the token that actually came next at each scored position.
    target_logprobs: float64[M], its log-probability under the model.
    top_ids: int64[M, k], the k most likely tokens, most likely first.
    top_logprobs: float64[M, k], their log-probabilities.
    """

    target_ids: np.ndarray
    target_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def __post_init__(self) -> None:
        m = self.target_ids.shape[0]
        if self.target_logprobs.shape != (m,) or self.top_ids.shape[0] != m:
            raise ValueError("TokenScores arrays disagree on the number of positions")
        if self.top_ids.shape != self.top_logprobs.shape:
            raise ValueError("top_ids and top_logprobs differ in shape")

    @property
    def num_positions(self) -> int:
        return int(self.target_ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.top_ids.shape[1])

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per scored token (nats)."""
        return float(-self.target_logprobs.mean())

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll))


class Scorer(Protocol):
    def score(self, ids: Sequence[int], window: int, top_k: int) -> TokenScores: ...


def windows(ids: Sequence[int], window: int) -> list[list[int]]:
    """Consecutive non-overlapping windows of ``window`` tokens (the last may be shorter;
    a last window of one token has nothing to score and is dropped)."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(ids)}")
    out = [ids[i : i + window] for i in range(0, len(ids), window)]
    return [w for w in out if len(w) >= 2]


def _concat(parts: list[TokenScores]) -> TokenScores:
    return TokenScores(
        *(
            np.concatenate([getattr(p, f.name) for p in parts])
            for f in dataclasses.fields(TokenScores)
        )
    )


class EngineScorer:
    """Scores through ``LLM.generate`` with prompt logprobs (one request per window, all
    submitted together, so the engine batches them as it would any prompts).

    llm: a pagedjax ``LLM``; its ``max_model_len`` must exceed the window and its
    ``max_logprobs`` must be >= top_k.
    """

    def __init__(self, llm: Any):
        self.llm = llm

    def score(
        self, ids: Sequence[int], window: int = DEFAULT_WINDOW, top_k: int = DEFAULT_TOP_K
    ) -> TokenScores:
        from pagedjax.sampling import SamplingParams

        chunks = windows(ids, window)
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top_k)
        outs = self.llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
        parts = []
        for chunk, out in zip(chunks, outs, strict=True):
            tgt, tgt_lp, top, top_lp = [], [], [], []
            for pos in range(1, len(chunk)):
                entry = out.prompt_logprobs[pos]
                actual = chunk[pos]
                ranked = sorted(
                    (
                        (lp.rank, tid, lp.logprob)
                        for tid, lp in entry.items()
                        if lp.rank is not None and lp.rank <= top_k
                    )
                )
                if len(ranked) != top_k:
                    raise RuntimeError(
                        f"engine returned {len(ranked)} ranked logprobs at position {pos},"
                        f" expected top_k={top_k}"
                    )
                tgt.append(actual)
                tgt_lp.append(entry[actual].logprob)
                top.append([t for _, t, _ in ranked])
                top_lp.append([lp for _, _, lp in ranked])
            parts.append(
                TokenScores(
                    np.asarray(tgt, np.int64),
                    np.asarray(tgt_lp, np.float64),
                    np.asarray(top, np.int64),
                    np.asarray(top_lp, np.float64),
                )
            )
        return _concat(parts)


class HFScorer:
    """Scores with a transformers causal LM (one forward per window, fp32 log-softmax)."""

    def __init__(self, model: Any):
        self.model = model

    def score(
        self, ids: Sequence[int], window: int = DEFAULT_WINDOW, top_k: int = DEFAULT_TOP_K
    ) -> TokenScores:
        import torch

        parts = []
        for chunk in windows(ids, window):
            with torch.no_grad():
                logits = self.model(torch.tensor([chunk])).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(chunk[1:])
            top_lp, top = torch.topk(logp, top_k, dim=-1)
            parts.append(
                TokenScores(
                    target.numpy().astype(np.int64),
                    logp.gather(1, target[:, None])[:, 0].double().numpy(),
                    top.numpy().astype(np.int64),
                    top_lp.double().numpy(),
                )
            )
        return _concat(parts)


def as_scorer(model: Any) -> Scorer:
    """A scorer for a pagedjax LLM, a transformers model, or something already a scorer."""
    if hasattr(model, "score"):
        return model
    if hasattr(model, "llm_engine"):
        return EngineScorer(model)
    if hasattr(model, "generate") and hasattr(model, "config"):  # a transformers model
        return HFScorer(model)
    raise TypeError(
        f"cannot score with {type(model).__name__}: expected an LLM, a"
        " transformers model or an object with .score()"
    )
