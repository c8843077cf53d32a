"""Loader for a real ShareGPT JSON (ShareGPT_V3_unfiltered_cleaned_split.json format)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedjax.workloads.lengths import MAX_PROMPT_LEN, MAX_TOTAL_LEN, MIN_LEN
from pagedjax.workloads.record import Workload

Tokenizer = Callable[[str], Sequence[int]]


@dataclass(frozen=True, eq=False)
class ShareGPTSample:
    """Sampled (prompt, completion-length) pairs.

    Attributes:
        prompts: N prompt strings (turn 0).
        prompt_token_ids: N token-id tuples of the prompts.
        prompt_len: int32[N]; output_len: int32[N] (tokens of turn 1, used as max_tokens
            with ignore_eos, as vLLM's benchmark does).
    """

    prompts: tuple[str, ...]
    prompt_token_ids: tuple[tuple[int, ...], ...]
    prompt_len: np.ndarray
    output_len: np.ndarray

    def __len__(self) -> int:
        return len(self.prompts)

    def to_workload(self, arrival_time: np.ndarray | None = None) -> Workload:
        """A Workload of these lengths; arrivals default to all at t = 0."""
        if arrival_time is None:
            arrival_time = np.zeros(len(self))
        return Workload(arrival_time, self.prompt_len, self.output_len, name="sharegpt_json")


def load_sharegpt(
    path: str | Path,
    tokenizer: Tokenizer,
    num_requests: int,
    seed: int = 0,
) -> ShareGPTSample:
    """vLLM's ShareGPT sampling: >= 2 turns; prompt = turn 0, completion = turn 1.

    Conversations with >= 2 turns are shuffled with `seed` (numpy Generator), then walked
    in order, tokenizing lazily; a pair is skipped when prompt < 4 or output < 4 tokens,
    prompt > 1024, or prompt + output > 2048. The first `num_requests` valid pairs are
    returned.

    Raises:
        ValueError: the file is not a list of {"conversations": [...]} records, or fewer
            than `num_requests` pairs are valid.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: no ShareGPT JSON at {path}")
    with path.open() as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"path: {path} must hold a JSON list of conversations")
    convs = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"path: entry {i} of {path} has no 'conversations' list")
        if len(turns) >= 2:
            try:
                convs.append((str(turns[0]["value"]), str(turns[1]["value"])))
            except (KeyError, TypeError) as err:
                raise ValueError(f"path: entry {i} of {path} has a turn without 'value'") from err
    order = np.random.default_rng(seed).permutation(len(convs))
    prompts: list[str] = []
    token_ids: list[tuple[int, ...]] = []
    out_lens: list[int] = []
    for idx in order:
        if len(prompts) == num_requests:
            break
        prompt, completion = convs[idx]
        ids = tuple(tokenizer(prompt))
        p, o = len(ids), len(tokenizer(completion))
        if p < MIN_LEN or o < MIN_LEN or p > MAX_PROMPT_LEN or p + o > MAX_TOTAL_LEN:
            continue
        prompts.append(prompt)
        token_ids.append(ids)
        out_lens.append(o)
    if len(prompts) < num_requests:
        raise ValueError(
            f"num_requests={num_requests} but only {len(prompts)} valid pairs in {path}"
        )
    return ShareGPTSample(
        tuple(prompts),
        tuple(token_ids),
        np.array([len(t) for t in token_ids], np.int32),
        np.array(out_lens, np.int32),
    )
