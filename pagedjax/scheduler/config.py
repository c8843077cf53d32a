"""The jitted scheduler's static limits (hashable, so they can be a ``jax.jit`` static argument).

``SchedulerLimits`` is what ``schedule`` / ``update`` decide with: the user-facing settings
(``pagedjax.config.SchedulerConfig``, EngineConfig's ``scheduler`` section, vLLM's names)
plus the sizes the engine derives (slots, ``max_model_len``). ``LLMEngine`` builds one from
its EngineConfig; the simulator, the reference scheduler and the benchmarks build their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MODES = ("default", "paper", "static")
PREEMPTION_MODES = (None, "recompute", "swap")
# How paper mode composes a step (``SchedulerLimits.prompt_steps``).
PROMPT_STEPS = ("mixed", "separate")

# vLLM v0.1.x EngineArgs defaults (paper_notes section 6).
PAPER_MAX_NUM_BATCHED_TOKENS = 2560
PAPER_MAX_NUM_SEQS = 256


def _check_pos_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class SchedulerLimits:
    """What the jitted scheduler decides with; every field is static (see the module
    docstring for how it relates to ``pagedjax.config.SchedulerConfig``).

    max_seqs: sequence slots (waiting + running + finished-but-unread); the length of
        every per-slot state array. Must equal the memory policy's ``max_seqs``.
    max_num_batched_tokens: token budget of one step (decode and prefill tokens together).
    max_num_seqs: most RUNNING sequences at once.
    max_model_len: longest sequence (prompt + output) served; longer prompts are rejected.
    mode: "default" (chunked prefill, mixed ragged batch), "paper" (vLLM 2023: no
        chunking, strict FCFS admission with the watermark) or "static" (a
        FasterTransformer-like request-level batcher: a new batch of up to
        ``static_batch_size`` requests is admitted only when nothing is running).
    priority: a name in ``pagedjax.scheduler.priority.PRIORITIES`` ("fcfs",
        "shortest_remaining") or a callable ``(state, config) -> tuple of int32[max_seqs]``
        keys, most significant first (lower runs first). Paper mode requires "fcfs".
    static_batch_size: the batch size B of static mode (ignored otherwise).
    preemption_mode: how a preempted sequence group gives its memory back: "recompute"
        (free the blocks, prefill prompt + output again later), "swap" (move the blocks to
        the policy's host pool, move them back later) or None, the paper's default: swap
        groups with several running sequences, recompute single ones. Swap needs a policy
        with a host pool (``policy.can_swap``); otherwise, and whenever the host pool
        cannot take a group, the group is recomputed.
    prompt_steps: how a paper-mode step is composed. "mixed" (default): the running
        decodes and the admitted prompts share one step within the token budget, as in
        the paper's section 4.3 ("concatenates all the input tokens of the current
        iteration"), its pre-release scheduler and vLLM v0.1.0-v0.1.2 (``_schedule``
        counts the running sequences' tokens first, then adds prompts). "separate":
        vLLM v0.1.3-v0.3's alternation: when nothing is swapped out and the head of the
        waiting queue can be admitted, the step runs prompts only (every admissible
        prompt in FCFS order up to the whole token budget, watermark and max_num_seqs as
        usual; running sequences wait a step), otherwise a decode-only step (the running
        pass with its preemptions, then swap-in; no admission). Only with mode "paper"
        (the other modes have their own batch composition).
    """

    max_seqs: int
    max_num_batched_tokens: int = PAPER_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = PAPER_MAX_NUM_SEQS
    max_model_len: int = 2048
    mode: str = "default"
    priority: str | Callable[..., Any] = "fcfs"
    static_batch_size: int = 8
    preemption_mode: str | None = None
    prompt_steps: str = "mixed"

    def __post_init__(self) -> None:
        _check_pos_int("max_seqs", self.max_seqs)
        _check_pos_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_pos_int("max_num_seqs", self.max_num_seqs)
        _check_pos_int("max_model_len", self.max_model_len)
        _check_pos_int("static_batch_size", self.static_batch_size)
        if self.max_num_seqs > self.max_seqs:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must be <= max_seqs ({self.max_seqs}):"
                " every running sequence needs a slot"
            )
        if self.mode == "static" and self.static_batch_size > self.max_seqs:
            raise ValueError(
                f"static_batch_size ({self.static_batch_size}) must be <= max_seqs"
                f" ({self.max_seqs})"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.prompt_steps not in PROMPT_STEPS:
            raise ValueError(
                f"prompt_steps must be one of {PROMPT_STEPS}, got {self.prompt_steps!r}"
            )
        if self.prompt_steps != "mixed" and self.mode != "paper":
            raise ValueError(
                f"prompt_steps={self.prompt_steps!r} needs mode 'paper', got {self.mode!r}"
            )
        from pagedjax.scheduler.priority import PRIORITIES  # cycle: priority types config

        if isinstance(self.priority, str):
            if self.priority not in PRIORITIES:
                raise ValueError(
                    f"priority must be one of {tuple(PRIORITIES)} or a callable,"
                    f" got {self.priority!r}"
                )
        elif not callable(self.priority):
            raise ValueError(f"priority must be a name or a callable, got {self.priority!r}")
        if self.mode == "paper" and self.priority != "fcfs":
            raise ValueError(f"paper mode is FCFS; priority must be 'fcfs', got {self.priority!r}")

    @property
    def chunked_prefill(self) -> bool:
        """Only the default mode splits a prompt across steps."""
        return self.mode == "default"

    @property
    def separate_prompt_steps(self) -> bool:
        """Prompt-only and decode-only steps (``prompt_steps`` "separate")."""
        return self.prompt_steps == "separate"

    @property
    def prompt_limit(self) -> int:
        """Longest prompt (paper/static: whole recompute length) that can ever be scheduled.

        Without chunking a prompt must fit one step's budget, as in vLLM v0.1-0.2.
        """
        if self.chunked_prefill:
            return self.max_model_len
        return min(self.max_model_len, self.max_num_batched_tokens)

    @classmethod
    def paper(cls, max_seqs: int = PAPER_MAX_NUM_SEQS, **overrides: Any) -> SchedulerLimits:
        """The 2023 vLLM defaults: paper mode, FCFS, 2560 batched tokens, 256 sequences."""
        kw: dict[str, Any] = dict(
            max_seqs=max_seqs,
            max_num_batched_tokens=PAPER_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=min(PAPER_MAX_NUM_SEQS, max_seqs),
            mode="paper",
            priority="fcfs",
        )
        kw.update(overrides)
        return cls(**kw)
