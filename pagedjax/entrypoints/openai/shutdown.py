"""Graceful shutdown: on SIGTERM / SIGINT stop accepting, drain, abort the rest, exit 0.

Contract (``--shutdown-timeout``, vLLM 0.32's flag). On the first SIGTERM or SIGINT:

1. every new HTTP request, /health included, is answered 503 ``ServiceUnavailableError``
   with ``Retry-After`` and ``Connection: close`` (a load balancer takes the replica out;
   its clients retry elsewhere). The listening socket stays open meanwhile, so a client
   gets that answer rather than a refused connection;
2. requests in flight (streams included) run on until they finish, for at most
   ``--shutdown-timeout`` seconds;
3. then every request still in flight is aborted (blocks freed) and ends with a 503
   ``ShuttingDownError`` naming the timeout: a non-streamed one as its response, a
   stream as an error event followed by ``data: [DONE]``;
4. the server closes, logs the final request counters (``ServerMetrics.summary``), shuts
   the engine down (its core processes reaped) and the process exits with status 0.

A second signal skips what is left of the drain (uvicorn's forced exit). vLLM's default
timeout is 0 (abort at once); pagedjax's is ``DEFAULT_SHUTDOWN_TIMEOUT_S`` = 20 s: long
enough for most requests in flight to finish, and short enough to end inside
Kubernetes' default 30 s grace period before its SIGKILL (docs/security.md).

``Drainer`` holds the state and counts HTTP requests in flight (``DrainMiddleware``, a
plain ASGI middleware, so a stream counts until its last byte); ``DrainingServer`` is
uvicorn's Server with the signal handling above.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

import uvicorn

from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.openai.limits import ShuttingDownError, unavailable

log = logging.getLogger("pagedjax.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
ABORT_GRACE_S = 5.0  # after the abort, time for the aborted responses to be written


def add_shutdown_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM / SIGINT: seconds to let requests in flight finish (new ones get"
        " 503) before the rest are aborted; 0 aborts at once (vLLM's default). pagedjax's"
        f" default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g}",
    )  # fmt: skip


class Drainer:
    """One app's shutdown state: draining or not, HTTP requests in flight."""

    def __init__(self, engine: AsyncLLMEngine, timeout_s: float, metrics: Any = None):
        if timeout_s < 0:
            raise ValueError(f"the shutdown timeout must be >= 0, got {timeout_s}")
        self.engine, self.timeout_s, self.metrics = engine, timeout_s, metrics
        self.draining = False
        self.in_flight = 0
        self.aborted = 0  # requests ended by the drain's abort

    async def drain(self) -> int:
        """Stop accepting, wait for requests in flight up to the timeout, abort the rest
        and wait for their answers to go out. Returns how many were aborted."""
        self.draining = True
        t0 = time.monotonic()
        log.info("shutting down: %d request(s) in flight, waiting up to %g s",
                 self.in_flight, self.timeout_s)  # fmt: skip
        while self.in_flight and time.monotonic() - t0 < self.timeout_s:
            await asyncio.sleep(0.05)
        if self.in_flight or self.engine.num_in_flight:
            error = ShuttingDownError(
                f"the server is shutting down: the request was aborted after"
                f" --shutdown-timeout {self.timeout_s:g} s"
            )
            if self.engine.is_healthy:
                self.aborted = await asyncio.wrap_future(self.engine.fail_all(error))
            t1 = time.monotonic()
            while self.in_flight and time.monotonic() - t1 < ABORT_GRACE_S:
                await asyncio.sleep(0.05)
        log.info("drained in %.2f s: %d request(s) aborted, %d still open",
                 time.monotonic() - t0, self.aborted, self.in_flight)  # fmt: skip
        return self.aborted


class DrainMiddleware:
    """Counts HTTP requests in flight; answers 503 to new ones while draining."""

    def __init__(self, app: Any, drainer: Drainer):
        self.app, self.drainer = app, drainer

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        d = self.drainer
        if d.draining:
            err = unavailable("the server is shutting down", "shutting_down", 5)
            if d.metrics is not None:
                d.metrics.rejected(err.reason)
            body = json.dumps(err.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]  # fmt: skip
            headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        d.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            d.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose first SIGTERM / SIGINT drains (module docstring), and
    whose exit after a drain is a normal return (status 0), not the signal re-raised."""

    def __init__(self, config: uvicorn.Config, drainer: Drainer):
        super().__init__(config)
        self.drainer = drainer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is None or self.should_exit:  # not serving yet, or exiting
            self.should_exit = True
            self.force_exit = self.force_exit or self._drain_task is not None
            return
        if self.drainer.draining:  # a second signal: exit now
            log.warning("second signal: exiting without waiting for the drain")
            self.should_exit = self.force_exit = True
            return
        self.drainer.draining = True  # from this instant on, new requests get 503
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def run() -> None:
            try:
                await self.drainer.drain()
            finally:
                self.should_exit = True

        self._drain_task = asyncio.ensure_future(run())


__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT_S", "DrainMiddleware", "Drainer", "DrainingServer",
    "add_shutdown_args",
]  # fmt: skip
