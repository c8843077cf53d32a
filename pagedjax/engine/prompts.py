"""Prompts in, checked token ids out; prompt logprobs back to the request.

Checks run before a request touches any engine state, so a refused request changes
nothing (``LLMEngine.add_request`` and ``beams.beam_search`` both call them first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedjax.engine.outputs import Logprob
from pagedjax.memory.block_table import blocks_for
from pagedjax.sampling import BeamSearchParams, SamplingParams
from pagedjax.sampling.tensors import MAX_LOGIT_BIAS_ENTRIES


def tokenize_prompt(tokenizer: Any, vocab_size: int, prompt: Any) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: text, token ids, or vLLM's
    {"prompt_token_ids": [...]} / {"prompt": "..."}. Raises TypeError / ValueError."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), check_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, Sequence | np.ndarray):
        return None, check_ids(prompt, vocab_size)
    raise TypeError(f"prompt must be a str, token ids or a prompt dict, got {prompt!r}")


def check_ids(ids: Any, vocab_size: int) -> list[int]:
    """ids as a list of Python ints in [0, vocab_size); ValueError otherwise."""
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int | np.integer):
            raise ValueError(f"prompt token ids must be ints, got {i!r}")
        if not 0 <= i < vocab_size:
            raise ValueError(f"prompt token id {i} outside the vocabulary [0, {vocab_size})")
        out.append(int(i))
    return out


def check_request_args(request_id: Any, params: Any, in_use: Any) -> SamplingParams:
    """The checks of ``add_request``'s arguments every engine client makes before any
    work: ``params`` (None: the defaults) is SamplingParams (beam search has its own
    entry point), ``request_id`` a str not in ``in_use``. Returns the params."""
    params = SamplingParams() if params is None else params
    if isinstance(params, BeamSearchParams):
        raise TypeError("BeamSearchParams go to LLM.beam_search (or engine.beams.beam_search)")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {request_id!r}")
    if request_id in in_use:
        raise ValueError(f"request id {request_id!r} is already in use")
    return params


def check_request(
    ids: list[int],
    params: SamplingParams,
    *,
    sched_limits: Any,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    watermark_blocks: int,
    max_logprobs: int,
    vocab_size: int,
) -> None:
    """ValueError if the request can never run: empty, over the prompt limit (max_model_len,
    or the token budget when prompts are not chunked), more blocks than the pool can ever
    give, logprobs over max_logprobs, stop ids outside the vocabulary."""
    if not ids:
        raise ValueError("the prompt is empty")
    limit = sched_limits.prompt_limit
    if len(ids) > limit:
        raise ValueError(
            f"prompt has {len(ids)} tokens, longer than the limit {limit}"
            f" (max_model_len={max_model_len}"
            + (
                ""
                if sched_limits.chunked_prefill
                else f", or max_num_batched_tokens={sched_limits.max_num_batched_tokens}:"
                f" {sched_limits.mode} mode does not chunk prompts"
            )
            + ")"
        )
    usable = num_blocks - 1 - watermark_blocks
    need = int(blocks_for(len(ids), block_size))
    if need > usable:
        raise ValueError(
            f"prompt of {len(ids)} tokens needs {need} KV blocks but the pool can never"
            f" give more than {usable} ({num_blocks} blocks of {block_size},"
            " minus the null block and the watermark)"
        )
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > max_logprobs:
            raise ValueError(f"{name}={k} exceeds max_logprobs={max_logprobs}")
    for t in params.stop_token_ids:
        if t >= vocab_size:
            raise ValueError(f"stop_token_ids has {t}, outside the vocabulary")
    for name, ids in (("allowed_token_ids", params.allowed_token_ids or ()),
                      ("logit_bias", params.logit_bias or {})):  # fmt: skip
        bad = sorted(t for t in ids if t >= vocab_size)
        if bad:
            raise ValueError(f"{name} has token ids {bad} outside the vocabulary [0, {vocab_size})")
    if len(params.logit_bias or {}) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias has {len(params.logit_bias)} entries; this engine takes at most"
            f" {MAX_LOGIT_BIAS_ENTRIES} per request"
        )


def record_prompt_logprobs(decode: Any, host: dict, owners: list, plp: Any) -> None:
    """Entry p + 1 of a request's prompt_logprobs scores prompt token p + 1 given the
    tokens before it (entry 0 stays None, as vLLM). A recompute after preemption or a
    second sample writes the same values again.

    decode: the tokenizer's decode. host: the step's batch read back (q_lens, start_pos).
    owners: (request, sequence) per batch row. plp: the runner's prompt logprobs (host)."""
    cu = np.concatenate([[0], np.cumsum(host["q_lens"][: len(owners)])])
    for r, (req, _) in enumerate(owners):
        if req.prompt_logprobs is None:
            continue
        k = req.num_prompt_logprobs
        for t in range(int(cu[r]), int(cu[r + 1])):
            p = int(host["start_pos"][r]) + t - int(cu[r])
            if p + 1 >= len(req.prompt_token_ids):
                break
            tok = req.prompt_token_ids[p + 1]
            entry = {tok: Logprob(float(plp.logprobs[t]), int(plp.ranks[t]), decode([tok]))}
            for j in range(k):
                tid = int(plp.top_ids[t, j])
                if tid not in entry:
                    entry[tid] = Logprob(float(plp.top_logprobs[t, j]), j + 1, decode([tid]))
            req.prompt_logprobs[p + 1] = entry


__all__ = ["check_ids", "check_request", "record_prompt_logprobs", "tokenize_prompt"]
