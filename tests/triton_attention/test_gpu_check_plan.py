"""The GPU check's plan on a GPU (built here without one): every part, each group under
the device tool's 10 minutes, the 7B bf16 engine runs, the Triton backend wherever
jax-triton is importable."""

from __future__ import annotations

import sys
import types

from pagedjax import gpu_check


def test_gpu_plan_groups_fit_ten_minutes_and_hold_every_part(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_triton", types.ModuleType("jax_triton"))
    monkeypatch.setattr(gpu_check, "_triton_jax_available", lambda: True)
    parts = gpu_check.plan_parts(dry_run=False, on_gpu=True, hopper=True)
    names = [p.name for p in parts]
    assert names == [
        "environment",
        "parity-mosaic",
        "parity-triton-jax",
        "parity-triton-torch",
        "bench",
        "roofline",
        "e2e-triton",
        "e2e-reference",
        "e2e-pallas",
    ]
    by_name = {p.name: p for p in parts}
    assert set(names) == {n for group in gpu_check.GROUPS.values() for n in group}
    for group in gpu_check.GROUPS.values():  # one device command each, with room to spare
        assert sum(by_name[n].timeout_s for n in group) <= 10 * 60 - 30
    assert not any(p.interpret for p in parts)  # compiled kernels on the GPU
    parity = by_name["parity-mosaic"].argv
    assert parity[parity.index("--backends") + 1 :] == ["reference", "mosaic"]
    roofline = by_name["roofline"].argv
    assert "llama-2-7b" in roofline and "bfloat16" in roofline
    assert roofline[roofline.index("--attention-backend") + 1] == "triton"
    for b in ("triton", "reference", "pallas"):
        e2e = by_name[f"e2e-{b}"].argv
        assert "llama-2-7b" in e2e and "bfloat16" in e2e
        assert e2e[e2e.index("--backends") + 1 :] == [b]


def test_gpu_plan_without_jax_triton_or_hopper(monkeypatch):
    monkeypatch.setattr(gpu_check, "_triton_jax_available", lambda: False)
    parts = gpu_check.plan_parts(dry_run=False, on_gpu=True, hopper=False)
    by_name = {p.name: p for p in parts}
    assert "parity-triton-jax" not in by_name and "e2e-pallas" not in by_name
    roofline = by_name["roofline"].argv
    assert roofline[roofline.index("--attention-backend") + 1] == "auto"
    assert [n for n in by_name if n.startswith("e2e-")] == ["e2e-reference"]


def test_no_gpu_without_dry_run_refuses(capsys):
    assert gpu_check.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err
