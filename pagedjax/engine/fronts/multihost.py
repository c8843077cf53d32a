"""Several processes (hosts) serving one model: ``jax.distributed`` and an SPMD engine.

Every process builds the same ``LLMEngine`` over the global mesh (``jax.devices()`` spans
all processes after ``initialize``; ``tensor_parallel_size`` may cover them all) and runs
the same jitted scheduler and step on its shards. Their host states stay identical because
they see identical inputs in the same order: process 0 (the leader) alone takes requests
(``LLM`` API) and, before each step, broadcasts the step's new requests and aborts to the
others (``MultiHostEngine``: one pickled list of events, sent with
``jax.experimental.multihost_utils.broadcast_one_to_all``, JAX's own collectives, so no
transport of ours); the followers apply them and step (``follow``). Only the leader returns
outputs; a follower's copies are dropped. Arrays the host reads are replicated, so each
process reads its local copy (JAX allows that for replicated global arrays).

Idle: a leader with nothing to run may call ``keepalive()`` (an exchange whose followers
do not step); the server's core loop does so every second (multinode.py).

Failure: ``initialize`` sets JAX's heartbeat timeout (``heartbeat_timeout_s``, 100 s in
JAX by default). When a process dies, the next collective of the others fails (gloo reports
the closed connection) or, if they are idle in one, the coordination service declares the
task dead after the heartbeat timeout and stops them; either way they exit with an error
(tests/test_multihost.py measures the bound with a 5 s heartbeat).

Limits: preemption by swap reads sharded KV blocks to the host, which a process cannot do
for blocks on another process's devices: multi-process engines preempt by recompute
(``swap_space`` is set to 0 by ``LLM``). Data parallelism is per process only.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from pagedjax.engine.outputs import RequestOutput

ENV = ("PAGEDJAX_COORDINATOR_ADDRESS", "PAGEDJAX_NUM_PROCESSES", "PAGEDJAX_PROCESS_ID")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = 100,
) -> None:
    """``jax.distributed.initialize`` with CPU collectives (gloo) enabled, before any other
    JAX call. Arguments default to PAGEDJAX_COORDINATOR_ADDRESS / _NUM_PROCESSES /
    _PROCESS_ID, else JAX's own detection (its environment variables, SLURM...)."""
    env = [os.environ.get(k) for k in ENV]
    coordinator_address = coordinator_address or env[0]
    if num_processes is None and env[1] is not None:
        num_processes = int(env[1])
    if process_id is None and env[2] is not None:
        process_id = int(env[2])
    # CPU devices of different processes talk through gloo (XLA's CPU collectives); a
    # GPU uses NCCL regardless of this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address, num_processes, process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )  # fmt: skip


def is_leader() -> bool:
    return jax.process_index() == 0


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 255).bit_length()  # >= 256 bytes, powers of two: few compiles


class MultiHostEngine:
    """``LLMEngine``'s request interface on the leader; ``follow()`` on the others.

    engine: this process's LLMEngine (built identically on every process).
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.leader = is_leader()
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.arch = engine.arch
        self._pending: list[tuple] = []
        self._stopped = False

    def __getattr__(self, name: str) -> Any:  # stats, num_free_blocks...: this process's
        return getattr(self.engine, name)

    # ------------------------------------------------------------------ leader

    def _leader_only(self, what: str) -> None:
        if not self.leader:
            raise RuntimeError(
                f"{what} on process {jax.process_index()}: only process 0 takes requests;"
                " the others call follow()"
            )

    def add_request(self, request_id: str, prompt: Any, params: Any = None) -> None:
        """Validated here first (a refused request is never broadcast), then queued for
        the followers' next step."""
        self._leader_only("add_request")
        self.engine.add_request(request_id, prompt, params)
        self._pending.append(("add", request_id, prompt, params))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        self._leader_only("abort_request")
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.engine.abort_request(ids)
        self._pending.append(("abort", ids))

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def stop_samples(self, request_id: str, indices: Iterable[int]) -> None:
        """End these samples now (``EngineCore.stop_samples``: the engine core process's
        client matched a stop string); the followers do the same before their next step."""
        self._leader_only("stop_samples")
        indices = list(indices)
        self.engine.core.stop_samples(request_id, indices)
        self._pending.append(("stop_samples", request_id, indices))

    def step(self) -> list[RequestOutput]:
        """Broadcast this step's events, then one engine step on every process."""
        self._leader_only("step")
        events, self._pending = self._pending, []
        self._exchange(events)
        return self.engine.step()

    def keepalive(self) -> None:
        """An exchange without a step, for a leader with nothing to run (the server's
        idle core loop calls it every second): the followers apply the events queued
        meanwhile and come out of the collective they wait in, so none waits inside one
        for longer than the interval (a transport may time out) and a stop reaches them."""
        self._leader_only("keepalive")
        events, self._pending = self._pending, []
        self._exchange([*events, ("idle",)])

    def shutdown(self) -> None:
        """Release the followers (their ``follow()`` returns). Idempotent."""
        if self.leader and not self._stopped:
            self._exchange([*self._pending, ("stop",)])
            self._pending, self._stopped = [], True

    # ------------------------------------------------------------------ followers

    def follow(self, max_steps: int | None = None) -> int:
        """Apply the leader's events and step, until it shuts down (or after
        ``max_steps``, for tests); returns the steps run."""
        if self.leader:
            raise RuntimeError("process 0 leads: it takes requests, it does not follow()")
        steps = 0
        while max_steps is None or steps < max_steps:
            events = self._exchange(None)
            idle = False
            for ev in events:
                if ev[0] == "add":
                    self.engine.add_request(*ev[1:])
                elif ev[0] == "abort":
                    self.engine.abort_request(ev[1])
                elif ev[0] == "stop_samples":
                    self.engine.core.stop_samples(*ev[1:])
                elif ev[0] == "idle":  # the leader's keep-alive: no step
                    idle = True
                elif ev[0] == "stop":
                    return steps
            if idle:
                continue
            self.engine.step()  # the leader stepped too: same state, same decision
            steps += 1
        return steps

    # ------------------------------------------------------------------ transport

    def _exchange(self, events: Sequence[tuple] | None) -> list[tuple]:
        """The leader's events on every process (two broadcasts: length, then bytes)."""
        from jax.experimental import multihost_utils as mh

        payload = pickle.dumps(list(events or ())) if self.leader else b""
        n = int(mh.broadcast_one_to_all(np.array([len(payload)], np.int64),
                                        is_source=self.leader)[0])  # fmt: skip
        buf = np.zeros(_bucket(n), np.uint8)
        buf[: len(payload)] = np.frombuffer(payload, np.uint8)
        got = np.asarray(mh.broadcast_one_to_all(buf, is_source=self.leader))
        return pickle.loads(got[:n].tobytes())  # noqa: S301 - our own processes' bytes


__all__ = ["ENV", "MultiHostEngine", "initialize", "is_leader"]
