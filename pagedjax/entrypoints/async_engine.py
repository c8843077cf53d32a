"""AsyncLLMEngine: an engine client behind asyncio, for a server (vLLM's name and interface).

The engine is any ``EngineClient`` (pagedjax/engine/protocol.py): an ``LLMEngine`` (or its
data-parallel / multi-host fronts) stepped in this process, or an ``MPEngineClient``
whose engine cores step in processes of their own (the server's default,
docs/serving.md). One background thread owns it and is the only code that touches it: it
applies queued commands (add, abort, a function to run on the engine) between steps,
then runs ``step()`` (the K-step decode loop included) while requests are unfinished,
and blocks on its command queue when there are none. An engine with ``wake()``
(``MPEngineClient``) blocks in ``step()`` itself, waiting for its cores' outputs, a core's
death or a wake-up: each queued command wakes it. Asyncio code talks to the thread
through two one-way channels:

- in: a thread-safe ``queue.SimpleQueue`` of commands; putting never blocks.
- out: after each step the thread hands that step's RequestOutputs to each request's
  event loop with one ``loop.call_soon_threadsafe`` per loop, which puts them on the
  request's ``asyncio.Queue``. The thread never waits on the network: a slow client
  only lets its queue grow, and its reader keeps just the newest output (they are
  cumulative).

So an HTTP handler never blocks the engine and the engine never blocks a handler.
``abort(request_id)`` is a command: the thread applies it before the next step, and
``LLMEngine.abort_request`` returns the request's blocks to the pool at once.

Errors: an ``add_request`` that raises (bad prompt, prompt too long) fails that request's
stream with the exception and changes nothing else. A ``step()`` that raises costs its
batch (``engine/faults.py``): the requests holding a slot are aborted (blocks freed) and
fail with ``StepFailedError`` naming the cause; the rest go on. Three failed steps in a
row, or an engine that dies (``MPEngineClient``: a core process died, the error names
its exit code) are fatal: with ``engine_factory`` and restarts left the thread fails
what was in flight, builds a new engine and serves on (``generate`` answers
``EngineRestartingError`` meanwhile); else it fails every request in flight with
``EngineDeadError`` naming the cause, answers every later call with it, and stops;
``is_healthy`` turns False, so a server's /health reports it instead of hanging.
``fail_all(error)`` ends every request in flight with ``error`` (graceful shutdown).

Serving metrics: the thread timestamps each step's outputs (``time.monotonic()``) and,
with a ``stats`` sink, reports per-token and per-request timings (time to first token,
inter-token latency, end-to-end latency, queue time) to it; see ``StatsSink``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedjax.engine.faults import FailureBudget, fail_batch
from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.protocol import EngineClient, EngineDeadError, metrics_snapshot
from pagedjax.entrypoints.request_stats import (
    StatsSink,
    Tracked,
    observe,
    observe_abort,
)
from pagedjax.sampling import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests wait for a scheduler slot than ``max_waiting_requests`` allows."""


class EngineRestartingError(RuntimeError):
    """The engine died and a new one is being started (``max_restarts``); retry."""


class _Stream:
    """One request's output channel: written on its event loop, read by ``generate``."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False  # set on the loop when the last output or an error is put

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        self.queue.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            self.finished = True


class AsyncLLMEngine:
    """Asyncio front of an EngineClient driven by one background thread (module docstring).

    engine: the EngineClient this object now owns (do not call it from other threads);
        ``shutdown()`` shuts it down too when it has a ``shutdown()``.
    max_waiting_requests: refuse ``generate`` with QueueFullError while this many
        requests wait for a scheduler slot (None: unlimited).
    stats: optional StatsSink for serving metrics.
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        max_waiting_requests: int | None = None,
        stats: StatsSink | None = None,
        engine_factory: Callable[[], EngineClient] | None = None,
        max_restarts: int = 0,
    ):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stats = stats
        # Restarts of a dead engine (MPEngineClient: its core process died).
        self._factory, self._restarts_left = engine_factory, max_restarts
        self._restarting = False
        self._dead_cause = ""
        self.restarts = 0  # done so far
        self._failures = FailureBudget()
        # Read-only views handlers may use without the thread (immutable after init).
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_logprobs = engine.max_logprobs
        self.vocab_size = engine.arch.vocab_size
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._tracked: dict[str, Tracked] = {}  # engine thread only
        self._dead: EngineDeadError | None = None
        self._waiting = 0  # published by the thread: requests without a slot
        self._pending_adds = 0  # adds queued but not applied yet (approximate, lock-free)
        self._lock = threading.Lock()
        # An engine that blocks in step() until it has outputs (MPEngineClient).
        self._wake: Callable[[], None] | None = getattr(engine, "wake", None)
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_llm(cls, llm: Any, **kwargs: Any) -> AsyncLLMEngine:
        """Wrap an ``LLM``'s engine (the LLM must not be used afterwards)."""
        return cls(llm.llm_engine, **kwargs)

    # ------------------------------------------------------------------ client side

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and not self._restarting and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (approximate: read without the thread)."""
        return len(self._tracked) + self._pending_adds

    def fail_all(self, error: BaseException) -> concurrent.futures.Future:
        """Abort every request in flight and end each with ``error`` (graceful
        shutdown's last step); the future gives how many."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None:
            fut.set_result(0)
        else:
            self._put(("fail_all", error, fut))
        return fut

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine thread has stopped."""
        if self._dead is not None:
            raise self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

    async def generate(
        self,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative RequestOutputs until it finishes.
        lora_request: its adapter (a pagedjax.lora.LoRARequest; None: the base model).

        Several outputs that arrive while the consumer is busy are merged into the newest
        (they are cumulative). Raises the add_request error (ValueError / TypeError) if
        the engine refuses the request, QueueFullError when the waiting queue is full,
        EngineDeadError if the engine dies. If the consumer stops early (break, a client
        that disconnects, cancellation) the request is aborted and its blocks freed.
        """
        self.check_health()
        if self._restarting:
            raise EngineRestartingError("the engine is restarting after a failure; retry")
        if (
            self.max_waiting_requests is not None
            and self._waiting + self._pending_adds >= self.max_waiting_requests
        ):
            raise QueueFullError(
                f"{self._waiting + self._pending_adds} requests are waiting, the limit"
                f" (--max-num-queued-reqs) is {self.max_waiting_requests}"
            )
        stream = _Stream(request_id, asyncio.get_running_loop())
        with self._lock:
            self._pending_adds += 1
        self._put(("add", request_id, prompt, sampling_params, stream, time.monotonic(),
                   lora_request))  # fmt: skip
        if self._dead is not None:  # died between the check above and the put
            raise self._dead
        done = False
        try:
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty():  # keep the newest (outputs are cumulative)
                    nxt = stream.queue.get_nowait()
                    if isinstance(item, BaseException):
                        break
                    item = nxt
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finished:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); applied before the next step."""
        if self._dead is None:
            self._put(("abort", request_id))

    def _put(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        if self._wake is not None:
            self._wake()

    async def metrics_snapshot(self) -> dict[str, Any]:
        """/metrics' engine numbers (``protocol.metrics_snapshot``), read between steps."""
        return await self.call(metrics_snapshot)

    async def call(self, fn: Callable[[EngineClient], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; returns its result."""
        return await asyncio.wrap_future(self.call_future(fn))

    async def add_lora(self, lora_request: Any) -> bool:
        """The engine's ``add_lora`` (read and check an adapter now) on the engine thread;
        ValueError for a bad adapter or an engine that serves none."""
        return await self.call(lambda e: _lora_call(e, "add_lora", lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """The engine's ``remove_lora`` (deferred while requests use the adapter)."""
        return await self.call(lambda e: _lora_call(e, "remove_lora", lora_id))

    def call_future(self, fn: Callable[[EngineClient], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None:
            fut.set_exception(self._dead)
        else:
            self._put(("call", fn, fut))
            if self._dead is not None:  # died before the thread could take it
                _fail(fut, self._dead)
        return fut

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the thread (requests in flight fail with EngineDeadError), then the
        engine's own shutdown if it has one (MPEngineClient: its core processes)."""
        if self._thread.is_alive():
            self._put(("stop",))
            self._thread.join(timeout)
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        waits = self._wake is not None  # step() itself blocks until there is something
        try:
            while True:
                busy = waits or engine.has_unfinished_requests()
                # Idle: block until a command comes. Busy: take what is there, then step.
                cmds = [] if busy else [self._commands.get()]
                while True:
                    try:
                        cmds.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if any(c[0] == "stop" for c in cmds):
                    self._die(EngineDeadError("the engine was shut down"), cmds)
                    return
                for cmd in cmds:
                    self._apply(cmd)
                if not waits and not engine.has_unfinished_requests():
                    self._waiting = 0
                    continue
                try:
                    outputs = engine.step()
                    self._failures.ok()
                except EngineDeadError as e:  # a core process died (MPEngineClient)
                    if self._restart(e):
                        engine = self.engine
                        continue
                    self._die(e)
                    return
                except Exception as e:  # noqa: BLE001 - the batch's failure (faults.py)
                    log.exception("engine step failed")
                    if self._failures.failed():
                        n, why = self._failures.run, f"{type(e).__name__}: {e}"
                        self._die(EngineDeadError(f"engine step failed {n} times in a row: {why}"))
                        return
                    self._fail_batch(e)
                    continue
                except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt and the like
                    log.exception("engine step failed")
                    self._die(EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"))
                    return
                if waits:
                    for rid, error in engine.pop_request_errors():  # type: ignore[attr-defined]
                        tracked = self._tracked.pop(rid, None)
                        if tracked is not None:
                            _call_soon(tracked.stream, error)
                self._deliver(outputs, time.monotonic())
                self._waiting = engine.request_counts()["waiting"]
        except EngineDeadError as e:  # a core process died under a command (MPEngineClient)
            if self._restart(e):
                self._run()  # the new engine, same thread (one restart = one frame)
                return
            self._die(e)
        except BaseException as e:  # noqa: BLE001 - a bug in this loop must not hang clients
            log.exception("engine thread failed")
            self._die(EngineDeadError(f"engine thread failed: {type(e).__name__}: {e}"))

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, stream, arrival, lora = cmd
            try:
                if rid in self._tracked:
                    raise ValueError(f"request id {rid!r} is already in use")
                if lora is None:  # engines without LoRA keep their add_request signature
                    self.engine.add_request(rid, prompt, params)
                else:
                    self.engine.add_request(rid, prompt, params, lora_request=lora)
            except Exception as e:  # noqa: BLE001 - the request's error, not the engine's
                with self._lock:
                    self._pending_adds -= 1
                stream.loop.call_soon_threadsafe(stream.put, e)
                return
            # Counted as waiting before it stops counting as pending: the queue bound always
            # sees it in one of the two (the step publishes the exact count after).
            with self._lock:
                self._waiting += 1
                self._pending_adds -= 1
            self._tracked[rid] = Tracked(stream, arrival)
        elif kind == "abort":
            rid = cmd[1]
            tracked = self._tracked.pop(rid, None)
            if tracked is None:
                return  # finished already
            self.engine.abort_request(rid)
            observe_abort(self.stats, rid, tracked)
        elif kind == "fail_all":
            _, error, fut = cmd
            rids = list(self._tracked)
            if rids:
                self.engine.abort_request(rids)
            for rid in rids:
                self._fail_request(rid, error)
            if fut.set_running_or_notify_cancel():
                fut.set_result(len(rids))
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _fail_request(self, rid: str, error: BaseException) -> None:
        """End a request (already aborted in the engine) with ``error``."""
        tracked = self._tracked.pop(rid, None)
        if tracked is not None:
            _call_soon(tracked.stream, error)
            observe_abort(self.stats, rid, tracked)

    def _fail_batch(self, error: Exception) -> None:
        """A step raised: abort its batch and fail those requests (faults.fail_batch)."""
        rids, err = fail_batch(self.engine, error)
        if rids is None:  # a front over several engines: everything in flight
            rids = list(self._tracked)
            self.engine.abort_request(rids)
        log.error("failed %d request(s) of the failed step: %s", len(rids), err)
        for rid in rids:
            self._fail_request(rid, err)

    def _restart(self, error: EngineDeadError) -> bool:
        """The engine died: with restarts left, fail what was in flight (it is lost),
        build a new engine with ``engine_factory`` and go on. False when not configured,
        none is left, or the new engine fails to start."""
        if self._factory is None or self._restarts_left <= 0:
            return False
        self._restarts_left -= 1
        self._restarting = True
        try:
            lost = EngineDeadError(f"{error}; the request was lost, the engine is restarting")
            for rid in list(self._tracked):
                self._fail_request(rid, lost)
            log.error("%s: restarting the engine (%d restart(s) left)", error,
                      self._restarts_left)  # fmt: skip
            stop = getattr(self.engine, "shutdown", None)
            if stop is not None:
                stop()
            try:
                engine = self._factory()
            except Exception as e:  # noqa: BLE001 - reported as the death's cause
                log.exception("engine restart failed")
                self._dead_cause = f"; the restart failed: {type(e).__name__}: {e}"
                return False
            self.engine = engine
            self._wake = getattr(engine, "wake", None)
            self._failures.ok()
            self.restarts += 1
            return True
        finally:
            self._restarting = False

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        """Hand a step's outputs to their streams (one callback per event loop) and
        report timings."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted meanwhile
            by_loop.setdefault(tracked.stream.loop, []).append((tracked.stream, out))
            if self.stats is not None:
                observe(self.stats, tracked, out, now)
            if out.finished:
                del self._tracked[out.request_id]
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for stream, _ in items:
                    self._put(("abort", stream.request_id))

    def _die(self, error: EngineDeadError, cmds: list[tuple] = ()) -> None:
        """Fail everything in flight and everything queued with ``error``; stop."""
        if self._dead_cause:
            error = EngineDeadError(f"{error}{self._dead_cause}")
        self._dead = error
        for rid, tracked in list(self._tracked.items()):
            stream = tracked.stream
            try:
                stream.loop.call_soon_threadsafe(stream.put, error)
            except RuntimeError:
                pass
            del self._tracked[rid]
        pending = list(cmds)
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            if cmd[0] == "add":
                stream = cmd[4]
                try:
                    stream.loop.call_soon_threadsafe(stream.put, error)
                except RuntimeError:
                    pass
            elif cmd[0] == "call":
                _fail(cmd[2], error)
            elif cmd[0] == "fail_all":
                _fail(cmd[2], error)


def _lora_call(engine: Any, name: str, arg: Any) -> Any:
    """engine.<name>(arg); ValueError for an engine without runtime adapters (the
    in-process data-parallel and multi-host fronts)."""
    fn = getattr(engine, name, None)
    if fn is None:
        raise ValueError(f"this engine ({type(engine).__name__}) does not load LoRA adapters"
                         f" at run time")  # fmt: skip
    return fn(arg)


def _call_soon(stream: _Stream, item: Any) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.put, item)
    except RuntimeError:  # the loop is closed
        pass


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)


def _fail(fut: concurrent.futures.Future, error: BaseException) -> None:
    """Fail a pending future; no-op if someone else already took it."""
    try:
        if fut.set_running_or_notify_cancel():
            fut.set_exception(error)
    except (RuntimeError, concurrent.futures.InvalidStateError):
        pass
