"""Two processes on localhost (``jax.distributed``, CPU collectives over gloo, 2 devices
each, TP 4 across both): the leader's outputs equal one device's, and a follower that
dies makes the leader stop with an error within the heartbeat bound
(``tests/multihost_case.py`` is one process; pagedjax/engine/fronts/multihost.py the design)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine_helpers import xla_flags_with_devices

pytestmark = pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 5  # multihost_case.py's heartbeat_timeout_s
BOUND_S = HEARTBEAT_S + 25  # heartbeat, the service's polling, the abort and its logs


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(pid: int, port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # multihost_case.py adds its 2 devices
    return subprocess.Popen(
        [sys.executable, "-u", str(ROOT / "tests" / "multihost_case.py"), str(pid), str(port),
         *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_tp4_across_two_processes_equals_one_device():
    port = _port()
    procs = [_start(0, port), _start(1, port)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    leader = _json_lines(outs[0][0])[-1]
    follower = _json_lines(outs[1][0])[-1]
    assert leader["equal"], (leader["outs"], leader["ref"])
    assert leader["preemptions"] > 0 and leader["prefix_hits"] > 0  # the workload's features
    assert follower["steps"] > 0


@pytest.mark.slow  # 91 s at load 6: over the second tier's per-issue allowance; by hand
@pytest.mark.parametrize("flag", ["--pp2", "--pp2-mb2"])
def test_pp2_tp2_across_two_processes_equals_one_device(flag: str):
    """Pipeline parallelism across processes: PP 2 x TP 2, stage 0 on process 0's two
    devices and stage 1 on process 1's (activations sent over gloo), equals one device
    over the mixed workload (swap off). 91 s at load 6. ``--pp2-mb2``: the same with
    pipeline_microbatches=2 (28 s at load 2.2)."""
    port = _port()
    procs = [_start(0, port, flag), _start(1, port, flag)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    leader = _json_lines(outs[0][0])[-1]
    assert leader["equal"], (leader["outs"], leader["ref"])
    assert leader["stage_processes"] == [[0], [1]]
    assert leader["preemptions"] > 0 and leader["prefix_hits"] > 0
    assert _json_lines(outs[1][0])[-1]["steps"] > 0


def test_a_dead_process_stops_the_other_within_the_heartbeat_bound():
    port = _port()
    leader, follower = _start(0, port), _start(1, port, "--die-after", "1")
    try:
        f_out, _ = follower.communicate(timeout=600)
        died = time.time()
        _, err = leader.communicate(timeout=BOUND_S + 60)
        stopped = time.time()
    finally:
        leader.kill()
        follower.kill()
    assert any("dying_at" in r for r in _json_lines(f_out)), f_out
    assert leader.returncode != 0
    assert "heartbeat timeout" in err or "another task died" in err, err[-3000:]
    assert stopped - died < BOUND_S, f"leader stopped {stopped - died:.1f} s after the death"


@pytest.mark.slow
def test_the_example_runs_on_two_processes():
    """examples/multihost_generate.py through the LLM API (LLM.follow / LLM.shutdown)."""
    port = _port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags_with_devices(2))  # fmt: skip
    cmd = [sys.executable, str(ROOT / "examples" / "multihost_generate.py"),
           "--coordinator-address", f"localhost:{port}", "--num-processes", "2"]  # fmt: skip
    procs = [subprocess.Popen([*cmd, "--process-id", str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in (0, 1)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    assert "process 0 of 2, tensor_parallel_size=4 over 4 devices" in outs[0][0]
