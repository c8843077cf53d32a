"""One model served by several nodes (``pagedjax serve --nnodes N --node-rank R ...``):
vLLM 0.32's multi-node flags, the control channel between node 0 and the others, and
the headless follower's main.

Process model (docs/serving.md, "Several nodes"). Node 0 runs the API server; its engine
core process (``core_process.run_core``, started by ``MPEngineClient``) is JAX process 0
of N (``jax.distributed``, the coordinator at ``--master-addr:--master-port``). Nodes
1 .. N-1 run the same command with ``--headless --node-rank R``: no HTTP server; the
process is JAX process R, builds the same ``LLMEngine`` over the global mesh (TP and PP
across the nodes: ``jax.devices()`` spans them all) and follows (``run_follower``).

Which process decides: node 0 alone takes requests, and every process runs the same
jitted scheduler and step on the same inputs (``MultiHostEngine``: before each step node
0 broadcasts the new requests, aborts and stopped samples). Why not have node 0 schedule
and broadcast each step's batch: the scheduler is itself a jitted program over state
replicated on the mesh, so every device computes its decision anyway; broadcasting that
decision would add a collective per step and a second step path for followers, while
the inputs are small and change only when requests come or go. The processes stay
identical because their inputs and their order are identical (unseeded sampling draws
its seed from the engine's RNG in ``add_request`` order).

Idle: node 0's core loop sends an empty exchange (``MultiHostEngine.keepalive``) every
``KEEPALIVE_S`` while it has no request, so a follower never waits inside a collective
for longer than that (a transport timeout could fire) and always sees the stop.

Liveness, the control channel: each follower opens a TCP connection to node 0's core at
``--master-port + 1`` before JAX starts (``FollowerLink``), says hello (its rank, pid,
host and engine configuration: node 0 refuses a follower whose configuration differs,
naming the fields, since different programs on the nodes would deadlock), then sends a
ping every ``PING_S``. Node 0's ``LeaderWatch`` thread watches every connection: EOF
(the kernel closes a dead process's sockets at once) or ``SILENCE_S`` without a ping
means the node is lost; the core process (``lead``) then reports "node rank R ... was
lost" to the API process and exits, so ``/health`` fails and requests in flight end with a 500
naming the rank, whether the core was idle, stepping or stuck in a collective with the
dead node. Why our own channel rather than JAX's: JAX's coordination service notices a
dead task only after its heartbeat timeout (100 s by default) and then aborts the
survivors without saying to a client which task died. A follower whose connection to
node 0 ends without node 0's "bye" exits too (node 0 died).

Refused with several nodes (ValueError, by name): data parallelism, LoRA, speculative
decoding, preemption by swap and the host KV tier (a process cannot read KV blocks held
by another's devices), a TP x PP that does not use every device of every node.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29501  # vLLM 0.32's --master-port default
KEEPALIVE_S = 1.0  # node 0's idle exchange
PING_S = 1.0  # a follower's ping on the control channel
SILENCE_S = 6.0  # no ping for this long: the node is lost (a hung host)
CONNECT_TIMEOUT_S = 600.0  # followers to connect / node 0 to listen, at start-up
EXIT_LEADER_LOST = 6  # a follower's exit status when node 0 is gone


@dataclass(frozen=True)
class NodeConfig:
    """vLLM's multi-node flags. ``ValueError`` naming the flags on an inconsistent set:
    a rank outside 0 .. nnodes - 1, several nodes without --master-addr, --headless on
    node 0 or on a single node, a rank > 0 without --headless, a port out of range."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    headless: bool = False

    def __post_init__(self) -> None:
        n, r = self.nnodes, self.node_rank
        if n < 1:
            raise ValueError(f"--nnodes must be >= 1, got {n}")
        if not 0 <= r < n:
            raise ValueError(f"--node-rank {r} is not one of the --nnodes {n} ranks (0 .. {n - 1})")
        if n == 1:
            if self.headless:
                raise ValueError("--headless is for the nodes other than node 0 of a"
                                 " multi-node server (--nnodes > 1)")  # fmt: skip
            if self.master_addr is not None or self.master_port is not None:
                raise ValueError("--master-addr / --master-port apply with --nnodes > 1 only")
            return
        if not self.master_addr:
            raise ValueError(f"--nnodes {n} needs --master-addr: node 0's address, reachable"
                             " from every node (the JAX coordinator listens there)")  # fmt: skip
        if r == 0 and self.headless:
            raise ValueError("--headless on --node-rank 0: node 0 serves HTTP; only ranks > 0"
                             " run headless")  # fmt: skip
        if r > 0 and not self.headless:
            raise ValueError(f"--node-rank {r} needs --headless: only node 0 serves HTTP")
        port = self.port
        if not 1 <= port <= 65534:
            raise ValueError(f"--master-port must be in 1 .. 65534 (the control channel uses"
                             f" the next port), got {port}")  # fmt: skip

    @property
    def port(self) -> int:
        return DEFAULT_MASTER_PORT if self.master_port is None else self.master_port

    @property
    def coordinator(self) -> str:
        """JAX's coordinator address (node 0's core process serves it)."""
        return f"{self.master_addr}:{self.port}"

    @property
    def control_port(self) -> int:
        return self.port + 1


def node_engine_config(config: Any, node: NodeConfig) -> Any:
    """The EngineConfig every node builds its engine from: swap pool off (its blocks
    would be read from other processes' devices). ValueError naming what several nodes
    cannot run (module docstring)."""
    par, n = config.parallel, node.nnodes
    devices = par.tensor_parallel_size * par.pipeline_parallel_size
    if par.data_parallel_size > 1:
        raise ValueError(f"--data-parallel-size {par.data_parallel_size} with --nnodes {n}:"
                         " data parallelism across nodes is not built (run one server per"
                         " replica)")  # fmt: skip
    if devices % n:
        raise ValueError(f"--tensor-parallel-size {par.tensor_parallel_size} x"
                         f" --pipeline-parallel-size {par.pipeline_parallel_size} = {devices}"
                         f" devices cannot be spread evenly over --nnodes {n}")  # fmt: skip
    refused = [
        (config.lora is not None, "--enable-lora (adapter slots are per process)"),
        (config.speculative is not None, "--speculative-config (not built across processes)"),
        (config.scheduler.preemption_mode == "swap",
         "--preemption-mode swap (a process cannot read KV blocks on another's devices)"),
        (config.cache.kv_offloading_size > 0,
         "--kv-offloading-size (a process cannot read KV blocks on another's devices)"),
    ]  # fmt: skip
    for bad, what in refused:
        if bad:
            raise ValueError(f"{what} is not available with --nnodes {n}")
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, swap_space=0.0))


def fingerprint(config: Any, max_logprobs: int) -> dict[str, str]:
    """What must be equal on every node for their programs to match: the engine
    configuration, flattened (``repr`` of each leaf), without the compilation cache's
    directory (a per-host path), and max_logprobs."""
    flat: dict[str, str] = {"max_logprobs": repr(max_logprobs)}

    def walk(prefix: str, value: Any) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(f"{prefix}{f.name}.", getattr(value, f.name))
        else:
            flat[prefix[:-1]] = repr(value)

    walk("", config)
    flat.pop("compilation_cache", None)
    return flat


def _differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [f"{k}: {a.get(k)} (node 0) vs {b.get(k)}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]  # fmt: skip


def lead(conn: Any, node: NodeConfig, config: Any, max_logprobs: int,
         exit_code: int) -> tuple[SerialConn, LeaderWatch]:  # fmt: skip
    """Node 0's engine core: accept the followers (``LeaderWatch``, checking their
    ``fingerprint`` against this one's), watch them, then start ``jax.distributed`` as
    process 0. Returns the core's connection made safe for the watch's thread, and the
    watch. A lost node: the watch sends ("error", message) on the connection
    (core_process.py's message; at most 2 s, the loop may be sending) and exits the
    process with ``exit_code`` at once: the main thread may be stuck in a collective
    with the lost node."""
    conn = SerialConn(conn)
    watch = LeaderWatch(node, fingerprint(config, max_logprobs))

    def lost(message: str) -> None:
        log.error("%s", message)
        data = pickle.dumps(("error", message), protocol=pickle.HIGHEST_PROTOCOL)
        t = threading.Thread(target=_send_quietly, args=(conn, data), daemon=True)
        t.start()
        t.join(2.0)
        logging.shutdown()
        os._exit(exit_code)

    watch.start(lost)
    initialize(node)
    return conn, watch


def _send_quietly(conn: Any, data: bytes) -> None:
    try:
        conn.send_bytes(data)
    except (OSError, ValueError):
        pass


def initialize(node: NodeConfig) -> None:
    """``jax.distributed`` as process ``node.node_rank`` of ``node.nnodes`` (gloo on CPU)."""
    from pagedjax.engine.fronts import multihost

    multihost.initialize(node.coordinator, node.nnodes, node.node_rank)


def mesh_devices(config: Any, node: NodeConfig) -> list:
    """The global devices of the engine's mesh: all of them. RuntimeError when TP x PP
    is not the number of devices the nodes hold together (after ``initialize``)."""
    import jax

    par = config.parallel
    want = par.tensor_parallel_size * par.pipeline_parallel_size
    have = jax.devices()
    if len(have) != want:
        raise RuntimeError(
            f"--tensor-parallel-size {par.tensor_parallel_size} x --pipeline-parallel-size"
            f" {par.pipeline_parallel_size} = {want} devices, but the {node.nnodes} nodes hold"
            f" {len(have)} ({jax.local_device_count()} on node {node.node_rank}): every device"
            " of every node must be in the mesh"
        )
    return have


# ------------------------------------------------------------------ the control channel


def _send_line(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _read_line(sock: socket.socket, timeout: float) -> dict:
    """One JSON line (at most 1 MiB), or ConnectionError / TimeoutError."""
    sock.settimeout(timeout)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the connection closed during the handshake")
        buf += chunk
        if len(buf) > 1 << 20:
            raise ConnectionError("handshake line over 1 MiB")
    return json.loads(buf)


@dataclass
class _Peer:
    sock: socket.socket
    rank: int
    pid: int
    host: str
    last_seen: float

    def describe(self) -> str:
        return f"node rank {self.rank} (pid {self.pid} on {self.host})"


class SerialConn:
    """A connection two threads send on (node 0's core: its loop, and the node watch
    reporting a lost node): one send at a time; everything else passes through."""

    def __init__(self, conn: Any):
        self.conn, self.lock = conn, threading.Lock()

    def send_bytes(self, data: bytes) -> None:
        with self.lock:
            self.conn.send_bytes(data)

    def __getattr__(self, name: str) -> Any:  # recv_bytes, poll, close
        return getattr(self.conn, name)


class LeaderWatch:
    """Node 0's side of the control channel (module docstring). The constructor listens
    on ``node.control_port``, accepts the N - 1 followers and checks their hellos (each
    rank once, the same configuration as ``mine``), raising RuntimeError naming the
    cause (a follower missing after ``timeout_s``, a configuration that differs);
    ``start(on_lost)`` then watches them on a thread: ``on_lost(message)`` once, naming
    the first node lost. ``close()`` tells the followers node 0 is stopping on purpose."""

    def __init__(self, node: NodeConfig, mine: dict[str, str],
                 timeout_s: float = CONNECT_TIMEOUT_S):  # fmt: skip
        self.node = node
        self.peers: dict[int, _Peer] = {}
        self.lost: str | None = None
        self._lost_event = threading.Event()
        self._stopping = False
        srv = socket.create_server(("", node.control_port), reuse_port=False)
        try:
            self._accept(srv, mine, time.monotonic() + timeout_s)
        except BaseException:
            for p in self.peers.values():
                p.sock.close()
            raise
        finally:
            srv.close()

    def _accept(self, srv: socket.socket, mine: dict[str, str], deadline: float) -> None:
        n = self.node.nnodes
        pending: list[tuple[socket.socket, dict]] = []
        while len(pending) < n - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                have = sorted(h["rank"] for _, h in pending)
                raise RuntimeError(f"only node ranks {have} of 1 .. {n - 1} connected to"
                                   f" port {self.node.control_port} in time")  # fmt: skip
            srv.settimeout(left)
            try:
                sock, addr = srv.accept()
            except TimeoutError:
                continue
            try:
                hello = _read_line(sock, 30.0)
            except (OSError, ValueError) as e:
                log.warning("control channel: a bad hello from %s: %s", addr, e)
                sock.close()
                continue
            rank = hello.get("rank")
            why = None
            if not isinstance(rank, int) or not 1 <= rank < n:
                why = f"node rank {rank!r} is not one of 1 .. {n - 1} (--nnodes {n})"
            elif any(h["rank"] == rank for _, h in pending):
                why = f"two nodes said --node-rank {rank}"
            else:
                diff = _differences(mine, hello.get("config") or {})
                if diff:
                    why = (f"node rank {rank}'s engine configuration differs from node 0's"
                           f" (every node must run the same engine flags): {'; '.join(diff)}")
            if why is not None:
                try:
                    _send_line(sock, {"ok": False, "error": why})
                finally:
                    sock.close()
                for s, _ in pending:
                    _send_line(s, {"ok": False, "error": f"node 0 stopped: {why}"})
                    s.close()
                raise RuntimeError(why)
            pending.append((sock, hello))
        now = time.monotonic()
        for sock, h in pending:
            _send_line(sock, {"ok": True})
            self.peers[h["rank"]] = _Peer(sock, h["rank"], int(h.get("pid", -1)),
                                          str(h.get("host", "?")), now)  # fmt: skip

    def start(self, on_lost: Callable[[str], None]) -> None:
        threading.Thread(target=self._watch, args=(on_lost,), name="pagedjax-node-watch",
                         daemon=True).start()  # fmt: skip

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        sel = selectors.DefaultSelector()
        for p in self.peers.values():
            p.sock.setblocking(False)
            sel.register(p.sock, selectors.EVENT_READ, p)
        while not self._stopping:
            why = None
            for key, _ in sel.select(timeout=0.5):
                peer: _Peer = key.data
                try:
                    data = peer.sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError as e:
                    data, err = b"", e
                else:
                    err = None
                if not data:
                    why = (peer, "its control connection closed (the process exited or was"
                                 " killed)" + (f": {err}" if err else ""))  # fmt: skip
                    break
                peer.last_seen = time.monotonic()
            if why is None:
                now = time.monotonic()
                for p in self.peers.values():
                    if now - p.last_seen > SILENCE_S:
                        why = (p, f"no keep-alive for {now - p.last_seen:.1f} s")
                        break
            if why is not None and not self._stopping:
                self.lost = f"{why[0].describe()} was lost: {why[1]}"
                self._lost_event.set()
                on_lost(self.lost)
                return

    def wrap(self, engine: Any) -> Any:
        """Node 0's LLMEngine as the followers' leader (``MultiHostEngine``: its
        requests, aborts and stopped samples broadcast before each step)."""
        from pagedjax.engine.fronts.multihost import MultiHostEngine

        return MultiHostEngine(engine)

    def loop_hooks(self, engine: Any) -> dict[str, Any]:
        """``CoreLoop``'s keyword arguments for node 0's core over ``engine`` (a
        MultiHostEngine): the idle keep-alive, and fatal steps reported as the lost node
        when one is (a step with a dead node fails in its collective about when this
        watch sees the death)."""
        return dict(idle=engine.keepalive, idle_s=KEEPALIVE_S,
                    before_fatal=lambda: self.wait_lost(3.0))  # fmt: skip

    def release(self, engine: Any) -> None:
        """Node 0 stops on purpose: ``close()``, then the stop to the followers."""
        self.close()
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - a follower gone meanwhile: exiting anyway
            log.exception("releasing the follower nodes failed")

    def wait_lost(self, timeout: float) -> str | None:
        """The loss message if a node is (or within ``timeout`` becomes) lost."""
        self._lost_event.wait(timeout)
        return self.lost

    def close(self) -> None:
        """Node 0 stops on purpose: "bye" to every follower (their connection's end is
        then no failure), and no more watching."""
        self._stopping = True
        for p in self.peers.values():
            try:
                p.sock.setblocking(True)
                p.sock.settimeout(2.0)
                p.sock.sendall(b"bye\n")
            except OSError:
                pass


class FollowerLink:
    """A follower's side of the control channel: connect to node 0 (retrying until it
    listens, up to ``timeout_s``), hello, wait for its answer (RuntimeError with node 0's
    reason when refused); ``start(on_lost)`` pings on a thread and calls
    ``on_lost(message)`` when the connection ends without node 0's "bye"."""

    def __init__(self, node: NodeConfig, mine: dict[str, str],
                 timeout_s: float = CONNECT_TIMEOUT_S):  # fmt: skip
        self.node = node
        self.bye = False
        self._closing = False
        deadline = time.monotonic() + timeout_s
        where = (node.master_addr, node.control_port)
        while True:
            try:
                self.sock = socket.create_connection(where, timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node 0's control channel at {where[0]}:{where[1]} did"
                                       f" not answer in {timeout_s:.0f} s: {e}") from None
                time.sleep(0.2)
        _send_line(self.sock, {"rank": node.node_rank, "pid": os.getpid(),
                               "host": socket.gethostname(), "config": mine})  # fmt: skip
        reply = _read_line(self.sock, timeout_s)
        if not reply.get("ok"):
            self.sock.close()
            raise RuntimeError(f"node 0 refused this node: {reply.get('error')}")

    def start(self, on_lost: Callable[[str], None]) -> None:
        threading.Thread(target=self._run, args=(on_lost,), name="pagedjax-node-link",
                         daemon=True).start()  # fmt: skip

    def _run(self, on_lost: Callable[[str], None]) -> None:
        self.sock.settimeout(PING_S)
        where = f"{self.node.master_addr}:{self.node.control_port}"
        while True:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                try:
                    self.sock.sendall(b"ping\n")
                except OSError as e:
                    data = b""
                    log.debug("ping failed: %s", e)
                else:
                    continue
            except OSError:
                data = b""
            if b"bye" in data:
                self.bye = True
            if not data:
                if not (self.bye or self._closing):
                    on_lost(f"node 0 ({where}) closed the control connection without"
                            " stopping: it died")  # fmt: skip
                return

    def close(self) -> None:
        self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv; FIN at once
        except OSError:
            pass
        self.sock.close()


def _leader_lost(message: str) -> None:
    log.error("%s; this node exits", message)
    logging.shutdown()
    os._exit(EXIT_LEADER_LOST)


def run_follower(config: Any, node: NodeConfig, max_logprobs: int) -> int:
    """A headless node's main: the control channel, ``jax.distributed`` as process
    ``node.node_rank``, the same LLMEngine as node 0's core (``detokenize=False``, as
    there), then follow node 0's steps until it stops. Returns the steps run; exits the
    process with EXIT_LEADER_LOST if node 0 dies."""
    link = FollowerLink(node, fingerprint(config, max_logprobs))
    link.start(_leader_lost)
    log.info("node %d of %d: connected to node 0 at %s", node.node_rank, node.nnodes,
             node.master_addr)  # fmt: skip
    initialize(node)
    from pagedjax.engine.fronts.multihost import MultiHostEngine
    from pagedjax.engine.llm_engine import LLMEngine

    devices = mesh_devices(config, node)
    engine = LLMEngine.from_config(
        config, max_logprobs=max_logprobs, devices=devices, detokenize=False
    )
    log.info("node %d: engine built, following node 0", node.node_rank)
    steps = MultiHostEngine(engine).follow()
    link.close()
    log.info("node %d: node 0 stopped after %d steps", node.node_rank, steps)
    return steps


__all__ = [
    "DEFAULT_MASTER_PORT",
    "FollowerLink",
    "KEEPALIVE_S",
    "LeaderWatch",
    "NodeConfig",
    "SerialConn",
    "fingerprint",
    "initialize",
    "lead",
    "mesh_devices",
    "node_engine_config",
    "run_follower",
]
