"""Smoke runs of the out-of-the-box benchmarks (issue 13): ``benchmarks/vs_vllm_cpu.py`` and
``benchmarks/startup.py`` in their ``--quick`` modes, each in its own process as a user runs
it (each engine then runs in a further fresh process). The figures are in
docs/benchmarks.md; these tests check the harness: the vLLM side is skipped with a message
when its venv is missing, both engines' token counts are checked, and a second process on
the same compilation cache loads its programs from it."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Second tier (docs/testing.md): subprocesses and extra compiles.
pytestmark = [pytest.mark.tier2]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the module: the tiny checkpoint is written once."""
    return tmp_path_factory.mktemp("bench_models")


def _run(script: str, args: list[str], model_root: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PAGEDJAX_BENCH_MODELS": str(model_root),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_vs_vllm_cpu_quick_without_vllm(tmp_path: Path, model_root: Path) -> None:
    """pagedjax's side only: no vLLM venv at --venv, so that side is skipped (said so), and
    the last line says there is no ratio rather than inventing one."""
    out = tmp_path / "vs.json"
    args = ["--quick", "--num-requests", "2", "--venv", str(tmp_path / "no-venv")]
    proc = _run(
        "vs_vllm_cpu.py", [*args, "--workdir", str(tmp_path / "w"), "--out", str(out)], model_root
    )
    assert f"vLLM side skipped: no vLLM venv at {tmp_path / 'no-venv'}" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "ratio_vs_vllm_cpu: n/a (vLLM side skipped)"
    res = json.loads(out.read_text())
    col = res["columns"]["pagedjax defaults"]
    assert set(res["columns"]) == {"pagedjax defaults"}
    assert col["out_tokens"] == col["expected_tokens"] > 0
    assert math.isfinite(col["out_tok_s"]) and col["out_tok_s"] > 0
    assert 0 < col["import_s"] < col["startup_s"] < col["ready_after_warmup_s"]
    assert res["raw"]["pagedjax defaults"]["python"] == sys.version.split()[0]


def test_vs_vllm_cpu_needs_the_venv_unless_quick(tmp_path: Path) -> None:
    """A full comparison without vLLM's venv is an error naming the fix, not a silent skip."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "vs_vllm_cpu.py"),
            "--venv",
            str(tmp_path / "no-venv"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--build-venv" in proc.stderr and str(tmp_path / "no-venv") in proc.stderr


def test_startup_quick_cold_then_warm(tmp_path: Path, model_root: Path) -> None:
    """Cold start on an empty compilation cache compiles everything; the second process on
    the same cache gets its programs from it (persistent-cache hits, far less compile time)."""
    out = tmp_path / "startup.json"
    args = ["--quick", "--parts", "cold", "warm", "--workdir", str(tmp_path / "w")]
    proc = _run("startup.py", [*args, "--out", str(out)], model_root)
    m = re.fullmatch(r"cold_start_s: (\S+)", proc.stdout.strip().splitlines()[-1])
    assert m and float(m.group(1)) > 0, proc.stdout[-2000:]
    starts = json.loads(out.read_text())["starts"]
    cold, warm = starts["cold tiny-llama-2l"], starts["warm tiny-llama-2l"]
    assert cold["cache_hits"] == 0 and cold["compilations"] > 0 and cold["step_programs"] >= 1
    assert warm["cache_hits"] > 0
    assert warm["compile_s"] < cold["compile_s"]


@pytest.mark.slow  # two more engine processes, each compiling its first request's programs
def test_startup_quick_depth(tmp_path: Path, model_root: Path) -> None:
    out = tmp_path / "startup.json"
    _run("startup.py", ["--quick", "--parts", "depth", "--out", str(out)], model_root)
    depth = json.loads(out.read_text())["depth"]
    assert depth["ratio"] is not None and depth["ratio"] > 0
    assert all(d["step_compile_s"] > 0 for d in depth["models"].values())
