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


def test_auto_on_an_h200_runs_the_reference_where_the_kernel_refuses(monkeypatch):
    """With the committed H200 parity run, "auto" on Hopper is the Mosaic kernel, and for
    inputs outside its contract (fp32; head_dim 32) the XLA reference, chosen at trace
    time: equal outputs, no error (these would raise in the kernel's checks)."""
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.attention import reference

    monkeypatch.setattr(parity, "H200_PARITY_VERIFIED", True)
    monkeypatch.setattr(parity, "H200_PARITY_REPORT", "docs/gpu_check_x.md")
    h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    auto = select_attention_backend("auto", device=h200)
    assert auto.name == "pallas" and "docs/gpu_check_x.md" in auto.reason
    rng = np.random.default_rng(0)
    for dtype, head_dim in ((jnp.float32, 64), (jnp.bfloat16, 32)):
        q = jnp.asarray(rng.normal(size=(3, 4, head_dim)), dtype)
        pool = jnp.asarray(rng.normal(size=(1, 4, 2, 16, head_dim)), dtype)
        args = (q, pool, pool, jnp.array([[1, 2], [3, 0]], jnp.int32),
                jnp.array([20, 1], jnp.int32), jnp.array([0, 2, 3], jnp.int32))  # fmt: skip
        kw = dict(layer=jnp.int32(0), sm_scale=head_dim**-0.5)
        got = auto.ragged_paged_attention(*args, **kw)
        want = reference.ragged_paged_attention(*args, **kw)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="head_dim must be a multiple of 64"):
        select_attention_backend("pallas").ragged_paged_attention(*args, **kw)  # asked for


def test_committed_parity_reports_exist_and_every_row_passed():
    """A parity flag names a report in the repository whose rows all passed."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    reports = set(parity.TRITON_PARITY_REPORTS.values())
    if parity.H200_PARITY_VERIFIED:
        reports.add(parity.H200_PARITY_REPORT)
    for name in reports:
        text = (root / name).read_text()
        # a parity row: "| backend | q [..] kv [..] bs 16 heads .. | dtype | ... | pass |"
        rows = [line for line in text.splitlines() if line.startswith("| ") and " bs " in line]
        assert rows and all(line.rstrip().endswith("| pass |") for line in rows), name
