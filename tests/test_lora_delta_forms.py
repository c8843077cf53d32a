"""The LoRA delta's forms (pagedjax/model/lora_delta.py): the dense form against numpy,
and ``lora_delta``'s choice of form by static shapes (docs/lora.md, "Gathered vs grouped
matmul")."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.lora import (
    lora_delta,
    lora_delta_dense,
    lora_delta_form,
    lora_delta_gathered,
)
from pagedjax.model.lora_delta import GATHER_COPY_BYTES


def _case(rng, rows, slots, d_in, d_out, r):
    a = rng.normal(size=(slots, d_in, r)).astype(np.float32)
    b = rng.normal(size=(slots, r, d_out)).astype(np.float32)
    a[0], b[0] = 0, 0  # slot 0: the base model
    scale = rng.uniform(0.5, 2, size=slots).astype(np.float32)
    x = rng.normal(size=(rows, d_in)).astype(np.float32)
    ids = rng.integers(0, slots, rows).astype(np.int32)
    want = np.stack([x[i] @ a[s] @ b[s] * scale[s] for i, s in enumerate(ids)])
    return x, ids, a, b, scale, want


@pytest.mark.parametrize("rows,slots", [(1, 1), (5, 3), (9, 4)])
def test_dense_and_gathered_equal_numpy_and_base_rows_get_exact_zero(rows, slots):
    x, ids, a, b, scale, want = _case(np.random.default_rng(rows), rows, slots, 6, 5, 3)
    for fn in (lora_delta_dense, lora_delta_gathered, lora_delta):
        got = np.asarray(fn(x, ids, a, b, scale))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.all(got[ids == 0] == 0)


def test_lora_delta_picks_dense_past_the_gathered_copy_limit():
    # SmolLM2's shapes, 17 slots: a few rows of rank 8, gathered; 32+ rows (a 64-row
    # decode), dense; a 1,024-token prefill chunk, dense; rank 64 at 64 rows: gathered on
    # q (1,088 columns, 19 MB of copies), dense on a 576 -> 1,536 MLP (35 MB); gathered
    # again when the dense form's FLOPs (x slots) would be too many.
    assert lora_delta_form(16, 576, 576, 8, 17) == "gathered"
    assert lora_delta_form(64, 576, 576, 8, 17) == "dense"
    assert lora_delta_form(1024, 576, 576, 8, 17) == "dense"
    assert lora_delta_form(64, 576, 576, 64, 17) == "gathered"
    assert lora_delta_form(64, 576, 1536, 64, 17) == "dense"
    assert lora_delta_form(1024, 576, 576, 8, 65) == "gathered"
    rows = GATHER_COPY_BYTES // ((256 + 256) * 32 * 4) + 1  # just past the limit: dense
    assert lora_delta_form(rows - 1, 256, 256, 32, 8) == "gathered"  # 256 columns: wide
    assert lora_delta_form(rows, 256, 256, 32, 8) == "dense"
    x, ids, a, b, scale, want = _case(np.random.default_rng(0), rows, 8, 256, 256, 32)
    got = np.asarray(lora_delta(x, ids, a, b, scale))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)  # sums of ~8,000 terms
    assert np.all(got[ids == 0] == 0)
