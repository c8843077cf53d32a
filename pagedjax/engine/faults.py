"""Step failures that cost only their batch, and the test hook that injects them.

Contract. ``StepFailedError`` is what a request gets when the engine step it was part of
raised: the message names the step's exception. ``fail_batch(engine, error)`` is what an
engine front (``AsyncLLMEngine``'s thread, the engine core loop) calls after
``engine.step()`` raised: it aborts every request that holds a non-swapped scheduler
slot (the batch the failed step scheduled: a request without a slot took no part in it,
a swapped-out group waits on the host) so their KV blocks return to the pool at once,
and returns their ids for the front to fail. When no request holds a slot the step
failed while admitting, and every unfinished request is the batch; otherwise requests
still waiting are untouched and run in the next step. ``FailureBudget`` turns a run of
failed steps into a dead engine: one failure is isolated, ``max_consecutive`` in a row
(state that a failed step left broken fails every later step too) is reported as fatal.

Why aborting is enough: a step raises either before its device program (host bookkeeping,
the fault hook below: the KV pool was not donated, the scheduler state only allocated
blocks for the batch), between the two programs of a step split for grammar masks (the
pool the forward returned is kept before the host's fills run: ``DeviceState.run_step``)
or inside a program; the abort path (``LLMEngine.abort_request``) frees
the slots' blocks by the block tables whatever the step got through. A failure that
broke the device state itself (a donated pool that is gone) fails the next steps too,
which ``FailureBudget`` turns into EngineDeadError.

The hook: ``PAGEDJAX_FAULT_INJECT=raise:PATH`` makes the model runner raise
``InjectedFault`` at its next call while the file PATH exists (it deletes the file:
one fault per file); ``kill:PATH`` makes the process kill itself with SIGKILL instead
(an engine core process that dies); several, comma-separated. Read once when the runner
is built; unset, it costs nothing. Tests and operators' drills use it (docs/security.md;
tests/test_server_robust.py, tests/test_server_shutdown.py).
"""

from __future__ import annotations

import os
import signal
from typing import Any

FAULT_ENV = "PAGEDJAX_FAULT_INJECT"


class StepFailedError(RuntimeError):
    """The engine step this request took part in raised; the message names the cause.
    The request was aborted (its blocks freed); the engine serves on."""


class InjectedFault(RuntimeError):
    """Raised by the fault hook (``PAGEDJAX_FAULT_INJECT=raise:PATH``)."""


class FaultHook:
    """``PAGEDJAX_FAULT_INJECT``'s action ("raise" or "kill") and trigger file."""

    def __init__(self, action: str, path: str):
        if action not in ("raise", "kill"):
            raise ValueError(f"{FAULT_ENV}: action must be 'raise' or 'kill', got {action!r}")
        self.action, self.path = action, path

    def check(self) -> None:
        """Fire once per trigger file (removed first, so a restarted process does not
        fire again on the same file)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"fault injected by {FAULT_ENV} ({self.path})")


class FaultHooks:
    """Several hooks (``PAGEDJAX_FAULT_INJECT=raise:A,kill:B``), checked in order."""

    def __init__(self, hooks: list[FaultHook]):
        self.hooks = hooks

    def check(self) -> None:
        for hook in self.hooks:
            hook.check()


def hook_from_env() -> FaultHooks | None:
    value = os.environ.get(FAULT_ENV)
    if not value:
        return None
    hooks = []
    for spec in value.split(","):
        action, sep, path = spec.partition(":")
        if not sep or not path:
            raise ValueError(f"{FAULT_ENV} must be comma-separated 'raise:PATH' or"
                             f" 'kill:PATH', got {value!r}")  # fmt: skip
        hooks.append(FaultHook(action, path))
    return FaultHooks(hooks)


def batch_request_ids(engine: Any) -> list[str]:
    """Ids of requests holding a scheduler slot that is not swapped out (an LLMEngine);
    when none holds one, the step failed admitting: every unfinished request."""
    book = engine.core.book
    ids = []
    for req in book.requests.values():
        slots = [s.slot for s in req.seqs if s.slot is not None]
        if slots and not all(s in book.swapped_slots for s in slots):
            ids.append(req.request_id)
    return ids or list(book.requests)


def fail_batch(engine: Any, error: BaseException) -> tuple[list[str] | None, StepFailedError]:
    """Abort the failed step's batch (module docstring); (their ids, the error to give
    each). None for the ids with an engine that has no single request book (the fronts
    over several engines): which replica failed is not known, the caller aborts every
    request it has in flight."""
    err = StepFailedError(f"engine step failed: {type(error).__name__}: {error}")
    book = getattr(getattr(engine, "core", None), "book", None)
    if book is None:
        return None, err
    ids = batch_request_ids(engine)
    if ids:
        engine.abort_request(ids)
    return ids, err


class FailureBudget:
    """Consecutive failed steps allowed before the engine counts as dead."""

    def __init__(self, max_consecutive: int = 3):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.run = 0

    def failed(self) -> bool:
        """Record a failed step; True when the run of failures is fatal."""
        self.run += 1
        return self.run >= self.max_consecutive

    def ok(self) -> None:
        self.run = 0


__all__ = [
    "FAULT_ENV", "FailureBudget", "FaultHook", "FaultHooks", "InjectedFault", "StepFailedError",
    "batch_request_ids", "fail_batch", "hook_from_env",
]  # fmt: skip
