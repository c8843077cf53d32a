"""Triton kernel tests. The interpreted cases run in one worker process started with
TRITON_INTERPRET=1 (``python -m pallas_kernels.triton.check_cases --serve``), because the
interpreter only works when set before triton's first import and this pytest process may
have imported triton already; the compile tests run ``pallas_kernels.triton.aot`` in a
subprocess with the variable unset. So nothing here changes the environment of other
tests. Needs torch and triton (the ``test`` extra; torch's Linux wheel brings triton)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _subprocess_env(interpret: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    # One thread each: the interpreter is numpy on small arrays; the box is shared.
    env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Worker:
    """A long-lived interpreter process: send a request, read its one-line JSON answer."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pallas_kernels.triton.check_cases", "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
            env=_subprocess_env(interpret=True),
        )  # fmt: skip

    def run(self, op: str, spec: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "spec": spec}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"interpreter worker exited with {self.proc.wait()}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise AssertionError("case raised in the worker:\n" + answer["error"])
        return answer["result"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def interp_worker():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    worker = Worker()
    yield worker
    worker.close()


@pytest.fixture(scope="session")
def subprocess_env():
    """env for a subprocess that imports this checkout: subprocess_env(interpret=bool)."""
    return _subprocess_env
