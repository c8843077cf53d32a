"""The Triton backend inside the model's layer loop, on the CPU: the jax-triton binding with
a stand-in that runs each call in Triton's interpreter through ``jax.pure_callback``, so the
engine's contract (stacked pool carried through ``lax.scan``, traced layer index, traced
per-layer windows, NaN-filled pages in random order) is exercised end to end. Logits must
match the XLA reference backend's. Runs in a subprocess with TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = r"""
import dataclasses, json, os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
import jax.numpy as jnp
import numpy as np
from pallas_kernels.triton.check_cases import FakeJaxTriton
fake = FakeJaxTriton(callback=True)
sys.modules["jax_triton"] = fake
from pallas_kernels.triton.jax_binding import ragged_paged_attention as triton_attention
from pagedjax.attention import ragged_paged_attention as reference_attention
from pagedjax.model import preset_arch, random_params
from tests.model_helpers import PagedRunner

# 2 layers with different windows (3, none): the window arrives traced, per layer.
arch = dataclasses.replace(preset_arch("tiny-llama"), num_layers=2, layer_windows=(3, None))
params = random_params(arch, seed=1, dtype=jnp.float32, std=0.15)
out = {}
for name, fn in (("reference", reference_attention), ("triton", triton_attention)):
    runner = PagedRunner(arch, params, block_size=4, max_tokens=16, max_seqs=2, max_len=32,
                         attention_fn=fn)
    first = runner.step([(0, list(range(5, 14))), (1, [7, 8])], all_logits=True)
    second = runner.step([(0, [20]), (1, [21, 22, 23])])
    out[name] = [np.asarray(step[sid]) for step in (first, second) for sid in sorted(step)]
diffs = [float(np.abs(a - b).max()) for a, b in zip(out["reference"], out["triton"])]
finite = all(bool(np.isfinite(b).all()) for b in out["triton"])
pools = sorted({tuple(c["array_shapes"][1]) for c in fake.calls})
print("RESULT " + json.dumps(dict(diffs=diffs, finite=finite, calls=len(fake.calls),
                                  pools=pools, windows=sorted({c["constexprs"]["USE_WINDOW"]
                                                               for c in fake.calls}))))
"""


def test_model_logits_with_triton_match_the_reference(subprocess_env):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True,
        env=subprocess_env(interpret=True), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line[len("RESULT ") :])
    assert r["finite"], "NaN from the poisoned pool"
    assert max(r["diffs"]) < 2e-4, r["diffs"]
    # Traced at least once (both steps share one padded shape, so one trace; nn.scan traced
    # its body twice, the LayerLoop's fori_loop once); the kernel always gets the whole
    # 2-layer pool, never a slice, and the window code (traced windows).
    assert r["calls"] >= 1 and r["windows"] == [True]
    assert all(p[0] == 2 for p in r["pools"]), r["pools"]
