"""MPEngineClient: the engine core in processes of its own, behind EngineClient.

As vLLM v1's core client: the API process keeps the tokenizer, validation, routing and
the rebuilding of outputs; each data-parallel replica is an ``LLMEngine`` in a spawned
process (``core_process.run_core``, built from the ``EngineConfig``) that steps as fast
as it can, so the server's JSON and socket work no longer competes with the step loop
for one interpreter's GIL, and replicas step at the same time.

- ``add_request`` tokenizes and validates here (the same checks as ``LLMEngine``, on
  the facts the core reports at start: a refused request raises at once and never
  reaches a core), routes (``Router``, with several replicas) and sends the ids.
- ``step()`` blocks until some core sent outputs (or ``wake()`` is called, or a core
  dies) and returns the RequestOutputs rebuilt from the compact deltas
  (``core_process.OutputDecoder``), detokenized here, with stop strings matched here:
  equal to what an in-process engine returns.
- ``request_counts()`` is the cores' counts as of their last iteration (they come with
  every message); ``stats()``, ``snapshot()``, ``num_free_blocks()`` are named RPCs (a
  round trip, answered between two steps).
- A core that dies (killed, crashed, a step that raised) is seen at once (EOF on its
  connection, its process sentinel): every later call raises ``EngineDeadError`` naming
  the exit code (and the core's own last error), the other cores are stopped.
- ``shutdown()`` stops the cores ("stop", then terminate / kill after a timeout) and
  reaps them; it also runs when the client is garbage-collected and at exit.

Single-threaded: one thread calls the methods (the AsyncLLMEngine thread), except
``wake()``, which any thread may call.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import weakref
from collections.abc import Iterable, Sequence
from multiprocessing.connection import wait
from typing import Any

from pagedjax.config import EngineConfig
from pagedjax.engine.core_process import OutputDecoder, dumps, run_core
from pagedjax.engine.faults import StepFailedError
from pagedjax.engine.fronts.data_parallel import merge_counts, merge_stats
from pagedjax.engine.fronts.router import Router
from pagedjax.engine.logit_controls import LogitControls
from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.prompts import check_request, check_request_args, tokenize_prompt
from pagedjax.engine.protocol import EngineDeadError
from pagedjax.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_LOGPROBS = 20  # llm_engine.DEFAULT_MAX_LOGPROBS (not imported: no JAX here)
START_TIMEOUT_S = 600.0


class _Core:
    """One core process and its connection."""

    def __init__(self, index: int, proc: Any, conn: Any):
        self.index, self.proc, self.conn = index, proc, conn
        self.facts: dict[str, Any] = {}
        self.counts: dict[str, int] = dict(running=0, waiting=0, swapped=0, slots_in_use=0)
        self.last_error: str | None = None

    def describe_death(self) -> str:
        self.proc.join(5)
        code = self.proc.exitcode
        if code is not None and code < 0:
            try:
                why = f"exit code {code} ({signal.Signals(-code).name})"
            except ValueError:
                why = f"exit code {code}"
        else:
            why = f"exit code {code}"
        own = f": {self.last_error}" if self.last_error else ""
        return f"engine core process {self.index} (pid {self.proc.pid}) died with {why}{own}"


class MPEngineClient:
    """EngineClient over ``config.parallel.data_parallel_size`` core processes.

    config: the EngineConfig each core builds its LLMEngine from (each with
    data_parallel_size 1 and its own devices: on a GPU, ``CUDA_VISIBLE_DEVICES`` narrowed
    to replica r's; on a CPU with forced host devices, device r). tokenizer: the API
    process' tokenizer (default: loaded from config.model, as the core loads its own).
    start_timeout_s: how long to wait for the cores to load and report ready.
    node: a ``multinode.NodeConfig`` of several nodes (one replica): the core is node
    0's engine, leading the headless nodes' (pagedjax/engine/fronts/multinode.py); a
    node lost makes the core exit, and this client reports it as the core's death.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        tokenizer: Any = None,
        start_timeout_s: float = START_TIMEOUT_S,
        node: Any = None,
    ):
        par = config.parallel
        m = par.data_parallel_size
        if node is not None and m > 1:
            raise ValueError("several nodes serve one replica: data_parallel_size must be 1")
        self.config = config
        self._controls: LogitControls | None = None  # add_request's constraint checks
        core_config = dataclasses.replace(
            config, parallel=dataclasses.replace(par, data_parallel_size=1)
        )
        ctx = multiprocessing.get_context("spawn")
        self._cores: list[_Core] = []
        self._dead: EngineDeadError | None = None
        self._closed = False
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        self._wake_r, self._wake_w = wake_r, wake_w
        self._finalizer = weakref.finalize(self, _stop_all, self._cores, (wake_r, wake_w))
        for r in range(m):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=run_core, args=(core_config, max_logprobs, child, r, m, node),
                name=f"pagedjax-core-{r}", daemon=True,
            )  # fmt: skip
            proc.start()
            child.close()
            self._cores.append(_Core(r, proc, parent))
        try:
            if tokenizer is None:
                from pagedjax.engine.loading import load_model_tokenizer

                tokenizer = load_model_tokenizer(config.model)
            self.tokenizer = tokenizer
            for core in self._cores:
                self._wait_ready(core, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        facts = self._cores[0].facts
        self.max_model_len: int = facts["max_model_len"]
        self.max_logprobs: int = facts["max_logprobs"]
        self.arch = facts["arch"]  # the model's ModelArch
        self.vocab_size: int = self.arch.vocab_size
        self.block_size: int = facts["block_size"]
        self._facts = facts
        self.router = Router(m, par.data_parallel_routing, block_size=self.block_size)
        self._replica_of: dict[str, int] = {}  # unfinished requests
        self._decoder = OutputDecoder(self.tokenizer)  # detokenizes here (core_process.py)
        self._buffer: list[RequestOutput] = []  # outputs read while waiting for an RPC
        self._errors: list[tuple[str, Exception]] = []
        self._calls = itertools.count()
        self._replies: dict[int, tuple] = {}
        self._loras_checked: dict[int, Any] = {}  # adapter id -> LoRARequest read once

    @property
    def num_replicas(self) -> int:
        return len(self._cores)

    @property
    def pids(self) -> list[int]:
        """The core processes' ids (tests, operators)."""
        return [c.proc.pid for c in self._cores]

    def _wait_ready(self, core: _Core, timeout: float) -> None:
        ready = wait([core.conn, core.proc.sentinel], timeout)
        if not ready:
            raise TimeoutError(f"engine core process {core.index} did not start in {timeout} s")
        try:
            msg = pickle.loads(core.conn.recv_bytes())
        except (EOFError, OSError):
            raise RuntimeError(core.describe_death()) from None
        if msg[0] != "ready":
            core.last_error = msg[1] if msg[0] == "error" else repr(msg)
            raise RuntimeError(core.describe_death())
        core.facts = msg[1]

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: str | Sequence[int] | dict,
        params: SamplingParams | None = None, lora_request: Any = None,
    ) -> int:  # fmt: skip
        """Validate (as LLMEngine.add_request: raises, changing nothing), route, send.
        lora_request: a pagedjax.lora.LoRARequest (the core loads it; its checkpoint is
        checked here once per adapter id, so a bad one is this call's error). Returns
        the replica."""
        self._check_alive()
        params = check_request_args(request_id, params, self._replica_of)
        if lora_request is not None:
            self._check_lora(lora_request)
        f = self._facts
        text, ids = tokenize_prompt(self.tokenizer, self.vocab_size, prompt)
        check_request(
            ids, params, sched_limits=f["sched_limits"], max_model_len=f["max_model_len"],
            num_blocks=f["num_blocks"], block_size=f["block_size"],
            watermark_blocks=f["watermark_blocks"], max_logprobs=f["max_logprobs"],
            vocab_size=self.vocab_size,
        )  # fmt: skip
        if params.structured_outputs is not None or params.bad_words:
            # Compiled here too, so a bad constraint is this call's ValueError (the
            # server's 400), not a later "failed" message from the core.
            if self._controls is None:
                eos = {self.tokenizer.eos_token_id} - {None}
                self._controls = LogitControls(self.vocab_size, self.tokenizer,
                                               self.config.structured_outputs, eos)  # fmt: skip
            self._controls.prepare(params, fsm=False)  # the core builds any device FSM
        out = params.max_tokens or max(self.max_model_len - len(ids), 1)
        replica = self.router.route(request_id, ids, len(ids) + out * max(params.n, 1))
        self._replica_of[request_id] = replica
        self._decoder.expect(request_id, params)
        sent = {"prompt": text, "prompt_token_ids": ids}
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            # Images travel as given (encoded bytes from the server); the core expands the
            # placeholders and refuses what does not fit (multimodal.py).
            sent["multi_modal_data"] = prompt["multi_modal_data"]
        msg = ("add", request_id, sent, params)
        self._send(self._cores[replica], msg if lora_request is None else (*msg, lora_request))
        return replica

    def _check_lora(self, lora: Any) -> None:
        """ValueError unless LoRA is on and ``lora``'s checkpoint is servable (read once
        per adapter id here; the core reads it again into its own host cache)."""
        from pagedjax.lora import LoRARequest, llama_module_shapes, load_peft_adapter

        cfg = self.config.lora
        if cfg is None:
            raise ValueError("lora_request given but LoRA is not enabled (--enable-lora)")
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if self._loras_checked.get(lora.lora_int_id) == lora:
            return
        load_peft_adapter(lora.lora_path, llama_module_shapes(self.arch), self.arch.num_layers,
                          cfg.max_lora_rank)  # fmt: skip
        self._loras_checked[lora.lora_int_id] = lora

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Forget the requests here and abort them in their cores (their blocks are freed
        before the core's next step); unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        by_core: dict[int, list[str]] = {}
        for rid in ids:
            replica = self._replica_of.pop(rid, None)
            if replica is None:
                continue
            self.router.finish(rid)
            self._decoder.forget(rid)
            by_core.setdefault(replica, []).append(rid)
        if self._dead is None:
            for replica, rids in by_core.items():
                self._send(self._cores[replica], ("abort", rids))

    def has_unfinished_requests(self) -> bool:
        return bool(self._replica_of)

    def get_num_unfinished_requests(self) -> int:
        return len(self._replica_of)

    def pop_request_errors(self) -> list[tuple[str, Exception]]:
        """(request id, error) of requests a core refused after this client accepted
        them (normally none: the client runs the core's checks first)."""
        errors, self._errors = self._errors, []
        return errors

    # ------------------------------------------------------------------ outputs

    def wake(self) -> None:
        """Make a blocked ``step()`` return (from any thread)."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken (the pipe is full) or closed

    def step(self) -> list[RequestOutput]:
        """The outputs the cores sent since the last call; blocks until there are some,
        a request failed in a core (``pop_request_errors``), ``wake()`` is called or a core
        dies (EngineDeadError)."""
        self._check_alive()
        if self._buffer:
            out, self._buffer = self._buffer, []
            return out
        conns = {c.conn: c for c in self._cores}
        sentinels = {c.proc.sentinel: c for c in self._cores}
        while True:
            ready = wait([*conns, *sentinels, self._wake_r])
            woken = False
            for x in ready:
                if x == self._wake_r:
                    _drain(self._wake_r)
                    woken = True
                elif x in conns:
                    self._read(conns[x])
                else:  # a sentinel without EOF first: read what is left, then report
                    self._read(sentinels[x])
                    self._died(sentinels[x])
            if self._buffer or woken or self._errors:  # errors: pop_request_errors
                out, self._buffer = self._buffer, []
                return out

    def _read(self, core: _Core) -> None:
        """Every message waiting on the core's connection."""
        conn = core.conn
        try:
            while conn.poll():
                self._handle(core, pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError):
            self._died(core)

    def _handle(self, core: _Core, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            _, items, counts = msg
            if counts is not None:
                core.counts = counts
            live = [it for it in items if it[0] in self._replica_of]  # not aborted here
            outs = self._decoder.decode(live)
            stops, self._decoder.stops = self._decoder.stops, []
            for rid, indices in stops:  # stop strings matched here: the core stops them
                if self._dead is None:
                    self._send(core, ("stop_samples", rid, indices))
            for o in outs:
                if o.finished:
                    del self._replica_of[o.request_id]
                    self.router.finish(o.request_id)
            self._buffer.extend(outs)
        elif kind == "rpc":
            self._replies[msg[1]] = msg[2:]
        elif kind == "failed":
            _, rid, etype, text = msg
            if self._replica_of.pop(rid, None) is not None:
                self.router.finish(rid)
                self._decoder.forget(rid)
                cls = {"ValueError": ValueError, "TypeError": TypeError,
                       "StepFailedError": StepFailedError}.get(etype, RuntimeError)
                self._errors.append((rid, cls(text)))
        elif kind == "error":
            core.last_error = msg[1]
        else:
            log.warning("engine core %d sent an unknown message %r", core.index, kind)

    def _died(self, core: _Core) -> None:
        if self._dead is None:
            self._dead = EngineDeadError(core.describe_death())
            log.error("%s", self._dead)
            _stop_all(self._cores, None)  # the others are of no use without it
        raise self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("the engine core client was shut down")

    def _send(self, core: _Core, msg: tuple) -> None:
        try:
            core.conn.send_bytes(dumps(msg))
        except (OSError, ValueError):
            self._read(core)  # EOF: report the death with its exit code
            self._died(core)

    # ------------------------------------------------------------------ RPCs

    def _rpc(self, name: str, *args: Any) -> list[Any]:
        """Call a named engine method (core_process.RPCS) with ``args`` on every core;
        their results. A ValueError / TypeError in a core is raised as such (the text
        names the core's exception), anything else as RuntimeError."""
        self._check_alive()
        calls = {}
        for core in self._cores:
            call_id = next(self._calls)
            calls[call_id] = core
            self._send(core, ("rpc", call_id, name, *args))
        conns = {c.conn: c for c in calls.values()}
        sentinels = {c.proc.sentinel: c for c in calls.values()}
        while not all(i in self._replies for i in calls):
            for x in wait([*conns, *sentinels]):
                core = conns.get(x) or sentinels[x]
                self._read(core)
                if x in sentinels:
                    self._died(core)
        results = []
        for call_id in calls:
            ok, value, *etype = self._replies.pop(call_id)
            if not ok:
                cls = {"ValueError": ValueError, "TypeError": TypeError}.get(
                    etype[0] if etype else "", RuntimeError)  # fmt: skip
                raise cls(f"engine core RPC {name}: {value}")
            results.append(value)
        return results

    # ------------------------------------------------------------------ LoRA adapters

    def add_lora(self, lora_request: Any) -> bool:
        """vLLM's add_lora on every core (``LLMEngine.add_lora``): the checkpoint is
        checked here first, so a bad adapter is this call's ValueError before any core
        sees it."""
        self._check_lora(lora_request)
        return all(self._rpc("add_lora", lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's remove_lora on every core (deferred there while requests use it)."""
        self._loras_checked.pop(lora_id, None)
        return any(self._rpc("remove_lora", lora_id))

    def list_loras(self) -> set[int]:
        return set().union(*self._rpc("list_loras"))

    def request_counts(self) -> dict[str, int]:
        """Unfinished requests by where they are, as of each core's last iteration."""
        return merge_counts([c.counts for c in self._cores])

    def stats(self) -> dict[str, float | int]:
        return merge_stats(self._rpc("stats"))

    def reset_stats(self) -> None:
        self._rpc("reset_stats")

    def num_free_blocks(self) -> int:
        return sum(self._rpc("num_free_blocks"))

    def num_usable_blocks(self) -> int:
        return sum(self._rpc("num_usable_blocks"))

    @property
    def num_preemptions(self) -> int:
        return self.snapshot()["preemptions"]

    def snapshot(self) -> dict[str, Any]:
        """protocol.metrics_snapshot over every core, merged (one round trip each)."""
        per = self._rpc("snapshot")
        for core, snap in zip(self._cores, per, strict=True):
            core.counts = snap["counts"]
        return dict(
            counts=merge_counts([s["counts"] for s in per]),
            free=sum(s["free"] for s in per),
            usable=sum(s["usable"] for s in per),
            preemptions=sum(s["preemptions"] for s in per),
            stats=merge_stats([s["stats"] for s in per]),
        )

    # ------------------------------------------------------------------ shutdown

    def is_alive(self) -> bool:
        return self._dead is None and not self._closed

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop and reap every core process (idempotent)."""
        self._closed = True
        self._finalizer.detach()
        _stop_all(self._cores, (self._wake_r, self._wake_w), timeout)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _stop_all(cores: list[_Core], fds: tuple[int, int] | None, timeout: float = 10.0) -> None:
    """ "stop" to every live core, then terminate and kill what does not exit; close."""
    for core in cores:
        if core.proc.is_alive():
            try:
                core.conn.send_bytes(dumps(("stop",)))
            except (OSError, ValueError):
                pass
    for core in cores:
        core.proc.join(timeout)
        if core.proc.is_alive():
            core.proc.terminate()
            core.proc.join(5)
        if core.proc.is_alive():
            core.proc.kill()
            core.proc.join(5)
        core.conn.close()
    if fds is not None:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


__all__ = ["MPEngineClient"]
