"""The native CPU attention kernel (pagedjax.attention.native_cpu) against dense attention
and against the XLA reference, its error reports, its fallbacks, and the engine on it."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import native_build
from pagedjax.attention import kv_quant, native_cpu, ragged_paged_attention
from pallas_kernels.cases import make_case as make_poisoned_case
from tests.test_attention import (
    BS,
    NB,
    VARIANTS,
    D,
    M,
    S,
    expected_output,
    make_case,
    ragged_lengths,
)

# On a machine with a compiler the kernel must build: a silent fallback would make every
# test below compare the reference with itself. So the tests skip only without a compiler
# (native_build.compiler(): $CXX, else g++), and fail when the build fails.
if shutil.which("g++"):
    assert native_cpu.available()[0], native_cpu.available()[1]
pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler")


def test_kernel_builds_where_a_compiler_is_present():
    ok, why = native_cpu.available()
    assert ok, f"native attention did not build with {native_build.compiler()}: {why}"


@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap"))
def _native(q, k_pages, v_pages, bt, kv_lens, cu, sliding_window=None, soft_cap=None):
    return native_cpu.ragged_paged_attention(
        q, k_pages, v_pages, bt, kv_lens, cu,
        sm_scale=D**-0.5, sliding_window=sliding_window, soft_cap=soft_cap,
    )  # fmt: skip


_native_q16 = jax.jit(functools.partial(native_cpu.ragged_paged_attention, sm_scale=0.25))
_reference_q16 = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.25))


def _f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


@pytest.mark.parametrize("variant", list(VARIANTS))
@settings(max_examples=25, deadline=None)
@given(case=ragged_lengths())
def test_matches_dense_attention(variant, case):
    """Ragged prefill / decode mixes, GQA / MQA, sliding window, soft cap; NaN-filled pool
    (reading any slot a sequence does not own would poison its rows)."""
    hq, hkv, window, cap = VARIANTS[variant]
    q_lens, kv_lens, perm, seed = case
    q, kp, vp, bt, kvl, cu, seqs = make_case(np.random.default_rng(seed), q_lens, kv_lens,
                                             hq, hkv, perm)  # fmt: skip
    got = np.asarray(_native(*_f32(q, kp, vp), jnp.asarray(bt), jnp.asarray(kvl),
                             jnp.asarray(cu), sliding_window=window, soft_cap=cap))  # fmt: skip
    np.testing.assert_allclose(got, expected_output(q, cu, kvl, seqs, hq, window, cap),
                               atol=2e-5, rtol=1e-5)  # fmt: skip
    assert (got[cu[-1] :] == 0).all(), "padding tokens must give exactly 0"


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_agrees_with_the_xla_reference_on_poisoned_cases(data):
    """Garbage page ids past kv_len and NaN pages (pallas_kernels.cases), longer queries
    than one 16-query tile."""
    seqs, bs, mb, t = 3, 8, 6, 48
    kv_lens = data.draw(st.lists(st.integers(0, mb * bs), min_size=seqs, max_size=seqs))
    q_lens = [data.draw(st.integers(1, min(n, t // seqs))) if n else 0 for n in kv_lens]
    c = make_poisoned_case(
        np.random.default_rng(data.draw(st.integers(0, 2**16))), q_lens=q_lens,
        kv_lens=kv_lens, num_tokens=t, num_q_heads=4, num_kv_heads=2, head_dim=16,
        block_size=bs, max_blocks=mb, num_blocks=seqs * mb + 1,
    )  # fmt: skip
    args = [jnp.asarray(x) for x in (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens,
                                     c.cu_q_lens)]  # fmt: skip
    got, want = np.asarray(_native_q16(*args)), np.asarray(_reference_q16(*args))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_decode_batch_of_the_engine_shape():
    """T = S decode rows with long contexts over many pages and random page order."""
    rng = np.random.default_rng(3)
    num_seqs, hq, hkv, d, bs, mb = 12, 8, 2, 64, 16, 12
    nb = num_seqs * mb + 1
    kv = rng.integers(1, mb * bs, num_seqs).astype(np.int32)
    kv[-2:] = 0  # padding rows
    cu = np.concatenate([[0], np.cumsum(kv > 0)]).astype(np.int32)
    bt = rng.permutation(np.arange(1, nb))[: num_seqs * mb].reshape(num_seqs, mb)
    q = jnp.asarray(rng.standard_normal((num_seqs, hq, d)), jnp.float32)
    kp, vp = (jnp.asarray(rng.standard_normal((nb, hkv, bs, d)), jnp.float32) for _ in "kv")
    args = (q, kp, vp, jnp.asarray(bt, jnp.int32), jnp.asarray(kv), jnp.asarray(cu))
    got = jax.jit(functools.partial(native_cpu.ragged_paged_attention, sm_scale=d**-0.5))(*args)
    want = jax.jit(functools.partial(ragged_paged_attention, sm_scale=d**-0.5))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[cu[-1] :].any()


def _one_sequence(kv_len: int, page: int):
    q = jnp.ones((1, 2, D), jnp.float32)
    pages = jnp.ones((NB, 2, BS, D), jnp.float32)
    bt = jnp.full((S, M), page, jnp.int32)
    kvl = jnp.asarray([kv_len, 0, 0, 0], jnp.int32)
    cu = jnp.asarray([0, 1, 1, 1, 1], jnp.int32)
    return q, pages, pages, bt, kvl, cu


@pytest.mark.parametrize(
    "kv_len,page,match",
    [(3, NB, "outside"), (3, -1, "outside"), (M * BS + 1, 1, "kv_len"), (0, 1, "q_len")],
    ids=["page_past_pool", "negative_page", "kv_len_past_table", "q_len_over_kv_len"],
)
def test_bad_inputs_are_reported_not_read(kv_len, page, match):
    """Out-of-pool pages and impossible lengths raise instead of reading stray memory."""
    with pytest.raises(Exception, match=match):
        np.asarray(_native(*_one_sequence(kv_len, page)))


def test_non_fp32_inputs_fall_back_to_the_xla_version():
    rng = np.random.default_rng(0)
    q, kp, vp, bt, kvl, cu, _ = make_case(rng, [3, 1, 0, 2], [7, 9, 0, 2], 4, 2,
                                          list(range(1, NB)))  # fmt: skip
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, kp, vp)]
    rest = (jnp.asarray(bt), jnp.asarray(kvl), jnp.asarray(cu))
    got = native_cpu.ragged_paged_attention(*bf, *rest, sm_scale=0.3)
    want = ragged_paged_attention(*bf, *rest, sm_scale=0.3)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("PAGEDJAX_NATIVE_CPU", "0")
    assert native_cpu._load.__wrapped__() == (False, "disabled by PAGEDJAX_NATIVE_CPU=0")


def test_a_failed_build_is_reported_and_falls_back(monkeypatch, tmp_path):
    bad = tmp_path / "broken.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(native_cpu, "SOURCE", bad)
    monkeypatch.setenv("PAGEDJAX_KERNEL_CACHE", str(tmp_path / "cache"))
    ok, why = native_cpu._load.__wrapped__()
    assert not ok and "failed" in why


def test_engine_runs_on_the_native_kernel_by_default():
    """``attention_backend="auto"`` (the default) picks the native kernel on the CPU; the
    engine tests run on it, tests/test_model_parity.py checks its logits against HF."""
    from pagedjax.config import CacheConfig, EngineConfig, ModelConfig
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.tokenizer import ByteTokenizer
    from tests.test_engine import ARCH, _params

    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=64, seed=0),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=40),
    )
    assert config.attention_backend == "auto"
    assert LLMEngine(ARCH, _params(), tok, config).attention_backend == "native_cpu"


def test_stacked_pool_layer_index_and_traced_window():
    """Whole stacked pool + traced layer index (other layers NaN: reading one shows) and a
    traced window equal the 4-D pages with a static window; a layer outside the pool is an
    error, not a stray read."""
    rng = np.random.default_rng(3)
    q, kp, vp, bt, kvl, cu, _ = make_case(rng, [3, 1, 0, 2], [17, 9, 0, 2], 4, 2,
                                          list(range(1, NB)))  # fmt: skip
    q, kp, vp = _f32(q, kp, vp)
    bt, kvl, cu = jnp.asarray(bt), jnp.asarray(kvl), jnp.asarray(cu)
    k5 = jnp.full((3, *kp.shape), jnp.nan, jnp.float32).at[2].set(kp)
    v5 = jnp.full((3, *vp.shape), jnp.nan, jnp.float32).at[2].set(vp)

    @jax.jit
    def stacked(layer, window):
        return native_cpu.ragged_paged_attention(
            q, k5, v5, bt, kvl, cu, layer=layer, sm_scale=D**-0.5, sliding_window=window
        )

    for window in (0, 5):
        got = np.asarray(stacked(jnp.int32(2), jnp.int32(window)))
        want = np.asarray(_native(q, kp, vp, bt, kvl, cu, sliding_window=window or None))
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(got).all()
    with pytest.raises(Exception, match="layer index 3 outside"):
        np.asarray(stacked(jnp.int32(3), jnp.int32(0)))


@functools.partial(jax.jit, static_argnames=("soft_cap", "native"))
def _wide(q, k, v, bt, kv_lens, cu, window, tree, soft_cap, native, layer=None):
    fn = native_cpu.ragged_paged_attention if native else ragged_paged_attention
    return fn(q, k, v, bt, kv_lens, cu, sm_scale=0.2, sliding_window=window, soft_cap=soft_cap,
              tree_mask=tree, layer=layer)  # fmt: skip


def _cpu_has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def test_the_vector_loop_is_built_where_the_cpu_has_avx512():
    """The test below compares the AVX-512 loop only where it was compiled: on such a CPU
    it must be (the build uses -march=native), so that test cannot silently compare the
    portable loop instead."""
    assert native_cpu.vector_path() == _cpu_has_avx512()


@pytest.mark.parametrize("head_dim,block_size,soft_cap", [
    (64, 16, None), (80, 8, 20.0), (96, 32, None), (128, 16, None), (256, 16, 30.0),
])  # fmt: skip
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_vector_head_dims_match_the_xla_reference(head_dim, block_size, soft_cap, data):
    """Head dims the AVX-512 loop takes (cpu_kernel.cc: 64, 80, 96, 128, 256): ragged
    prefill / decode rows over partial pages (pages of 8, 16 and 32 keys), NaN past kv_len,
    a sliding window (0: none) and random draft-tree words (each row sees itself), fp32
    and int8 pages, against the XLA version."""
    seqs, mb, t = 3, 6, 48
    kv_lens = data.draw(st.lists(st.integers(0, mb * block_size), min_size=seqs, max_size=seqs))
    q_lens = [data.draw(st.integers(1, min(n, t // seqs))) if n else 0 for n in kv_lens]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    c = make_poisoned_case(
        rng, q_lens=q_lens, kv_lens=kv_lens, num_tokens=t, num_q_heads=6, num_kv_heads=2,
        head_dim=head_dim, block_size=block_size, max_blocks=mb, num_blocks=seqs * mb + 1,
    )  # fmt: skip
    words = rng.integers(0, 2**32, t, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
    if data.draw(st.booleans()):
        words[:] = 0xFFFFFFFF  # causal rows: the unmasked loop
    window = jnp.int32(data.draw(st.sampled_from([0, 1, 5, 23])))
    args = [jnp.asarray(x) for x in (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens,
                                     c.cu_q_lens)]  # fmt: skip
    layer = None
    if head_dim == 64 and data.draw(st.booleans()):  # int8 pages: the scratch page's loop
        fmt = kv_quant.resolve_kv_format("int8_per_token_head")
        args[1:3] = (kv_quant.QuantizedPages(*kv_quant.quantize(jnp.nan_to_num(x)[None], fmt),
                                             fmt) for x in args[1:3])  # fmt: skip
        layer = jnp.int32(0)
    got, want = (np.asarray(_wide(*args, window, jnp.asarray(words), soft_cap, native, layer))
                 for native in (True, False))  # fmt: skip
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
