"""What a step observer sees (``LLMEngine.add_step_observer``): one record per engine
iteration, the scheduled batch's host-side arrays and the step's wall time.

An observer is called after each ``LLMEngine.step()`` call, once per engine iteration the
call ran, in order: one for the one-step path, ``n`` for a call that ran ``n`` iterations
inside the fused K-step decode loop (``multi_step.py``; every row there is one decode
token, plus its drafts when the n-gram method speculates in the loop). Observing costs a
few numpy slices per iteration and changes nothing the engine computes (K stays as
configured). The simulator's validation
(``experiments/real_serving.py``) records its per-step features this way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np


class StepRecord(NamedTuple):
    """One engine iteration's scheduled batch, host side.

    num_tokens: tokens the iteration computed (prefill chunks and decode tokens).
    num_seqs: rows of the batch (sequences scheduled; 0 when nothing ran, e.g. only
        rejections). seq_ids, q_lens, start_pos: int32[num_seqs], per row: the slot,
        the tokens computed this iteration, the position of its first one (the tokens
        already computed). wall_s: seconds of the ``step()`` call that ran it, divided
        evenly among the iterations that call ran. fused: run inside the K-step loop.
    """

    num_tokens: int
    num_seqs: int
    seq_ids: np.ndarray
    q_lens: np.ndarray
    start_pos: np.ndarray
    wall_s: float
    fused: bool = False


StepObserver = Callable[[StepRecord], Any]


def one_step_record(host: dict[str, Any]) -> StepRecord:
    """The record of a one-step iteration from its host-side batch arrays (the engine's
    ``host`` dict: num_tokens, num_seqs, seq_ids, q_lens, start_pos); wall_s 0 (``notify``
    sets it)."""
    n = int(host["num_seqs"])
    return StepRecord(
        int(host["num_tokens"]), n,
        np.asarray(host["seq_ids"][:n], np.int32), np.asarray(host["q_lens"][:n], np.int32),
        np.asarray(host["start_pos"][:n], np.int32), 0.0,
    )  # fmt: skip


def loop_records(seq_ids: np.ndarray, start_pos: np.ndarray, num_iters: int,
                 spec_lens: np.ndarray | None = None) -> list[StepRecord]:  # fmt: skip
    """The records of a K-step loop's first ``num_iters`` iterations (its host-side
    ``LoopOutput.seq_ids`` / ``start_pos`` / ``spec_lens``, [K, S], -1: a padding row; a
    row computes 1 + its drafts)."""
    out = []
    for j in range(num_iters):
        rows = np.flatnonzero(seq_ids[j] >= 0)
        n = len(rows)
        q = np.ones(n, np.int32)
        if spec_lens is not None:
            q = q + spec_lens[j, rows].astype(np.int32)
        out.append(StepRecord(int(q.sum()), n, seq_ids[j, rows].astype(np.int32), q,
                              start_pos[j, rows].astype(np.int32), 0.0, True))  # fmt: skip
    return out


def notify(observers: list[StepObserver], t0: float, outputs: Any, ran: Any) -> Any:
    """Call each observer with the records of what a ``step()`` call started at ``t0``
    (``time.perf_counter()``) ran, in order, its wall time shared evenly; returns
    ``outputs`` (the call's own). ran: the one-step batch's host dict (``one_step_record``)
    or the K-step loop's (seq_ids, start_pos, num_iters) (``loop_records``)."""
    if observers:
        records = [one_step_record(ran)] if isinstance(ran, dict) else loop_records(*ran)
        share = (time.perf_counter() - t0) / max(len(records), 1)
        for rec in records:
            rec = rec._replace(wall_s=share)
            for fn in observers:
                fn(rec)
    return outputs


__all__ = ["StepObserver", "StepRecord", "loop_records", "notify", "one_step_record"]
