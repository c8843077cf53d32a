"""The attention backend switch (pagedjax.attention.backends), moved here from
tests/kernels/ when the switch moved out of pallas_kernels (it needs pagedjax)."""

from __future__ import annotations

import types

import pytest

from pagedjax.attention import select_attention_backend
from pallas_kernels import parity


def test_dispatch(monkeypatch):
    assert select_attention_backend("reference").name == "reference"
    assert select_attention_backend("pallas").name == "pallas"
    assert select_attention_backend("native_cpu").name == "native_cpu"
    # These tests run on CPU: auto is the native CPU kernel where it builds, else the
    # reference, with or without a parity run; never the Pallas kernels.
    auto = select_attention_backend("auto")
    assert auto.name in ("native_cpu", "reference") and auto.reason.startswith("auto: CPU")
    monkeypatch.setattr(parity, "H200_PARITY_VERIFIED", True)
    assert select_attention_backend("auto").name != "pallas"
    a100 = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
    assert "not a Hopper" in select_attention_backend("auto", device=a100).reason
    monkeypatch.setattr(parity, "H200_PARITY_VERIFIED", False)
    h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    assert select_attention_backend("auto", device=h200).name == "reference"
    sentinel = lambda *a, **k: None
    assert select_attention_backend("reference", reference=sentinel).ragged_paged_attention is (
        sentinel
    )
    with pytest.raises(ValueError):
        select_attention_backend("triton")
