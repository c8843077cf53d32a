"""python -m pagedjax.gpu_check --dry-run: every part at a tiny size on the CPU
(Triton and Mosaic GPU kernels in their interpreters, the engine parts on tiny-llama), so
the script that will run on a GPU cannot rot unseen.

CI runs the kernel parts (environment, parity, bench: ~35 s of CPU); the full dry run adds
the two engine scripts on tiny-llama (~40 s more of compilation) and is marked slow
(host_overhead.py's own tiny test is in tests/test_multi_step.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")


def _dry_run(tmp_path, env, group: str | None = None) -> str:
    from pagedjax.gpu_check import GROUPS

    out = tmp_path / "report.md"
    argv = [sys.executable, "-m", "pagedjax.gpu_check", "--dry-run", "--out", str(out)]
    only = GROUPS[group] if group else None
    if group:
        argv += ["--group", group]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "DRY RUN" in text and "sets nothing verified" in text
    parity = ("parity-mosaic", "parity-triton-jax", "parity-triton-torch")
    for part in only or ("environment", *parity, "bench", "roofline", "e2e-auto"):
        assert re.search(rf"^\| {part} \| ok \|", text, re.M), part
    return text


def _check_kernel_parts(text: str) -> None:
    # parity: the XLA reference and Mosaic GPU (interpreted) on 3 cases (one with a draft
    # tree); Triton through the jax-triton stand-in and Triton through torch, each on those
    # 3 and an fp8 pool: 14 rows in three parts, all passing
    assert re.search(r"^\| parity-mosaic \| ok \| \d+ \| 6/6 rows pass", text, re.M)
    for kind in ("triton-jax", "triton-torch"):
        assert re.search(rf"^\| parity-{kind} \| ok \| \d+ \| 4/4 rows pass", text, re.M)
    rows = [line for line in text.splitlines() if line.startswith("| Triton via")]
    assert len(rows) == 8 and all(line.endswith("| pass |") for line in rows)
    assert sum(" trees 5/-" in line for line in text.splitlines()) == 4
    assert sum("pool fp8_e4m3" in line for line in rows) == 2
    bench_rows = [line for line in text.splitlines() if line.startswith("| tiny ")]
    assert len(bench_rows) == 2
    for line in bench_rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        float(cells[1]), float(cells[4]), float(cells[7]), float(cells[8])  # ran: numbers


@pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles
def test_dry_run_kernel_parts(tmp_path, subprocess_env):
    text = _dry_run(tmp_path, subprocess_env(interpret=False), "kernels")
    _check_kernel_parts(text)
    assert "| roofline |" not in text


@pytest.mark.slow
def test_dry_run_every_part(tmp_path, subprocess_env):
    text = _dry_run(tmp_path, subprocess_env(interpret=False))
    _check_kernel_parts(text)
    assert "device time / roofline" in text and "offline_throughput_tok_s[auto]" in text
