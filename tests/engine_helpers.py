"""Shared by the engine tests: one ``drain`` (it was written six times).

``drain(engine, arrivals)`` steps an ``LLMEngine`` until it is idle, adding each
``(request_id, prompt, params)`` at its arrival step (``arrivals``: ``{step: [...]}``, or a
list: all at step 0), calls ``on_step(engine)`` after every step, and returns
``{request_id: final RequestOutput}``. Each request must finish exactly once, within
``max_steps`` steps (else a hang or starvation fails the test).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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


__all__ = ["drain"]
