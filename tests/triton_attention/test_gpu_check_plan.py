"""The GPU check's plan on a GPU (built here without one): under 8 minutes, every part,
the 7B bf16 engine runs, the Triton backend wherever jax-triton is importable."""

from __future__ import annotations

import sys
import types

from pagedjax import gpu_check


def test_gpu_plan_fits_eight_minutes_and_has_every_part(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_triton", types.ModuleType("jax_triton"))
    monkeypatch.setattr(gpu_check, "_triton_jax_available", lambda: True)
    parts = gpu_check.plan_parts(dry_run=False, on_gpu=True, hopper=True)
    assert [p.name for p in parts] == ["environment", "parity", "bench", "roofline", "e2e"]
    assert sum(p.timeout_s for p in parts) <= 8 * 60 - 10
    assert not any(p.interpret for p in parts)  # compiled kernels on the GPU
    roofline, e2e = parts[3].argv, parts[4].argv
    assert "llama-2-7b" in roofline and "bfloat16" in roofline
    assert roofline[roofline.index("--attention-backend") + 1] == "triton"
    assert "llama-2-7b" in e2e and "bfloat16" in e2e
    assert e2e[e2e.index("--backends") + 1 :] == ["triton", "reference", "pallas"]


def test_gpu_plan_without_jax_triton_or_hopper(monkeypatch):
    monkeypatch.setattr(gpu_check, "_triton_jax_available", lambda: False)
    parts = gpu_check.plan_parts(dry_run=False, on_gpu=True, hopper=False)
    roofline, e2e = parts[3].argv, parts[4].argv
    assert roofline[roofline.index("--attention-backend") + 1] == "auto"
    assert e2e[e2e.index("--backends") + 1 :] == ["reference"]


def test_no_gpu_without_dry_run_refuses(capsys):
    assert gpu_check.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err
