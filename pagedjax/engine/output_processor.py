"""The output processor: the host half of every engine iteration, for every kind of step.

One device program ran (the plain step, a speculative verification, or K fused decode
iterations); its sampled tokens are on the host. This module turns them into request
state, in batch order, the same way whatever the program was:

- ``record``: each batch row's tokens in order through ``SequenceState.record`` (stop
  ids, EOS, stop strings, length, logprobs), stopping the row at its first stop (a stop
  inside an accepted speculative run ends the output there). The row's slot is marked
  for recycling when it finished; the batch row goes into update's stop mask when it
  finished by a stop. With jump-forward decoding on, a constrained row that did not
  finish then gets the tokens its grammar forces (``jump_forward.py``), written to the
  device by ``finish``.
- ``reject``: a request the scheduler rejected finishes as vLLM's FINISHED_IGNORED.
- ``register_blocks`` / ``record_filled``: the blocks the step filled with computed,
  accepted tokens enter the prefix cache (device truth and host hint; the K-step program
  registers on device itself, so only the hint is recorded for it).
- ``fork_samples``: an n > 1 request whose sample 0 just sampled its first token forks
  its prompt blocks to samples 1..n-1.
- ``finish``: the host side of the recycled slots is freed, finished requests retire,
  and the RequestOutputs of every touched request are returned.

State has one owner: this object holds only the per-iteration ``StepOutput`` it hands
out; request state is the ``RequestBook``'s, device state the ``DeviceState``'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from pagedjax.engine import admission
from pagedjax.engine.block_hashes import extend_hashes
from pagedjax.engine.core import EngineCore
from pagedjax.engine.host_arrays import upload
from pagedjax.engine.jump_forward import PendingJump
from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.sequence import RequestState, SequenceState
from pagedjax.scheduler import REASON_CAPACITY, REASON_TOO_LONG

log = logging.getLogger(__name__)

REJECT_REASONS = {REASON_TOO_LONG: "too long", REASON_CAPACITY: "cannot fit the KV pool"}


class SampledRows(NamedTuple):
    """One device program's sampled tokens on the host, packed by batch row.

    Row r's tokens are entries ``offsets[r] .. offsets[r] + counts[r] - 1`` (in order):
    one for a plain step, 1 + accepted drafts for a verified row. token_ids int32[R],
    logprobs float32[R]; top: (ranks int32[R], top_ids int32[R, L], top_logprobs
    float32[R, L]) when a row asked for logprobs, else None. offsets, counts: int[S].
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    top: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    offsets: np.ndarray
    counts: np.ndarray

    @classmethod
    def one_per_row(cls, token_ids: Any, logprobs: Any, top: Any, num_seqs: int) -> SampledRows:
        """A plain step's output: row r's token is entry r."""
        rows = np.arange(num_seqs)
        return cls(token_ids, logprobs, top, rows, np.ones(num_seqs, np.int64))


@dataclass
class StepOutput:
    """What the processor collected over one engine iteration (or K fused ones).

    touched: requests that got a token or finished, by id (insertion order).
    finished_rows: bool[max_seqs] in batch-row order: the row finished by a stop
        (update's stop mask). recycle: bool[max_seqs] by slot: the slot's sequence
        finished (its slot is recycled after update).
    """

    touched: dict[str, RequestState]
    finished_rows: np.ndarray
    recycle: np.ndarray
    finished: list[SequenceState] = field(default_factory=list)
    # Jump-forward (engine/jump_forward.py): forced tokens the host appended this step,
    # written to the device by ``finish``, after update.
    forced: list[PendingJump] = field(default_factory=list)


class OutputProcessor:
    """The host half of every step (see the module docstring); one per engine."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.num_forked = 0

    def begin(self) -> StepOutput:
        n = self.core.max_seqs
        return StepOutput({}, np.zeros(n, bool), np.zeros(n, bool))

    def reject(self, out: StepOutput, slot: int, reason: int) -> None:
        """The scheduler finished ``slot`` without running it (too long, cannot fit)."""
        req, seq = self.core.book.owner(slot)
        log.warning("request %s rejected: %s", req.request_id, REJECT_REASONS.get(reason))
        seq.finish_reason = "length"  # vLLM's FINISHED_IGNORED reports "length"
        for child in req.pending:  # samples never forked share the parent's fate
            child.finish_reason = "length"
        req.pending = []
        out.recycle[slot] = True
        out.touched[req.request_id] = req

    def record(self, out: StepOutput, owners: list, rows: list[int],
               sampled: SampledRows) -> np.ndarray:  # fmt: skip
        """Record each listed batch row's tokens (owners[r]: (RequestState, SequenceState)
        of batch row r). Returns int[S]: tokens recorded per row (fewer than counts[r]
        when the row stopped inside its run)."""
        eos = self.core.book.eos
        jump = self.core.controls.jump_forward if self.core.controls is not None else None
        recorded = np.zeros(len(owners), np.int64)
        for r in rows:
            req, seq = owners[r]
            first = int(sampled.offsets[r])
            for i in range(first, first + int(sampled.counts[r])):
                top = None
                if sampled.top is not None:
                    top = (sampled.top[0][i], sampled.top[1][i], sampled.top[2][i])
                recorded[r] += 1
                if seq.record(int(sampled.token_ids[i]), float(sampled.logprobs[i]), top, eos):
                    self._finished(out, r, seq, seq.finish_reason == "stop")
                    break
            else:
                # Jump-forward: a forced run that finishes the sample (length, a stop
                # string) finishes it on the device too, through the stop mask: the
                # device's output_len never saw those tokens.
                if jump is not None and seq.guide is not None and jump.extend(
                    out.forced, req, seq, eos
                ):
                    self._finished(out, r, seq, True)
            out.touched[req.request_id] = req
        return recorded

    @staticmethod
    def _finished(out: StepOutput, r: int, seq: SequenceState, stop_row: bool) -> None:
        out.recycle[seq.slot] = True
        out.finished_rows[r] = stop_row
        out.finished.append(seq)

    def register_blocks(self, batch: Any, host: dict, owners: list,
                        q_lens: np.ndarray | None = None) -> None:  # fmt: skip
        """Prefix caching: the blocks this step filled (rows' first ``q_lens`` tokens
        from their start: the computed and accepted ones) become cached, on device and
        in the host hint. host["tables"]: the block tables after the schedule."""
        if not self.core.enable_prefix_caching:
            return
        if q_lens is not None:
            batch = batch._replace(q_lens=upload(np.asarray(q_lens, np.int32)))  # as scheduled
            host = {**host, "q_lens": q_lens}
        admission.register_blocks(self.core, batch, host, owners)

    def record_filled(self, req: RequestState, seq: SequenceState, end: int,
                      block: int) -> None:  # fmt: skip
        """The K-step program filled (and registered on device) ``block``, the one
        ending at position ``end``: record its hash in the host hint (call it after the
        iteration's tokens are recorded: the block may end in accepted drafts)."""
        b = self.core.block_size
        hi = end // b + 1
        ids = req.prompt_token_ids + seq.detok.ids
        extend_hashes(seq.hashes, ids, b, hi, req.cache_salt)
        self.core.prefix_index.record(seq.hashes[hi - 1 : hi], [block], tokens=ids,
                                      start=hi - 1, salt=req.cache_salt,
                                      parent_hash=seq.hashes[hi - 2] if hi > 1 else None)

    def fork_samples(self, owners: list, rows: list[int]) -> None:
        """Rows whose sample 0 has just its first token fork samples 1..n-1."""
        for r in rows:
            req, seq = owners[r]
            if req.pending and seq.index == 0 and len(seq.detok.ids) >= 1:
                self.num_forked += admission.fork_samples(self.core, req, seq)

    def finish(self, out: StepOutput) -> list[RequestOutput]:
        """After the device's update and recycle of ``out.recycle``: write the step's
        jump-forward tokens to the device, free the recycled slots on the host, build the
        touched requests' outputs, retire the finished requests."""
        book = self.core.book
        if out.forced:
            self.core.controls.jump_forward.write(self.core.device, out.forced)
        for slot in np.flatnonzero(out.recycle):
            book.release_slot(book.owner(int(slot))[1])
        outputs = [req.output() for req in out.touched.values()]
        for o in outputs:
            if o.finished:
                book.retire(o.request_id)
        return outputs


__all__ = ["OutputProcessor", "SampledRows", "StepOutput"]
