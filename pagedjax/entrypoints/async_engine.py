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
stream with the exception and changes nothing else. A ``step()`` that raises is fatal
(the engine's state may be inconsistent; with ``MPEngineClient``: a core process died,
and the error names its exit code): the thread fails every request in flight with
``EngineDeadError`` naming the cause, answers every later call with it, and stops;
``is_healthy`` turns False, so a server's /health reports it instead of hanging.

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
from dataclasses import dataclass
from typing import Any, Protocol

from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.protocol import EngineClient, EngineDeadError, metrics_snapshot
from pagedjax.sampling import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests wait for a scheduler slot than ``max_waiting_requests`` allows."""


@dataclass
class FinishedRequestStats:
    """Timings of one finished (or aborted) request, in seconds on the monotonic clock.

    queue_time: arrival -> first scheduler slot (None if it never got one).
    ttft: arrival -> first output token read back (None without a token).
    e2e: arrival -> finish. tpot: (finish - first token) / (generated tokens - 1) of
    sample 0 (None with fewer than two tokens), vLLM's time per output token.
    finish_reason: sample 0's ("stop", "length") or "abort".
    """

    request_id: str
    prompt_tokens: int
    generation_tokens: int
    queue_time: float | None
    ttft: float | None
    e2e: float
    tpot: float | None
    finish_reason: str


class StatsSink(Protocol):
    """Receives timings from the engine thread (keep it cheap: it runs between steps)."""

    def on_first_token(self, ttft: float) -> None: ...

    def on_inter_token(self, seconds: float, count: int) -> None: ...

    def on_finished(self, stats: FinishedRequestStats) -> None: ...


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request in flight."""

    stream: _Stream
    arrival: float
    generated: int = 0  # output tokens over all samples, so far
    prompt_tokens: int = 0  # known from the first output on
    first_token: float | None = None
    last_token: float | None = None


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
    ):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stats = stats
        # Read-only views handlers may use without the thread (immutable after init).
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_logprobs = engine.max_logprobs
        self.vocab_size = engine.arch.vocab_size
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
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
        return self._dead is None and self._thread.is_alive()

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
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative RequestOutputs until it finishes.

        Several outputs that arrive while the consumer is busy are merged into the newest
        (they are cumulative). Raises the add_request error (ValueError / TypeError) if
        the engine refuses the request, QueueFullError when the waiting queue is full,
        EngineDeadError if the engine dies. If the consumer stops early (break, a client
        that disconnects, cancellation) the request is aborted and its blocks freed.
        """
        self.check_health()
        if (
            self.max_waiting_requests is not None
            and self._waiting + self._pending_adds >= self.max_waiting_requests
        ):
            raise QueueFullError(
                f"{self._waiting + self._pending_adds} requests are waiting, the limit"
                f" (--max-waiting-requests) is {self.max_waiting_requests}"
            )
        stream = _Stream(request_id, asyncio.get_running_loop())
        with self._lock:
            self._pending_adds += 1
        self._put(("add", request_id, prompt, sampling_params, stream, time.monotonic()))
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
                except EngineDeadError as e:  # a core process died (MPEngineClient)
                    self._die(e)
                    return
                except BaseException as e:  # noqa: BLE001 - any failure kills the engine
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
            self._die(e)
        except BaseException as e:  # noqa: BLE001 - a bug in this loop must not hang clients
            log.exception("engine thread failed")
            self._die(EngineDeadError(f"engine thread failed: {type(e).__name__}: {e}"))

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, stream, arrival = cmd
            with self._lock:
                self._pending_adds -= 1
            try:
                if rid in self._tracked:
                    raise ValueError(f"request id {rid!r} is already in use")
                self.engine.add_request(rid, prompt, params)
            except Exception as e:  # noqa: BLE001 - the request's error, not the engine's
                stream.loop.call_soon_threadsafe(stream.put, e)
                return
            self._tracked[rid] = _Tracked(stream, arrival)
        elif kind == "abort":
            rid = cmd[1]
            tracked = self._tracked.pop(rid, None)
            if tracked is None:
                return  # finished already
            self.engine.abort_request(rid)
            if self.stats is not None:
                now = time.monotonic()
                ttft = _since(tracked.first_token, tracked)
                self.stats.on_finished(
                    FinishedRequestStats(
                        rid, tracked.prompt_tokens, tracked.generated, None, ttft,
                        now - tracked.arrival, None, "abort",
                    )
                )  # fmt: skip
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

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
                self._observe(tracked, out, now)
            if out.finished:
                del self._tracked[out.request_id]
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for stream, _ in items:
                    self._put(("abort", stream.request_id))

    def _observe(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        stats = self.stats
        assert stats is not None
        total = sum(len(c.token_ids) for c in out.outputs)
        tracked.prompt_tokens = len(out.prompt_token_ids)
        new = total - tracked.generated
        if new > 0:
            if tracked.first_token is None:
                tracked.first_token = now
                stats.on_first_token(now - tracked.arrival)
                if new > 1:
                    stats.on_inter_token(0.0, new - 1)  # n > 1 samples of the same step
            else:
                stats.on_inter_token((now - tracked.last_token) / new, new)
            tracked.last_token = now
            tracked.generated = total
        if out.finished:
            first = out.outputs[0] if out.outputs else None
            m = out.metrics
            queue_time = (
                m.first_scheduled_time - tracked.arrival
                if m is not None and m.first_scheduled_time is not None
                else None
            )
            n0 = len(first.token_ids) if first is not None else 0
            tpot = (
                (now - tracked.first_token) / (n0 - 1)
                if tracked.first_token is not None and n0 > 1
                else None
            )
            stats.on_finished(
                FinishedRequestStats(
                    out.request_id,
                    len(out.prompt_token_ids),
                    total,
                    max(queue_time, 0.0) if queue_time is not None else None,
                    _since(tracked.first_token, tracked),
                    now - tracked.arrival,
                    tpot,
                    (first.finish_reason if first is not None else None) or "stop",
                )
            )

    def _die(self, error: EngineDeadError, cmds: list[tuple] = ()) -> None:
        """Fail everything in flight and everything queued with ``error``; stop."""
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


def _since(t: float | None, tracked: _Tracked) -> float | None:
    return None if t is None else t - tracked.arrival
