"""The engine core process: one LLMEngine stepping in a process of its own.

``MPEngineClient`` (``core_client.py``) starts ``run_core`` in a spawned process per
data-parallel replica. The loop: apply every command that has arrived (add, abort, a
named RPC, stop), then one ``step()`` if a request is unfinished, and send that step's
outputs as one message. It blocks on the connection only when no request is unfinished,
so the core never waits on the API process while there is work; the API process reads
continuously (a reader thread), so the core's sends do not wait either. A step that
raises costs its batch only (``faults.fail_batch``: those requests are aborted and
reported "failed" with a StepFailedError); three failed steps in a row end the process
with EXIT_STEP_FAILED, which the client reports as the engine's death.

Messages are pickled tuples of plain values (``OutputEncoder``): per step, per request
only what is new since the last message (new token ids, new logprobs entries, the text
to keep and the text delta, cumulative logprob, finish and stop reason), the prompt once,
the request's timeline when it changes; never the cumulative RequestOutput. Detokenization
and stop strings stay in the core (the engine's output processor does them inside the
step; see docs/serving.md, "Engine core process"). ``OutputDecoder`` on the client side
rebuilds RequestOutputs equal to the engine's.

client -> core: ("add", rid, prompt, params) | ("abort", [rids]) |
    ("rpc", call_id, name) | ("stop",)
core -> client: ("ready", facts) | ("out", items, counts or None) |
    ("rpc", call_id, ok, value) | ("failed", rid, error type, message) | ("error", message)
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Sequence
from typing import Any

from pagedjax.engine.faults import FailureBudget, fail_batch
from pagedjax.engine.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from pagedjax.engine.protocol import metrics_snapshot

log = logging.getLogger(__name__)

# The engine methods a client may call by name (nothing else runs in the core on request).
RPCS = ("snapshot", "stats", "request_counts", "num_free_blocks", "num_usable_blocks",
        "get_num_unfinished_requests", "reset_stats")  # fmt: skip

# Exit codes of the core (besides a signal's negative code).
EXIT_STEP_FAILED = 3
EXIT_START_FAILED = 4


def dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


# ------------------------------------------------------------------ the delta encoding


def _enc_lp(entry: dict[int, Logprob] | None) -> tuple | None:
    if entry is None:
        return None
    return tuple((t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in entry.items())


def _dec_lp(entry: tuple | None) -> dict[int, Logprob] | None:
    if entry is None:
        return None
    return {t: Logprob(lp, rank, text) for t, lp, rank, text in entry}


class _Sent:
    """What the client already has of one request."""

    __slots__ = ("head", "plp", "metrics", "comps")

    def __init__(self) -> None:
        self.head = False  # prompt text and ids sent
        self.plp = 0  # prompt logprobs entries sent
        self.metrics: tuple | None = None
        self.comps: dict[int, list[int]] = {}  # index -> [ids, logprobs entries, chars]


class OutputEncoder:
    """Core side: a step's RequestOutputs -> the compact per-step items (module docstring).

    A completion's token ids and logprobs only grow; its text grows, or is cut at a stop
    string (then it is a prefix of the text sent before): each is sent as "keep the
    first k, append these", which covers both exactly.
    """

    def __init__(self) -> None:
        self.sent: dict[str, _Sent] = {}

    def encode(self, outputs: Sequence[RequestOutput]) -> list[tuple]:
        items = []
        for o in outputs:
            st = self.sent.get(o.request_id)
            if st is None:
                st = self.sent[o.request_id] = _Sent()
            head = None
            if not st.head:
                head = (o.prompt, o.prompt_token_ids)
                st.head = True
            plp = None
            if o.prompt_logprobs is not None and len(o.prompt_logprobs) != st.plp:
                plp = [_enc_lp(e) for e in o.prompt_logprobs]
                st.plp = len(o.prompt_logprobs)
            m = o.metrics
            mt = None if m is None else (
                m.arrival_time, m.first_scheduled_time, m.first_token_time)  # fmt: skip
            metrics = None
            if mt != st.metrics:
                metrics = st.metrics = mt
            comps = []
            for c in o.outputs:
                sent = st.comps.get(c.index)
                if sent is None:
                    sent = st.comps[c.index] = [0, 0, 0]
                ki = min(sent[0], len(c.token_ids))
                kt = min(sent[2], len(c.text))
                if c.logprobs is None:
                    kl, lps = -1, None
                else:
                    kl = min(sent[1], len(c.logprobs))
                    lps = [_enc_lp(e) for e in c.logprobs[kl:]]
                    sent[1] = len(c.logprobs)
                comps.append((c.index, ki, c.token_ids[ki:], kl, lps, kt, c.text[kt:],
                              c.cumulative_logprob, c.finish_reason, c.stop_reason))  # fmt: skip
                sent[0], sent[2] = len(c.token_ids), len(c.text)
            items.append((o.request_id, head, plp, metrics, o.finished, comps))
            if o.finished:
                del self.sent[o.request_id]
        return items

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.sent.pop(rid, None)


class _Request:
    """What the client has of one request (the decoder's state)."""

    __slots__ = ("prompt", "prompt_ids", "plp", "metrics", "comps")

    def __init__(self) -> None:
        self.prompt: str | None = None
        self.prompt_ids: list[int] = []
        self.plp: list | None = None
        self.metrics: tuple | None = None
        # index -> [ids, logprobs or None, text, cumulative logprob, finish, stop reason]
        self.comps: dict[int, list] = {}


class OutputDecoder:
    """Client side: the per-step items -> RequestOutputs equal to the core's."""

    def __init__(self) -> None:
        self.requests: dict[str, _Request] = {}

    def decode(self, items: Sequence[tuple]) -> list[RequestOutput]:
        outs = []
        for rid, head, plp, metrics, finished, comps in items:
            r = self.requests.get(rid)
            if r is None:
                r = self.requests[rid] = _Request()
            if head is not None:
                r.prompt, r.prompt_ids = head
            if plp is not None:
                r.plp = [_dec_lp(e) for e in plp]
            if metrics is not None:
                r.metrics = metrics
            completions = []
            for index, ki, ids, kl, lps, kt, text, cum, finish, stop in comps:
                c = r.comps.get(index)
                if c is None:
                    c = r.comps[index] = [[], None, "", None, None, None]
                del c[0][ki:]
                c[0].extend(ids)
                if kl < 0:
                    c[1] = None
                else:
                    if c[1] is None:
                        c[1] = []
                    del c[1][kl:]
                    c[1].extend(_dec_lp(e) for e in lps)
                c[2] = c[2][:kt] + text if kt < len(c[2]) else c[2] + text
                c[3], c[4], c[5] = cum, finish, stop
                completions.append(CompletionOutput(
                    index=index, text=c[2], token_ids=list(c[0]), cumulative_logprob=cum,
                    logprobs=list(c[1]) if c[1] is not None else None,
                    finish_reason=finish, stop_reason=stop,
                ))  # fmt: skip
            outs.append(RequestOutput(
                request_id=rid, prompt=r.prompt, prompt_token_ids=list(r.prompt_ids),
                prompt_logprobs=list(r.plp) if r.plp else None, outputs=completions,
                finished=finished,
                metrics=RequestMetrics(*r.metrics) if r.metrics is not None else None,
            ))  # fmt: skip
            if finished:
                del self.requests[rid]
        return outs

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


# ------------------------------------------------------------------ the process


def _visible_devices(replica: int, devices_per_replica: int, num_replicas: int) -> None:
    """A data-parallel replica's process sees only its own GPUs (before JAX starts its
    backend: a process that saw every GPU would reserve memory on each)."""
    if num_replicas <= 1:
        return
    have = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = have.split(",") if have else [str(i) for i in range(num_replicas * devices_per_replica)]
    mine = ids[replica * devices_per_replica : (replica + 1) * devices_per_replica]
    if mine:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (a SIGKILLed API
    process leaves no core stepping on; elsewhere the core exits at its next send or
    receive, on EOF). The parent is the thread that started the process: start
    MPEngineClient on a thread that lives as long as it (the main thread)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:  # it died before the call
            os._exit(1)


def run_core(config: Any, max_logprobs: int, conn: Any, replica: int = 0,
             num_replicas: int = 1) -> None:  # fmt: skip
    """The core process' main: build the engine from ``config`` (data_parallel_size 1),
    report ("ready", facts), then serve the connection until "stop" or EOF."""
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s core{replica}: %(message)s")
    tp = config.parallel.tensor_parallel_size
    _visible_devices(replica, tp, num_replicas)
    try:
        import jax

        from pagedjax.engine.llm_engine import LLMEngine

        devices = jax.devices()
        if len(devices) >= (replica + 1) * tp:  # a CPU with forced devices: one each
            devices = devices[replica * tp : (replica + 1) * tp]
        engine = LLMEngine.from_config(config, max_logprobs=max_logprobs, devices=devices[:tp])
        facts = dict(
            max_model_len=engine.max_model_len, max_logprobs=engine.max_logprobs,
            arch=engine.arch, block_size=engine.block_size,
            num_blocks=engine.num_blocks, watermark_blocks=engine.policy.watermark_blocks,
            sched_limits=engine.sched_limits, pid=os.getpid(),
        )  # fmt: skip
    except BaseException as e:  # noqa: BLE001 - reported to the client, then exit
        log.exception("engine core failed to start")
        _send_quietly(conn, ("error", f"engine core failed to start: {type(e).__name__}: {e}"))
        sys.exit(EXIT_START_FAILED)
    conn.send_bytes(dumps(("ready", facts)))
    code = CoreLoop(engine, conn).run()
    conn.close()
    sys.exit(code)


def _send_quietly(conn: Any, msg: tuple) -> None:
    try:
        conn.send_bytes(dumps(msg))
    except (OSError, ValueError):
        pass


class CoreLoop:
    """Commands between steps, one step, its outputs out (module docstring)."""

    def __init__(self, engine: Any, conn: Any):
        self.engine, self.conn = engine, conn
        self.encoder = OutputEncoder()
        self.counts: dict[str, int] | None = None
        self.failures = FailureBudget()

    def run(self) -> int:
        engine, conn = self.engine, self.conn
        while True:
            try:
                if not engine.has_unfinished_requests():
                    if self.apply(pickle.loads(conn.recv_bytes())):  # idle: wait for work
                        return 0
                while conn.poll():
                    if self.apply(pickle.loads(conn.recv_bytes())):
                        return 0
            except (EOFError, OSError):  # the client is gone
                return 0
            outputs = []
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                    self.failures.ok()
                except Exception as e:  # noqa: BLE001 - the batch's failure (faults.py)
                    log.exception("engine step failed")
                    if self.failures.failed():  # failing again and again: give up
                        _send_quietly(conn, ("error", f"engine step failed {self.failures.run}"
                                             f" times in a row: {type(e).__name__}: {e}"))
                        return EXIT_STEP_FAILED
                    ids, err = fail_batch(engine, e)  # an LLMEngine: ids is a list
                    self.encoder.forget(ids or [])
                    for rid in ids or []:
                        _send_quietly(conn, ("failed", rid, "StepFailedError", str(err)))
                except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt and the like
                    log.exception("engine step failed")
                    _send_quietly(conn, ("error", f"engine step failed: {type(e).__name__}: {e}"))
                    return EXIT_STEP_FAILED
            counts = engine.request_counts()
            if outputs or counts != self.counts:
                self.counts = counts
                try:
                    conn.send_bytes(dumps(("out", self.encoder.encode(outputs), counts)))
                except OSError:
                    return 0

    def apply(self, cmd: tuple) -> bool:
        """Apply one command; True for "stop"."""
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params = cmd
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:  # noqa: BLE001 - the request's error, not the core's
                self.conn.send_bytes(dumps(("failed", rid, type(e).__name__, str(e))))
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
            self.encoder.forget(cmd[1])
        elif kind == "rpc":
            _, call_id, name = cmd
            try:
                if name not in RPCS:
                    raise AttributeError(f"{name!r} is not an engine core RPC ({RPCS})")
                if name == "snapshot":
                    value = metrics_snapshot(self.engine)
                else:
                    value = getattr(self.engine, name)()
                reply = ("rpc", call_id, True, value)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                reply = ("rpc", call_id, False, f"{type(e).__name__}: {e}")
            self.conn.send_bytes(dumps(reply))
        elif kind == "stop":
            return True
        else:
            raise ValueError(f"unknown engine core command {kind!r}")
        return False


__all__ = ["OutputDecoder", "OutputEncoder", "RPCS", "run_core"]
