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
the request's timeline when it changes; never the cumulative RequestOutput. The core's
engine does not detokenize (``LLMEngine(detokenize=False)``: ids, logprobs and each
token's logprob): ``OutputDecoder`` on the client side detokenizes in the API process,
matches stop strings there and tells the core to stop the samples a stop string ended
(as vLLM v1's output processor does), and so rebuilds RequestOutputs equal to the
in-process engine's. The core may run a step or a K-step run past such a string before
the message arrives; those tokens are cut on the client.

client -> core: ("add", rid, prompt, params[, lora_request]) | ("abort", [rids]) |
    ("stop_samples", rid, [sample indices]) | ("rpc", call_id, name, *args) | ("stop",)
core -> client: ("ready", facts) | ("out", items, counts or None) | ("error", message) |
    ("rpc", call_id, ok, value[, error type]) | ("failed", rid, error type, message)
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.engine.faults import FailureBudget, fail_batch
from pagedjax.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedjax.engine.protocol import metrics_snapshot
from pagedjax.sampling import SamplingParams

log = logging.getLogger(__name__)

# The engine methods a client may call by name (nothing else runs in the core on request);
# add_lora / remove_lora take a LoRARequest / an adapter id (runtime loading, docs/lora.md).
RPCS = ("snapshot", "stats", "request_counts", "num_free_blocks", "num_usable_blocks",
        "get_num_unfinished_requests", "reset_stats", "add_lora", "remove_lora",
        "list_loras")  # fmt: skip

# Exit codes of the core (besides a signal's negative code).
EXIT_STEP_FAILED = 3
EXIT_START_FAILED = 4
EXIT_NODE_LOST = 5  # a follower node was lost (multinode.py)


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
                head = (o.prompt, o.prompt_token_ids, o.structured_output_backend,
                        o.structured_output_path)  # fmt: skip
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
                slps = None if c.sampled_logprobs is None else c.sampled_logprobs[ki:]
                comps.append((c.index, ki, c.token_ids[ki:], kl, lps, kt, c.text[kt:],
                              c.cumulative_logprob, c.finish_reason, c.stop_reason,
                              slps))  # fmt: skip
                sent[0], sent[2] = len(c.token_ids), len(c.text)
            items.append((o.request_id, head, plp, metrics, o.finished, comps))
            if o.finished:
                del self.sent[o.request_id]
        return items

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.sent.pop(rid, None)


class _Comp:
    """What the client has of one completion. With a tokenizer (the core does not
    detokenize) it also holds the text's detokenizer and the token logprobs; ``cut``:
    a stop string ended it here, so later updates from the core are ignored."""

    __slots__ = ("ids", "lps", "text", "cum", "finish", "stop", "detok", "cut")

    def __init__(self, detok: IncrementalDetokenizer | None) -> None:
        self.ids: list[int] = []
        self.lps: list | None = None
        self.text = ""
        self.cum: float | None = 0.0 if detok is not None else None
        self.finish: str | None = None
        self.stop: int | str | None = None
        self.detok = detok
        self.cut = False


class _Request:
    """What the client has of one request (the decoder's state)."""

    __slots__ = ("prompt", "prompt_ids", "plp", "metrics", "comps", "params", "backend", "path")

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.prompt: str | None = None
        self.prompt_ids: list[int] = []
        self.plp: list | None = None
        self.metrics: tuple | None = None
        self.comps: dict[int, _Comp] = {}
        self.params = params
        self.backend: str | None = None  # RequestOutput.structured_output_backend
        self.path: str | None = None  # RequestOutput.structured_output_path


class OutputDecoder:
    """Client side: the per-step items -> RequestOutputs equal to the in-process engine's.

    ``tokenizer`` given: the core runs ``LLMEngine(detokenize=False)``, so this side
    detokenizes each completion and matches its stop strings (``expect`` gives a
    request's params first), in the engine's rule order (EOS and stop ids, found by the
    core, win over a stop string on the same token; a stop string wins over length).
    A stop string ends a completion here: its ids, logprobs and cumulative logprob are cut
    after the token that completed it, and ``stops`` lists (request id, sample indices)
    for the caller to send to the core (``stop_samples``), which may have run on a
    few tokens meanwhile. Without a tokenizer the core's text is taken as it is.
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}
        self.stops: list[tuple[str, list[int]]] = []

    def expect(self, request_id: str, params: SamplingParams) -> None:
        """A request was sent to the core with these params (its stop strings)."""
        self.requests[request_id] = _Request(params)

    def decode(self, items: Sequence[tuple]) -> list[RequestOutput]:
        outs = []
        for rid, head, plp, metrics, finished, comps in items:
            r = self.requests.get(rid)
            if r is None:
                r = self.requests[rid] = _Request()
            if head is not None:
                r.prompt, r.prompt_ids, r.backend, r.path = head
            if plp is not None:
                r.plp = [_dec_lp(e) for e in plp]
            if metrics is not None:
                r.metrics = metrics
            completions, stopped = [], []
            for item in comps:
                c = r.comps.get(item[0])
                if c is None:
                    detok = None
                    if self.tokenizer is not None:
                        p = r.params
                        detok = IncrementalDetokenizer(
                            self.tokenizer, p.stop if p else (), min_tokens=p.min_tokens if p else 0
                        )
                    c = r.comps[item[0]] = _Comp(detok)
                if c.detok is None:
                    _take_core_text(c, item)
                elif not c.cut and _detokenize(c, item):
                    stopped.append(item[0])
                completions.append(CompletionOutput(
                    index=item[0], text=c.text, token_ids=list(c.ids),
                    cumulative_logprob=c.cum,
                    logprobs=list(c.lps) if c.lps is not None else None,
                    finish_reason=c.finish, stop_reason=c.stop,
                ))  # fmt: skip
            if stopped:
                self.stops.append((rid, stopped))
            if self.tokenizer is not None:
                finished = all(c.finish is not None for c in r.comps.values()) and (
                    r.params is None or len(r.comps) == r.params.n
                )
            outs.append(RequestOutput(
                request_id=rid, prompt=r.prompt, prompt_token_ids=list(r.prompt_ids),
                prompt_logprobs=list(r.plp) if r.plp else None, outputs=completions,
                finished=finished,
                metrics=RequestMetrics(*r.metrics) if r.metrics is not None else None,
                structured_output_backend=r.backend, structured_output_path=r.path,
            ))  # fmt: skip
            if finished:
                del self.requests[rid]
        return outs

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def _take_core_text(c: _Comp, item: tuple) -> None:
    """The core detokenized: apply its deltas as they are."""
    index, ki, ids, kl, lps, kt, text, cum, finish, stop, _ = item
    del c.ids[ki:]
    c.ids.extend(ids)
    if kl < 0:
        c.lps = None
    else:
        if c.lps is None:
            c.lps = []
        del c.lps[kl:]
        c.lps.extend(_dec_lp(e) for e in lps)
    c.text = c.text[:kt] + text if kt < len(c.text) else c.text + text
    c.cum, c.finish, c.stop = cum, finish, stop


def _detokenize(c: _Comp, item: tuple) -> bool:
    """The core sent ids only: grow the text token by token and match stop strings.
    True when a stop string ended the completion here while the core had not."""
    index, ki, ids, kl, lps, kt, text, cum, finish, stop, slps = item
    entries = None if kl < 0 else [_dec_lp(e) for e in lps]
    if entries is not None and c.lps is None:
        c.lps = []
    if not ids and finish is not None:  # finished without a new token (the pool is full)
        c.finish, c.stop = finish, stop
    for j, tok in enumerate(ids):
        last = j == len(ids) - 1
        c.ids.append(tok)
        c.cum += slps[j]  # the engine's own order of additions: the same float
        if entries is not None and j < len(entries):
            c.lps.append(entries[j])
        hit = c.detok.append(tok)
        c.text = c.detok.text
        if last and finish is not None and not (hit is not None and finish == "length"):
            c.finish, c.stop = finish, stop  # EOS / stop id (or length, no string)
            return False
        if hit is not None:
            c.finish, c.stop, c.cut = "stop", hit, True
            return not (last and finish is not None)
    return False


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
             num_replicas: int = 1, node: Any = None) -> None:  # fmt: skip
    """The core process' main: build the engine from ``config`` (data_parallel_size 1),
    report ("ready", facts), then serve the connection until "stop" or EOF. ``node``
    (several nodes, multinode.py): lead the other nodes' engines as JAX process 0."""
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s core{replica}: %(message)s")
    # One replica's devices: a tensor-parallel group per pipeline stage.
    tp = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size
    _visible_devices(replica, tp, num_replicas)
    watch = None
    try:
        if node is not None:  # the followers, then jax.distributed (multinode.py)
            from pagedjax.engine.fronts import multinode

            conn, watch = multinode.lead(conn, node, config, max_logprobs, EXIT_NODE_LOST)
        import jax

        from pagedjax.engine.llm_engine import LLMEngine

        devices = jax.devices()
        if node is not None:
            devices = multinode.mesh_devices(config, node)
        elif len(devices) >= (replica + 1) * tp:  # a CPU with forced devices: one each
            devices = devices[replica * tp : (replica + 1) * tp]
        engine = LLMEngine.from_config(
            config, max_logprobs=max_logprobs, devices=devices[:tp], detokenize=False
        )
        if node is not None:
            engine = watch.wrap(engine)  # MultiHostEngine: node 0 leads
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
    hooks = {} if watch is None else watch.loop_hooks(engine)  # keep-alive, fatal steps
    code = CoreLoop(engine, conn, **hooks).run()
    if watch is not None and code == 0:
        watch.release(engine)  # stopped on purpose: "bye" and the stop to the followers
    conn.close()
    sys.exit(code)


def _send_quietly(conn: Any, msg: tuple) -> None:
    try:
        conn.send_bytes(dumps(msg))
    except (OSError, ValueError):
        pass


class CoreLoop:
    """Commands between steps, one step, its outputs out (module docstring)."""

    def __init__(self, engine: Any, conn: Any, *, idle: Callable[[], None] | None = None,
                 idle_s: float = 1.0, before_fatal: Callable[[], str | None] | None = None):
        """idle: called every ``idle_s`` while idle; before_fatal: given, a failed step
        is fatal and reports what this returns, if anything (``LeaderWatch.loop_hooks``)."""
        self.engine, self.conn = engine, conn
        self.encoder = OutputEncoder()
        self.counts: dict[str, int] | None = None
        self.failures = FailureBudget()
        self.idle, self.idle_s, self.before_fatal = idle, idle_s, before_fatal

    def _fatal(self, e: BaseException) -> int:
        log.exception("engine step failed")
        lost = self.before_fatal() if self.before_fatal is not None else None
        if lost:
            _send_quietly(self.conn, ("error", lost))
            return EXIT_NODE_LOST
        _send_quietly(self.conn, ("error", f"engine step failed: {type(e).__name__}: {e}"))
        return EXIT_STEP_FAILED

    def run(self) -> int:
        engine, conn = self.engine, self.conn
        while True:
            try:
                if not engine.has_unfinished_requests():
                    while self.idle is not None and not conn.poll(self.idle_s):
                        try:
                            self.idle()
                        except Exception as e:  # noqa: BLE001 - a collective failed
                            return self._fatal(e)
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
                    if self.before_fatal is not None:
                        return self._fatal(e)
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
            _, rid, prompt, params, *lora = cmd  # lora: [LoRARequest] when one is named
            try:
                self.engine.add_request(rid, prompt, params, *lora)
            except Exception as e:  # noqa: BLE001 - the request's error, not the core's
                self.conn.send_bytes(dumps(("failed", rid, type(e).__name__, str(e))))
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
            self.encoder.forget(cmd[1])
        elif kind == "stop_samples":
            _, rid, indices = cmd
            stop = getattr(self.engine, "stop_samples", None) or self.engine.core.stop_samples
            stop(rid, indices)
            if rid not in self.engine.core.book.requests:
                self.encoder.forget([rid])
        elif kind == "rpc":
            _, call_id, name, *args = cmd
            try:
                if name not in RPCS:
                    raise AttributeError(f"{name!r} is not an engine core RPC ({RPCS})")
                if name == "snapshot":
                    value = metrics_snapshot(self.engine)
                else:
                    value = getattr(self.engine, name)(*args)
                reply = ("rpc", call_id, True, value)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                # The type's name too: the client raises a ValueError / TypeError as such
                # (a bad adapter is the caller's 400, not an engine failure).
                reply = ("rpc", call_id, False, f"{type(e).__name__}: {e}", type(e).__name__)
            self.conn.send_bytes(dumps(reply))
        elif kind == "stop":
            return True
        else:
            raise ValueError(f"unknown engine core command {kind!r}")
        return False


__all__ = ["OutputDecoder", "OutputEncoder", "RPCS", "run_core"]
