"""The Triton backend inside the model's layer loop, on the CPU: the jax-triton binding with
a stand-in that runs each call in Triton's interpreter through ``jax.pure_callback``, so the
engine's contract (stacked pool carried through the layer loop's ``fori_loop``, traced
layer index, traced per-layer windows, NaN-filled pages in random order) is exercised end
to end. Logits must match the XLA reference backend's. Runs in a subprocess with
TRITON_INTERPRET=1.

The same with an 8-bit KV cache (docs/kv_quantization.md): the engine's writer quantizes
into a NaN-poisoned ``QuantizedPages`` pool (-m slow; each format), the Triton
kernel reads it through ``backends.with_8bit_pages`` (what the "triton" backend returns),
and the logits must match the reference backend reading the same pool: both read the same
8-bit values, so the bound is the float one."""

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
from pagedjax.attention.backends import with_8bit_pages
from pagedjax.model import preset_arch, random_params
from pagedjax.model.kv_cache import allocate_kv_cache
from tests.model_helpers import PagedRunner
kv_cache_dtype = sys.argv[1]
if kv_cache_dtype != "auto":
    triton_attention = with_8bit_pages(triton_attention)

# 2 layers with different windows (3, none): the window arrives traced, per layer.
arch = dataclasses.replace(preset_arch("tiny-llama"), num_layers=2, layer_windows=(3, None))
params = random_params(arch, seed=1, dtype=jnp.float32, std=0.15)
out = {}
for name, fn in (("reference", reference_attention), ("triton", triton_attention)):
    runner = PagedRunner(arch, params, block_size=4, max_tokens=16, max_seqs=2, max_len=32,
                         attention_fn=fn)
    if kv_cache_dtype != "auto":  # the same NaN-filled pool shape, 8-bit
        num_blocks = runner.kv[0].shape[1]
        runner.kv = allocate_kv_cache(arch, num_blocks, 4, jnp.float32, fill_value=np.nan,
                                      kv_cache_dtype=kv_cache_dtype)
    first = runner.step([(0, list(range(5, 14))), (1, [7, 8])], all_logits=True)
    second = runner.step([(0, [20]), (1, [21, 22, 23])])
    out[name] = [np.asarray(step[sid]) for step in (first, second) for sid in sorted(step)]
diffs = [float(np.abs(a - b).max()) for a, b in zip(out["reference"], out["triton"])]
finite = all(bool(np.isfinite(b).all()) for b in out["triton"])
pools = sorted({tuple(c["array_shapes"][1]) for c in fake.calls})
print("RESULT " + json.dumps(dict(diffs=diffs, finite=finite, calls=len(fake.calls),
                                  pool_dtypes=sorted({c["array_dtypes"][1] for c in fake.calls}),
                                  pools=pools, windows=sorted({c["constexprs"]["USE_WINDOW"]
                                                               for c in fake.calls}))))
"""


def _run(env: dict, kv_cache_dtype: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, kv_cache_dtype], capture_output=True, text=True,
        env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow  # ~33 s each at load 5; CI has the backend-level 8-bit checks
@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "fp8_e4m3", "fp8_e5m2"])
def test_model_logits_with_triton_on_an_8bit_cache(subprocess_env, kv_cache_dtype):
    r = _run(subprocess_env(interpret=True), kv_cache_dtype)
    assert r["finite"], "NaN from the poisoned pool"
    assert max(r["diffs"]) < 2e-4, r["diffs"]
    assert r["pool_dtypes"] == ["int8" if kv_cache_dtype.startswith("int8") else "uint8"]
    assert r["calls"] >= 1 and all(p[0] == 2 for p in r["pools"]), r


def test_model_logits_with_triton_match_the_reference(subprocess_env):
    r = _run(subprocess_env(interpret=True), "auto")
    assert r["finite"], "NaN from the poisoned pool"
    assert max(r["diffs"]) < 2e-4, r["diffs"]
    # Traced at least once (both steps share one padded shape, so one trace; nn.scan traced
    # its body twice, the LayerLoop's fori_loop once); the kernel always gets the whole
    # 2-layer pool, never a slice, and the window code (traced windows).
    assert r["calls"] >= 1 and r["windows"] == [True]
    assert all(p[0] == 2 for p in r["pools"]), r["pools"]
