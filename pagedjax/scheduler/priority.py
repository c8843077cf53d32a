"""Scheduling priorities: functions over the state arrays giving sort keys.

A priority is ``(state, config) -> tuple of int32[max_seqs]`` keys, most significant
first; lower runs first. The scheduler breaks ties by arrival, then slot id, so the order
is total and the jitted and reference schedulers agree. The same order picks preemption
victims: the lowest-priority running sequence goes first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.scheduler.state import SchedulerState, output_target


def fcfs(state: SchedulerState, config: Any) -> tuple[jax.Array, ...]:
    """First come, first served (vLLM): by arrival only (the tie-break)."""
    del config
    return (jnp.zeros_like(state.arrival),)


def remaining_tokens(state: SchedulerState, config: Any) -> jax.Array:
    """int32[max_seqs]: tokens still to compute: prompt + output target - cached.

    Uses only what a real engine knows (max_tokens unless final_len is given).
    """
    return state.prompt_len + output_target(state, config.max_model_len) - state.num_computed


def shortest_remaining(state: SchedulerState, config: Any) -> tuple[jax.Array, ...]:
    """Shortest remaining work first (SRPT over known lengths); starves long requests
    under sustained load, so it is an ablation, not a default."""
    return (remaining_tokens(state, config),)


PRIORITIES: dict[str, Callable[[SchedulerState, Any], tuple[jax.Array, ...]]] = {
    "fcfs": fcfs,
    "shortest_remaining": shortest_remaining,
}


def priority_order(state: SchedulerState, config: Any, members: jax.Array) -> jax.Array:
    """int32[max_seqs] slot ids: members (bool[max_seqs]) in priority order, then the rest.

    Non-members are ordered too (irrelevant); callers count members to know the prefix.
    """
    fn = PRIORITIES[config.priority] if isinstance(config.priority, str) else config.priority
    keys = tuple(jnp.asarray(k, jnp.int32) for k in fn(state, config))
    slot = jnp.arange(state.max_seqs, dtype=jnp.int32)
    # lexsort: the last key is the primary one.
    outsider = (~members).astype(jnp.int32)
    return jnp.lexsort((slot, state.arrival, *reversed(keys), outsider)).astype(jnp.int32)
