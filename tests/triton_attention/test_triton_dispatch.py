"""Backend 'triton' in the attention switch and the config: explicit only, CUDA only,
jax-triton required, a warning unless a parity run on that GPU model is committed."""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

import pytest

from pagedjax.attention import select_attention_backend
from pagedjax.config import ConfigError, EngineConfig, load_dataclass
from pallas_kernels import parity

A100 = types.SimpleNamespace(
    platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB"
)


@pytest.fixture
def fake_jax_triton(monkeypatch):
    mod = types.ModuleType("jax_triton")
    mod.__spec__ = importlib.machinery.ModuleSpec("jax_triton", None)
    monkeypatch.setitem(sys.modules, "jax_triton", mod)


def test_triton_needs_a_cuda_gpu():
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        select_attention_backend("triton")  # the CPU
    tpu = types.SimpleNamespace(platform="tpu")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        select_attention_backend("triton", device=tpu)


def test_triton_needs_jax_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # find_spec -> None
    with pytest.raises(ImportError, match=r"pagedjax\[triton\]"):
        select_attention_backend("triton", device=A100)


def test_explicit_triton_warns_without_a_parity_run(fake_jax_triton, caplog, monkeypatch):
    from pallas_kernels.triton import jax_binding

    with caplog.at_level(logging.WARNING, logger="pagedjax.attention.backends"):
        b = select_attention_backend("triton", device=A100)
    assert b.name == "triton"  # the kernel, wrapped to take an 8-bit pool (QuantizedPages)
    assert b.ragged_paged_attention.__wrapped__ is jax_binding.ragged_paged_attention
    assert "no parity run" in b.reason and "A100" in b.reason
    assert any("no committed parity run" in r.getMessage() for r in caplog.records)
    monkeypatch.setitem(parity.TRITON_PARITY_REPORTS, A100.device_kind, "docs/gpu_check_x.md")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedjax.attention.backends"):
        b = select_attention_backend("triton", device=A100)
    assert "docs/gpu_check_x.md" in b.reason and not caplog.records


def test_auto_never_picks_triton(fake_jax_triton, monkeypatch):
    monkeypatch.setitem(parity.TRITON_PARITY_REPORTS, A100.device_kind, "docs/gpu_check_x.md")
    assert select_attention_backend("auto", device=A100).name == "reference"
    monkeypatch.setattr(parity, "H200_PARITY_VERIFIED", True)
    assert select_attention_backend("auto", device=A100).name == "reference"


def test_config_accepts_triton():
    assert load_dataclass(EngineConfig, {"attention_backend": "triton"}).attention_backend == (
        "triton"
    )
    with pytest.raises(ConfigError, match="attention_backend"):
        load_dataclass(EngineConfig, {"attention_backend": "tritonn"})
