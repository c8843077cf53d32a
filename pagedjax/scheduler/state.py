"""Scheduler state: one row per sequence slot, as arrays (a pytree), plus request intake.

The slot id is also the sequence's row in the memory policy's block table and in the
engine's sampling-parameter arrays, so no separate index is kept.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# status
FREE = 0  # slot unused
WAITING = 1  # queued (new, or preempted: num_computed = 0, output kept for recompute)
RUNNING = 2  # admitted; holds memory
FINISHED = 3  # done; memory released; results not yet read (see recycle)
SWAPPED = 4  # preempted by swap: its blocks (and block-table row) are in the host pool

# finish_reason (meaningful when status == FINISHED)
REASON_NONE = 0
REASON_LENGTH = 1  # reached max_tokens, the true output length, or max_model_len
REASON_STOP = 2  # the engine reported EOS / a stop sequence (update's finished_mask)
REASON_ABORTED = 3  # abort()
REASON_TOO_LONG = 4  # prompt (paper/static: prompt + output to recompute) over the limit
REASON_CAPACITY = 5  # cannot fit the memory pool even alone


class SchedulerState(NamedTuple):
    """All arrays are ``int32[max_seqs]`` (one row per slot) unless noted.

    status: FREE / WAITING / RUNNING / FINISHED / SWAPPED.
    finish_reason: REASON_* (REASON_NONE unless FINISHED).
    arrival: order key given at add_requests; FCFS serves lower first; ties by slot id.
    prompt_len: prompt tokens.
    output_len: tokens generated so far (kept across preemption).
    max_tokens: the request's output cap.
    final_len: prompt + true output length when known (simulation, Orca Oracle), else
        prompt + max_tokens; a sequence finishes by length at min(max_tokens,
        final_len - prompt_len, max_model_len - prompt_len) output tokens.
    num_computed: tokens whose KV is cached (0 after preemption by recompute).
    num_preemptions: times preempted.
    group: sequence-group id (any int32, unique among live groups; default the slot id).
        A group's running sequences are scheduled, preempted (all or nothing) and
        swapped back in together (docs/scheduler.md).
    mem: the memory policy's state (a pytree).
    step: int32[] steps scheduled so far.
    """

    status: jax.Array
    finish_reason: jax.Array
    arrival: jax.Array
    prompt_len: jax.Array
    output_len: jax.Array
    max_tokens: jax.Array
    final_len: jax.Array
    num_computed: jax.Array
    num_preemptions: jax.Array
    group: jax.Array
    mem: Any
    step: jax.Array

    @property
    def max_seqs(self) -> int:
        return self.status.shape[0]


def init_state(policy: Any, max_seqs: int) -> SchedulerState:
    """All slots FREE, the policy's fresh state."""
    if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 1:
        raise ValueError(f"max_seqs must be an int >= 1, got {max_seqs!r}")
    if policy.max_seqs != max_seqs:
        raise ValueError(f"policy.max_seqs ({policy.max_seqs}) != max_seqs ({max_seqs})")
    # numpy, one device_put: outside jit each jnp op was an XLA program of its own
    # (may_alias=False: on a CPU device_put may share a numpy buffer; the state is donated)
    z, group, step = jax.device_put(
        (np.zeros((max_seqs,), np.int32), np.arange(max_seqs, dtype=np.int32), np.int32(0)),
        may_alias=False,
    )
    return SchedulerState(
        status=z,
        finish_reason=z,
        arrival=z,
        prompt_len=z,
        output_len=z,
        max_tokens=z,
        final_len=z,
        num_computed=z,
        num_preemptions=z,
        group=group,
        mem=policy.init_state(),
        step=step,
    )


def _masked_ids(state: SchedulerState, slot_ids: jax.Array, mask: jax.Array) -> jax.Array:
    # Out-of-range ids make .at[].set(mode="drop") skip the entry (-1 would wrap).
    return jnp.where(mask, jnp.asarray(slot_ids, jnp.int32), state.max_seqs)


def _check_rows(name_values: dict[str, Any]) -> None:
    shapes = {k: jnp.shape(v) for k, v in name_values.items()}
    first = next(iter(shapes.values()))
    if len(first) != 1:
        raise ValueError(f"slot_ids must be 1-D, got shape {first}")
    for k, s in shapes.items():
        if s != first:
            raise ValueError(f"{k} must have shape {first} like slot_ids, got {s}")


def add_requests(
    state: SchedulerState,
    slot_ids: jax.Array,
    prompt_lens: jax.Array,
    max_tokens: jax.Array,
    final_lens: jax.Array,
    arrivals: jax.Array,
    mask: jax.Array,
    groups: jax.Array | None = None,
) -> SchedulerState:
    """Queue new requests (jittable). Each argument is ``[B]``; only masked rows count.

    slot_ids: int32, FREE (or FINISHED, already read) slots, distinct among masked rows.
    prompt_lens: int32 >= 1. max_tokens: int32 >= 1.
    final_lens: int32 prompt + true output (prompt + max_tokens when unknown).
    arrivals: int32 order keys (distinct; FCFS serves lower first).
    groups: int32 sequence-group ids (default: the slot ids, n = 1). An id must not be
        reused while a sequence of the old group is live.
    The preconditions cannot be checked under jit; the reference scheduler checks them.
    """
    _check_rows(
        dict(
            slot_ids=slot_ids,
            prompt_lens=prompt_lens,
            max_tokens=max_tokens,
            final_lens=final_lens,
            arrivals=arrivals,
            mask=mask,
            **({} if groups is None else dict(groups=groups)),
        )
    )
    ids = _masked_ids(state, slot_ids, mask)
    groups = slot_ids if groups is None else groups

    def put(a: jax.Array, v: Any) -> jax.Array:
        v = jnp.broadcast_to(jnp.asarray(v, a.dtype), ids.shape)
        return a.at[ids].set(v, mode="drop")

    return state._replace(
        status=put(state.status, WAITING),
        finish_reason=put(state.finish_reason, REASON_NONE),
        arrival=put(state.arrival, arrivals),
        prompt_len=put(state.prompt_len, prompt_lens),
        output_len=put(state.output_len, 0),
        max_tokens=put(state.max_tokens, max_tokens),
        final_len=put(state.final_len, final_lens),
        num_computed=put(state.num_computed, 0),
        num_preemptions=put(state.num_preemptions, 0),
        group=put(state.group, groups),
    )


def abort(
    policy: Any, state: SchedulerState, slot_ids: jax.Array, mask: jax.Array
) -> SchedulerState:
    """Finish the masked WAITING/RUNNING/SWAPPED slots (``[B]`` ids and mask) and free
    their memory (a swapped slot's host blocks)."""
    _check_rows(dict(slot_ids=slot_ids, mask=mask))
    ids = _masked_ids(state, slot_ids, mask)
    hit = jnp.zeros((state.max_seqs,), bool).at[ids].set(True, mode="drop")
    live = hit & ((state.status == WAITING) | (state.status == RUNNING) | (state.status == SWAPPED))
    mem = policy.release(state.mem, jnp.arange(state.max_seqs, dtype=jnp.int32), live)
    return state._replace(
        status=jnp.where(live, FINISHED, state.status),
        finish_reason=jnp.where(live, REASON_ABORTED, state.finish_reason),
        mem=mem,
    )


def recycle(state: SchedulerState, slot_ids: jax.Array, mask: jax.Array) -> SchedulerState:
    """Mark the masked FINISHED slots FREE once the engine has read their results."""
    _check_rows(dict(slot_ids=slot_ids, mask=mask))
    ids = _masked_ids(state, slot_ids, mask)
    hit = jnp.zeros((state.max_seqs,), bool).at[ids].set(True, mode="drop")
    done = hit & (state.status == FINISHED)
    return state._replace(
        status=jnp.where(done, FREE, state.status),
        finish_reason=jnp.where(done, REASON_NONE, state.finish_reason),
    )


def output_target(state: SchedulerState, max_model_len: int) -> jax.Array:
    """int32[max_seqs]: output length at which a sequence finishes by length (>= 1)."""
    t = jnp.minimum(state.max_tokens, state.final_len - state.prompt_len)
    t = jnp.minimum(t, max_model_len - state.prompt_len)
    return jnp.maximum(t, 1)


def max_lens(state: SchedulerState, max_model_len: int) -> jax.Array:
    """int32[max_seqs]: the request's length cap for the policy (prompt + max_tokens)."""
    return jnp.minimum(state.prompt_len + state.max_tokens, max_model_len)
