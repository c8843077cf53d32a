"""Workloads whose requests reuse each other's prefixes: multi-turn conversations and agent loops.

A ``ConversationWorkload`` is a ``Workload`` (arrival, prompt and output lengths per
request) plus, per request, the conversation it belongs to, its turn, and what its prompt
is made of, so that a prefix cache (``pagedjax.simulator.kv_tiers``) can tell which
blocks two requests share:

- **Stream rows** (every generator here, and trace rows that give lengths): each
  conversation has one token stream; a request's prompt is the first ``prompt_len``
  tokens of it and its output the next ``output_len``. The stream starts with a shared
  prefix of ``prefix_len`` tokens (``prefix_group`` >= 0: a system prompt or an agent's
  context common to several conversations; -1: none), the conversation's own tokens
  follow. So turn t + 1, whose prompt resends the whole history (turn t's prompt, its
  reply and the next user message), extends turn t's prompt and output.
- **Token rows** (trace rows that give ``prompt_tokens``): the prompt's ids are known; its
  output's are not, so only the prompt's blocks can be shared.

``block_keys(i, block_size)`` names the full blocks of request i's prompt (and
``output_block_keys`` those its output completes, stream rows only) with 64-bit keys:
equal keys mean equal tokens from the start of the prompt (the chained-hash contract of
prefix caching), different keys different tokens (up to hash collisions of token rows,
2^-64 per pair).

Generators (lengths from the ShareGPT-like model of ``lengths.py``; docs/workloads.md):

- ``multi_turn``: ``num_conversations`` conversations of ``turns`` turns; every turn
  resends the whole history. Arrivals: a Poisson stream at ``rate`` shared by all
  conversations, in rounds (round r holds turn r of every conversation still going, in a
  random order), so the reuse distance of a conversation's prefix grows with the number
  of conversations while the offered load stays the same (LMCache's multi-round QA
  benchmark is built the same way).
- ``agentic``: ``num_agents`` agents that share one long context (tools, instructions,
  a code base) and take many short turns (an observation in, an action out), each turn
  resending the whole history; arrivals in rounds as above.

Trace files: ``trace_jsonl.load_conversation_trace``. Every generator is deterministic
given its seed; conversation i's lengths do not depend on how many conversations are
asked for, so a sweep over ``num_conversations`` grows one population.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from pagedjax.workloads.arrivals import arrival_times
from pagedjax.workloads.lengths import MIN_LEN, sample_lengths
from pagedjax.workloads.record import Workload

# Key layout (non-negative int64): 0 | 2 tag bits | 37-bit id | 24-bit block index.
_ID_BITS, _INDEX_BITS = 37, 24
_TAG_SHARED, _TAG_CONV, _TAG_TOKENS = 1, 2, 3


def _stream_key(tag: int, ident: int, index: np.ndarray) -> np.ndarray:
    return (
        (np.int64(tag) << np.int64(_ID_BITS + _INDEX_BITS))
        | (np.int64(ident) << np.int64(_INDEX_BITS))
        | index.astype(np.int64)
    ).astype(np.int64)


@dataclass(frozen=True, eq=False)
class ConversationWorkload:
    """Requests of conversations (module docstring).

    Attributes:
        requests: the Workload (arrival_time float64[N] non-decreasing, prompt_len int32[N],
            output_len int32[N]).
        conversation: int32[N], the conversation of each request (0 .. C - 1).
        turn: int32[N], its turn within the conversation (0, 1, ...; arrival order).
        prefix_group: int32[N], the shared prefix its stream starts with, -1 for none.
        prefix_len: int32[N], that prefix's tokens (0 when prefix_group is -1).
        prompt_tokens: None, or per request an int64 array of its prompt's ids (token
            rows) or None (stream rows).
        name: a label.
    """

    requests: Workload
    conversation: np.ndarray
    turn: np.ndarray
    prefix_group: np.ndarray
    prefix_len: np.ndarray
    prompt_tokens: tuple[np.ndarray | None, ...] | None = None
    name: str = ""

    def __post_init__(self) -> None:
        n = len(self.requests)
        for label in ("conversation", "turn", "prefix_group", "prefix_len"):
            arr = np.asarray(getattr(self, label))
            if arr.shape != (n,):
                raise ValueError(f"{label} must have shape ({n},), got {arr.shape}")
            object.__setattr__(self, label, arr.astype(np.int32))
        if n and (self.conversation.min() < 0 or self.turn.min() < 0):
            raise ValueError("conversation and turn must be >= 0")
        if n and (self.prefix_len.min() < 0 or self.prefix_group.min() < -1):
            raise ValueError("prefix_len must be >= 0 and prefix_group >= -1")
        if np.any((self.prefix_group == -1) & (self.prefix_len != 0)):
            raise ValueError("prefix_len must be 0 where prefix_group is -1")
        if n and self.conversation.max() >= 1 << _ID_BITS:
            raise ValueError(f"conversation ids must be < 2^{_ID_BITS}")
        if self.prompt_tokens is not None:
            if len(self.prompt_tokens) != n:
                raise ValueError(
                    f"prompt_tokens must have {n} entries, got {len(self.prompt_tokens)}"
                )
            for i, t in enumerate(self.prompt_tokens):
                if t is not None and len(t) != self.requests.prompt_len[i]:
                    raise ValueError(
                        f"prompt_tokens[{i}] has {len(t)} ids but prompt_len is "
                        f"{self.requests.prompt_len[i]}"
                    )

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_conversations(self) -> int:
        return int(self.conversation.max()) + 1 if len(self) else 0

    def _tokens(self, i: int) -> np.ndarray | None:
        return None if self.prompt_tokens is None else self.prompt_tokens[i]

    def _stream_keys(self, i: int, first: int, stop: int, block_size: int) -> np.ndarray:
        """Keys of stream blocks [first, stop) of request i's conversation."""
        idx = np.arange(first, stop, dtype=np.int64)
        if len(idx) and idx[-1] >= 1 << _INDEX_BITS:
            raise ValueError(f"request {i}: more than 2^{_INDEX_BITS} blocks")
        conv = _stream_key(_TAG_CONV, int(self.conversation[i]), idx)
        g = int(self.prefix_group[i])
        if g < 0:
            return conv
        shared = (idx + 1) * block_size <= int(self.prefix_len[i])  # wholly inside the prefix
        return np.where(shared, _stream_key(_TAG_SHARED, g, idx), conv)

    def block_keys(self, i: int, block_size: int) -> np.ndarray:
        """int64[prompt_len // block_size]: keys of request i's full prompt blocks."""
        _check_block_size(block_size)
        p = int(self.requests.prompt_len[i])
        tokens = self._tokens(i)
        if tokens is not None:
            return token_block_keys(tokens, block_size)
        return self._stream_keys(i, 0, p // block_size, block_size)

    def output_block_keys(self, i: int, block_size: int) -> np.ndarray:
        """int64[K]: keys of the blocks request i's output completes (prompt blocks not
        included); empty for token rows, whose output ids are unknown."""
        _check_block_size(block_size)
        if self._tokens(i) is not None:
            return np.zeros(0, np.int64)
        p = int(self.requests.prompt_len[i])
        total = p + int(self.requests.output_len[i])
        return self._stream_keys(i, p // block_size, total // block_size, block_size)

    def _all_keys(self, i: int, block_size: int) -> np.ndarray:
        return np.concatenate([self.block_keys(i, block_size),
                               self.output_block_keys(i, block_size)])  # fmt: skip

    def working_set_blocks(self, block_size: int) -> int:
        """Distinct full blocks over every request's prompt and output: what a cache that
        never evicts would hold at the end (the x-axis of the tier curves)."""
        keys = [self._all_keys(i, block_size) for i in range(len(self))]
        return int(len(np.unique(np.concatenate(keys)))) if keys else 0

    def cumulative_working_set(self, block_size: int) -> np.ndarray:
        """int64[C]: entry n - 1 is the working set (as ``working_set_blocks``) of the
        requests of conversations 0 .. n - 1; for the generators here, whose first n
        conversations do not depend on how many were asked for, the working set of
        ``multi_turn(n, ...)`` / ``agentic(n, ...)``."""
        seen: set[int] = set()
        new = np.zeros(self.num_conversations, np.int64)
        for i in np.argsort(self.conversation, kind="stable").tolist():
            keys = set(self._all_keys(i, block_size).tolist())
            new[self.conversation[i]] += len(keys - seen)
            seen |= keys
        return np.cumsum(new)


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def token_block_keys(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """int64[len // block_size]: chained keys of full blocks of token ids (blake2b-64 of
    the parent key and the block's ids, tagged so they never equal a stream key)."""
    _check_block_size(block_size)
    tokens = np.asarray(tokens, np.int64)
    out = np.empty(len(tokens) // block_size, np.int64)
    parent = b""
    mask = (1 << (_ID_BITS + _INDEX_BITS)) - 1
    for b in range(len(out)):
        h = hashlib.blake2b(parent + tokens[b * block_size : (b + 1) * block_size].tobytes(),
                            digest_size=8).digest()  # fmt: skip
        parent = h
        out[b] = (_TAG_TOKENS << (_ID_BITS + _INDEX_BITS)) | (int.from_bytes(h, "little") & mask)
    return out


def _rounds_arrivals(
    turns_per_conv: np.ndarray, rate: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival float64[N], conversation int32[N], turn int32[N]): round r holds turn r of
    every conversation with more than r turns, in a random order; Poisson at rate."""
    convs, turns = [], []
    for r in range(int(turns_per_conv.max(initial=0))):
        live = np.flatnonzero(turns_per_conv > r)
        live = live[rng.permutation(len(live))]
        convs.append(live)
        turns.append(np.full(len(live), r))
    conv = np.concatenate(convs).astype(np.int32) if convs else np.zeros(0, np.int32)
    turn = np.concatenate(turns).astype(np.int32) if turns else np.zeros(0, np.int32)
    return arrival_times(len(conv), rate, rng), conv, turn


def _check_counts(**kwargs: float) -> None:
    for k, v in kwargs.items():
        if v < 1:
            raise ValueError(f"{k} must be >= 1, got {v}")


def _turn_lengths(
    start: int, added: np.ndarray, outputs: np.ndarray, max_len: int
) -> list[tuple[int, int]]:
    """(prompt, output) lengths of one conversation's turns: turn t's prompt = ``start`` +
    every earlier turn's added tokens and output + ``added[t]``; its output ``outputs[t]``.
    Stops at the first turn whose prompt + output would exceed ``max_len``, keeping at
    least one turn (the first message cut to fit, then a short output)."""
    hist, pairs = start, []
    for t in range(len(added)):
        prompt, out = hist + int(added[t]), int(outputs[t])
        if prompt + out > max_len:
            if t == 0:
                prompt = min(prompt, max_len - MIN_LEN)
                pairs.append((prompt, min(out, max_len - prompt)))
            break
        pairs.append((prompt, out))
        hist = prompt + out
    return pairs


def multi_turn(
    num_conversations: int,
    turns: int,
    rate: float,
    *,
    seed: int = 0,
    dataset: str = "sharegpt",
    max_len: int = 4096,
    system_prompt_len: int = 0,
    spread_scale: float = 1.0,
) -> ConversationWorkload:
    """Multi-turn chats; each turn resends the whole history.

    Conversation i (its own generator, seeded by (seed, i)) draws ``turns`` (user
    message, reply) length pairs from ``dataset``'s model (``lengths.sample_lengths``:
    ShareGPT-like by default, each pair within vLLM's filter). Turn t's prompt =
    system prompt + every earlier user message and reply + user message t; its output =
    reply t. A conversation ends early at the first turn whose prompt + output would
    exceed ``max_len`` (at least one turn is kept: its reply is cut to fit).
    ``system_prompt_len`` > 0 puts one system prompt (shared prefix group 0) in front of
    every conversation. Arrivals: rounds at ``rate`` req/s (module docstring).
    """
    _check_counts(num_conversations=num_conversations, turns=turns)
    if system_prompt_len < 0:
        raise ValueError(f"system_prompt_len must be >= 0, got {system_prompt_len}")
    if max_len < system_prompt_len + 2 * MIN_LEN:
        raise ValueError(f"max_len ({max_len}) must exceed system_prompt_len + {2 * MIN_LEN}")
    hist_lens: list[list[tuple[int, int]]] = []
    for c in range(num_conversations):
        user, reply = sample_lengths(dataset, turns, np.random.default_rng([seed, c]), spread_scale)
        hist_lens.append(_turn_lengths(system_prompt_len, user, reply, max_len))
    group = 0 if system_prompt_len else -1
    return _assemble(hist_lens, rate, seed, group, system_prompt_len, "multi_turn")


def _assemble(
    hist_lens: list[list[tuple[int, int]]],
    rate: float,
    seed: int,
    group: int,
    prefix_len: int,
    name: str,
) -> ConversationWorkload:
    arr_rng = np.random.default_rng([seed, 1 << 40])  # not any conversation's stream
    turns_per = np.array([len(p) for p in hist_lens], np.int64)
    arrival, conv, turn = _rounds_arrivals(turns_per, rate, arr_rng)
    prompt = np.array([hist_lens[c][t][0] for c, t in zip(conv, turn, strict=True)], np.int32)
    output = np.array([hist_lens[c][t][1] for c, t in zip(conv, turn, strict=True)], np.int32)
    n = len(conv)
    max_total = int((prompt + output).max()) if n else 1
    return ConversationWorkload(
        Workload(arrival, prompt, output, source_len=max_total, name=name),
        conv,
        turn,
        np.full(n, group, np.int32),
        np.full(n, prefix_len if group >= 0 else 0, np.int32),
        name=name,
    )


# Agent turns: lognormal lengths (an assumption, docs/workloads.md): tool outputs /
# observations are right-skewed (a file listing, a test log), actions are short (a tool
# call, a patch hunk).
AGENT_SIGMA_OBSERVATION, AGENT_SIGMA_ACTION = 1.0, 0.6


def agentic(
    num_agents: int,
    turns: int,
    rate: float,
    *,
    seed: int = 0,
    context_len: int = 4096,
    observation_mean: float = 256.0,
    action_mean: float = 64.0,
    max_len: int = 16384,
) -> ConversationWorkload:
    """Agent loops over one long shared context, many short turns.

    Every agent's stream starts with the same ``context_len`` tokens (prefix group 0).
    Turn t's prompt = context + every earlier observation and action + observation t;
    its output = action t. Observations and actions are lognormal with means
    ``observation_mean`` / ``action_mean`` and sigmas AGENT_SIGMA_OBSERVATION /
    AGENT_SIGMA_ACTION, rounded, at least MIN_LEN. An agent stops at the first turn that
    would exceed ``max_len``. Arrivals: rounds at ``rate`` req/s.
    """
    _check_counts(num_agents=num_agents, turns=turns, context_len=context_len)
    for k, v in (("observation_mean", observation_mean), ("action_mean", action_mean)):
        if not (math.isfinite(v) and v >= MIN_LEN):
            raise ValueError(f"{k} must be finite and >= {MIN_LEN}, got {v}")
    if max_len < context_len + 2 * MIN_LEN:
        raise ValueError(f"max_len ({max_len}) must exceed context_len + {2 * MIN_LEN}")
    hist_lens: list[list[tuple[int, int]]] = []
    for a in range(num_agents):
        rng = np.random.default_rng([seed, a])
        obs = _lognormal(rng, observation_mean, AGENT_SIGMA_OBSERVATION, turns)
        act = _lognormal(rng, action_mean, AGENT_SIGMA_ACTION, turns)
        hist_lens.append(_turn_lengths(context_len, obs, act, max_len))
    return _assemble(hist_lens, rate, seed, 0, context_len, "agentic")


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # mean of the lognormal = exp(mu + sigma^2 / 2)
    return np.maximum(np.rint(np.exp(mu + sigma * rng.standard_normal(n))), MIN_LEN).astype(
        np.int64
    )
