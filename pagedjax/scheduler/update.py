"""Apply a computed step: advance lengths, finish sequences, free their memory."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pagedjax.scheduler.config import SchedulerLimits
from pagedjax.scheduler.schedule import ScheduledBatch
from pagedjax.scheduler.state import (
    FINISHED,
    REASON_LENGTH,
    REASON_STOP,
    RUNNING,
    SchedulerState,
    output_target,
)


def update(
    policy: Any,
    config: SchedulerLimits,
    state: SchedulerState,
    batch: ScheduledBatch,
    finished_mask: jax.Array,
    accepted: jax.Array | None = None,
) -> SchedulerState:
    """After the model step (jittable with policy and config static).

    finished_mask: bool[max_seqs] in batch-row order (row r is batch.seq_ids[r], like the
        sampled ids): the engine saw EOS or a stop sequence in the row's sampled token.
        Read only for emitting rows (a non-final prefill chunk samples nothing).

    accepted: int32[max_seqs] in batch-row order, drafts accepted of the row's
        ``batch.spec_lens`` (speculative decoding); None: no drafts were scheduled.

    Each row's num_computed grows by its q_len less its rejected drafts; an emitting row
    gains 1 + accepted output tokens (the accepted drafts and the token sampled after
    them). A row with rejected drafts is rolled back to its new num_computed through the
    policy's ``truncate`` (blocks wholly past it return to the pool: memory/rollback.py).
    A sequence finishes when its output reaches ``output_target`` (REASON_LENGTH) or its
    finished_mask is set (REASON_STOP); its memory is released at once.
    """
    n = config.max_seqs
    finished_mask = jnp.asarray(finished_mask)
    if finished_mask.shape != (n,):
        raise ValueError(f"finished_mask must have shape ({n},), got {finished_mask.shape}")
    row = batch.seq_ids >= 0
    ids = jnp.where(row, batch.seq_ids, n)  # padding rows are dropped
    emit = row & batch.emits
    q_lens, gained = batch.q_lens, emit.astype(jnp.int32)
    mem = state.mem
    if accepted is not None and batch.spec_lens is not None:
        acc = jnp.where(emit, jnp.minimum(jnp.asarray(accepted, jnp.int32), batch.spec_lens), 0)
        rejected = jnp.where(row, batch.spec_lens - acc, 0)
        q_lens = q_lens - rejected
        gained = gained + acc
        roll = row & (rejected > 0)
        mem = lax.cond(
            jnp.any(roll),
            lambda: policy.truncate(mem, batch.seq_ids, batch.start_pos + q_lens, roll),
            lambda: mem,
        )
    num_computed = state.num_computed.at[ids].add(q_lens, mode="drop")
    output_len = state.output_len.at[ids].add(gained, mode="drop")
    emitted = jnp.zeros((n,), bool).at[ids].set(emit, mode="drop")
    stop = jnp.zeros((n,), bool).at[ids].set(emit & finished_mask, mode="drop")
    target = output_target(state, config.max_model_len)
    done = emitted & (state.status == RUNNING) & (stop | (output_len >= target))
    # Most steps finish nobody; a policy's batched release costs O(max_seqs) regardless.
    mem = lax.cond(
        jnp.any(done),
        lambda: policy.release(mem, jnp.arange(n, dtype=jnp.int32), done),
        lambda: mem,
    )
    reason = jnp.where(stop, REASON_STOP, REASON_LENGTH)
    return state._replace(
        status=jnp.where(done, FINISHED, state.status),
        finish_reason=jnp.where(done, reason, state.finish_reason),
        num_computed=num_computed,
        output_len=output_len,
        mem=mem,
        step=state.step + 1,
    )
