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
]


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
