"""Greedy chat answers to a fixed list of questions, from pagedjax and from transformers'
``generate``, and their token-by-token comparison.

Why a tie rule: two fp32 implementations of the same weights differ in the last bits of
their logits. Where the reference's two best logits are closer than ``tie_gap`` the
greedy choice is a coin toss between equally right answers, so a comparison that first
differs at such a step stops there and is counted (``tie_stopped``), not failed
(docs/DESIGN's rule for random models, applied to the real one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

# 20 short, fixed questions across facts, arithmetic, language, code and advice.
QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for 'happy'.",
    "Write a Python function that returns the square of a number.",
    "How many days are there in a leap year?",
    "What is the largest planet in our solar system?",
    "Suggest a name for a pet goldfish.",
    "Why is the sky blue?",
    "What does CPU stand for?",
    "List two benefits of regular exercise.",
    "What is the opposite of 'ancient'?",
    "Finish the sentence: The early bird...",
    "How do I boil an egg?",
    "What is the square root of 81?",
)


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def engine_greedy_answers(
    llm: Any, questions: Sequence[str], max_tokens: int, use_tqdm: bool = False
) -> list[list[int]]:
    """pagedjax's greedy answers (all questions in one batch), as token ids; an answer
    that stopped on EOS ends with the EOS id, as transformers' does."""
    from pagedjax.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.chat([conversation(q) for q in questions], params, use_tqdm=use_tqdm)
    return [list(o.outputs[0].token_ids) for o in outs]


@dataclasses.dataclass
class ReferenceAnswer:
    """transformers' greedy answer: token_ids (EOS included when it stopped) and, per
    generated token, the gap between the two best logits at that step."""

    token_ids: list[int]
    top2_gaps: list[float]


def hf_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The prompt transformers sees: the chat template rendered as text and tokenized
    without special tokens (the template writes them), as pagedjax's LLM.chat does."""
    text = tokenizer.apply_chat_template(
        conversation(question), tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def hf_greedy_answers(
    model: Any, tokenizer: Any, questions: Sequence[str], max_tokens: int
) -> list[ReferenceAnswer]:
    """transformers' ``generate(do_sample=False)``, one question at a time (no padding,
    so nothing but the weights and the arithmetic can differ)."""
    import torch

    out = []
    for q in questions:
        ids = torch.tensor([hf_prompt_ids(tokenizer, q)])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
        new = gen.sequences[0, ids.shape[1] :].tolist()
        gaps = []
        for step_logits in gen.logits[: len(new)]:
            top2 = torch.topk(step_logits[0].float(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        out.append(ReferenceAnswer(new, gaps))
    return out


def compare_answers(
    reference: Sequence[ReferenceAnswer],
    candidate: Sequence[Sequence[int]],
    tie_gap: float = 1e-4,
) -> dict[str, Any]:
    """Token-by-token comparison. Returns equal (answers identical), tie_stopped
    (answers that first differ at a reference near-tie), mismatched (indices of the
    others) and first_diff (index -> first differing position) for all that differ."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference answers, {len(candidate)} candidates")
    equal, tie_stopped, mismatched, first_diff = 0, [], [], {}
    for i, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        cand = list(cand)
        if ref.token_ids == cand:
            equal += 1
            continue
        pos = next(
            (j for j, (a, b) in enumerate(zip(ref.token_ids, cand, strict=False)) if a != b),
            min(len(ref.token_ids), len(cand)),
        )
        first_diff[i] = pos
        if pos < len(ref.top2_gaps) and ref.top2_gaps[pos] < tie_gap:
            tie_stopped.append(i)
        else:
            mismatched.append(i)
    return {
        "equal": equal,
        "tie_stopped": tie_stopped,
        "mismatched": mismatched,
        "first_diff": first_diff,
    }
