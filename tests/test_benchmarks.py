"""Smoke runs of the benchmark scripts: each finishes on a tiny setting and its last line is
``NAME: value`` with a positive number (the figures themselves are in docs/benchmarks.md).

Each script runs in its own process, as a user runs it, so its thread settings and jit
caches are its own."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    ("throughput_vs_hf.py", ["--tiny"], "speedup_vs_hf"),
    ("paged_vs_contiguous.py", ["--tiny"], "concurrency_ratio"),
    ("scheduler_overhead.py", ["--seqs", "256", "--steps", "3"], "us_per_step_at_256"),
    ("attention_cpu.py", ["--only", "1", "--reps", "1"], "ms_decode_256"),
    ("kv_capacity.py", [], "fp8_capacity_gain"),
    ("tp_capacity.py", [], "kv_tokens_70b_tp8"),
    ("pp_capacity.py", [], "pp_bubble_1_in_flight_pp4"),
]


@pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles
@pytest.mark.parametrize(("script", "args", "name"), CASES, ids=[c[0] for c in CASES])
def test_benchmark_last_line(script: str, args: list[str], name: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        # Import pagedjax from this checkout, not from wherever the venv's install points.
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) >= 2, proc.stdout  # a table, then the headline
    m = re.fullmatch(rf"{name}: (\S+)", lines[-1])
    assert m, f"last line {lines[-1]!r} is not '{name}: <number>'"
    value = float(m.group(1))
    assert math.isfinite(value) and value > 0, value


@pytest.mark.slow  # the same loops run in test_experiments' sharing test (CI time limit)
def test_sharing_memory_quick() -> None:
    """benchmarks/sharing_memory.py --quick: the Fig. 15 table (ours beside the paper's),
    beam search saving more than parallel sampling, and the headline last line. Run with
    this checkout first on the path, so a worktree's pagedjax is the one measured."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sharing_memory.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    num = r" +([\d.]+)% \|"
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\| (parallel sampling n=|beam search width=)(\d) +\|" + num * 3, line)
        if m:
            rows[(m.group(1)[:4], int(m.group(2)))] = tuple(float(m.group(i)) for i in (3, 4, 5))
    assert set(rows) == {(m, w) for m in ("para", "beam") for w in (2, 4, 6)}, proc.stdout
    assert rows[("beam", 6)][2] == 55.16 and rows[("para", 2)][2] == 6.09  # the paper's
    for w in (2, 4, 6):  # whole run and steady: beams share more than parallel samples
        for col in (0, 1):
            assert 0 < rows[("para", w)][col] < rows[("beam", w)][col] < 100
    m = re.fullmatch(r"beam6_saved_pct: (\S+)", proc.stdout.strip().splitlines()[-1])
    assert m and float(m.group(1)) == rows[("beam", 6)][1]
