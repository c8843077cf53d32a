"""Shared by the engine tests: one ``drain`` (it was written six times).

``drain(engine, arrivals)`` steps an ``LLMEngine`` until it is idle, adding each
``(request_id, prompt, params)`` at its arrival step (``arrivals``: ``{step: [...]}``, or a
list: all at step 0), calls ``on_step(engine)`` after every step, and returns
``{request_id: final RequestOutput}``. Each request must finish exactly once, within
``max_steps`` steps (else a hang or starvation fails the test).
``xla_flags_with_devices(n)``: XLA_FLAGS for a subprocess with ``n`` simulated devices.
``serve_in_thread(app)``: an ASGI app on a free loopback port, served by uvicorn in a daemon
thread; returns ``(server, thread, url)`` once it accepts connections.
``free_port()``: a loopback port free now. ``wait_healthy(url, procs, timeout, log)``: poll a
server subprocess's ``/health`` until it answers 200; fail at once, with ``log()``, when one
of ``procs`` has exited, or at the timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


def xla_flags_with_devices(count: int) -> str:
    """This process's XLA_FLAGS (tests/conftest.py's compile flags included) plus ``count``
    simulated CPU devices, for a subprocess: the child compiles with the same flags as the
    tests that compare against it, so results agree to the bit."""
    flags = os.environ.get("XLA_FLAGS", "")
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()


def drain(
    engine: Any,
    arrivals: dict[int, list] | list | None = None,
    *,
    max_steps: int = 2000,
    on_step: Callable[[Any], None] | None = None,
) -> dict:
    if isinstance(arrivals, list):
        arrivals = {0: arrivals} if arrivals else {}
    arrivals = arrivals or {}
    done: dict = {}
    step = 0
    while engine.has_unfinished_requests() or any(k >= step for k in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, f"{out.request_id} finished twice"
                done[out.request_id] = out
        if on_step is not None:
            on_step(engine)
        step += 1
        assert step < max_steps, "engine did not finish (hang or starvation)"
    return done


def free_port() -> int:
    """A loopback port that is free now (the OS picks it; a later bind may still race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    url: str,
    procs: Sequence[subprocess.Popen],
    timeout: float,
    log: Callable[[], str] = lambda: "",
    interval: float = 0.3,
) -> None:
    """Poll ``url + "/health"`` until it answers 200. Fails (AssertionError carrying
    ``log()``, e.g. the server's log tail) as soon as any of ``procs`` has exited, so a
    server that died at start-up fails the test at once instead of at the timeout."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        exited = [p.returncode for p in procs if p.poll() is not None]
        assert not exited, f"server process exited ({exited}) before /health answered:\n{log()}"
        assert time.monotonic() < deadline, f"/health not 200 within {timeout} s:\n{log()}"
        time.sleep(interval)


def serve_in_thread(app: Any, **config: Any) -> tuple[Any, threading.Thread, str]:
    """Serve ``app`` on 127.0.0.1 (a free port) in a daemon thread; ``config``: more
    ``uvicorn.Config`` options. Fails the test if uvicorn has not started within 30 s."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", **config))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


__all__ = ["drain", "free_port", "serve_in_thread", "wait_healthy", "xla_flags_with_devices"]
