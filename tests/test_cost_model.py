"""Tests for pagedjax.simulator.cost_model: roofline step times and the fitted profile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.simulator.cost_model import (
    GPUS,
    MODEL_PRESETS,
    FittedCostModel,
    ModelGeometry,
    model_geometry,
    roofline,
)


@pytest.mark.parametrize(
    ("name", "params_b", "kv_bytes"),
    [
        ("opt-13b", 12.85, 819_200),  # paper: 26 GB of weights, 800 KB of KV per token
        ("opt-66b", 65.7, 2_359_296),
        ("opt-175b", 174.6, 4_718_592),
        ("llama-2-7b", 6.74, 524_288),
        ("llama-3-8b", 8.03, 131_072),
        # Issue 23 (model cards; biases and norms excluded, < 0.1 %).
        ("pythia-6.9b", 6.857, 524_288),
        ("pythia-12b", 11.846, 737_280),
        ("gemma-2-9b", 9.24, 344_064),
        ("qwen3-8b", 8.19, 147_456),
        ("phi-3-mini", 3.82, 393_216),
        ("mixtral-8x7b", 46.7, 131_072),
    ],
)
def test_presets_match_known_sizes(name, params_b, kv_bytes):
    geom = MODEL_PRESETS[name]
    assert abs(geom.total_params / 1e9 / params_b - 1) < 0.005
    assert geom.kv_bytes_per_token == kv_bytes


def test_opt13b_decode_is_memory_bound_near_weights_over_bandwidth():
    model = roofline("A100-40GB", "opt-13b", step_overhead_s=0.0)
    # One decode step of 8 sequences with 256 tokens of context each.
    t = float(model(0, 8, 8 * 256))
    assert bool(model.is_memory_bound(0, 8, 8 * 256))
    weights_only = 25.7e9 / 1.555e12  # ~16.5 ms at peak bandwidth
    assert weights_only < t < 1.35 * weights_only  # efficiency 0.85 and a little KV
    # A long prefill is compute-bound and costs more than a decode step.
    assert not bool(model.is_memory_bound(2048, 0, 0))
    assert float(model(2048, 0, 0)) > t


def test_step_time_monotone_and_overhead():
    model = roofline("H100-80GB", "llama-3-8b")
    base = float(model(0, 1, 100))
    assert float(model(0, 1, 100_000)) > base  # more KV read
    assert float(model(4096, 1, 100)) > base  # more compute
    no_overhead = roofline("H100-80GB", "llama-3-8b", step_overhead_s=0.0)
    assert abs(base - float(no_overhead(0, 1, 100)) - 2e-3) < 1e-6


def test_faster_gpu_is_faster_and_tp_splits_work():
    work = (0, 64, 64 * 400)
    times = [float(roofline(g, "llama-2-7b")(*work)) for g in GPUS]
    assert times[0] > times[1] > times[2] > times[3]  # A100-40, A100-80, H100, H200
    one = roofline("A100-80GB", "opt-66b", tp=1, step_overhead_s=0.0)
    four = roofline("A100-80GB", "opt-66b", step_overhead_s=0.0)
    assert four.model.tp == 4
    assert float(four.memory_time(*work)) == pytest.approx(float(one.memory_time(*work)) / 4, 1e-5)
    assert float(four.comm_time(0, 64)) > 0 and float(one.comm_time(0, 64)) == 0


def test_jit_and_while_loop():
    model = roofline("A100-40GB", "opt-13b")
    step = jax.jit(model)
    np.testing.assert_allclose(step(128, 16, 4000), model(128, 16, 4000), rtol=1e-6)

    # A toy decode-only simulation inside lax.while_loop: 10 sequences, 50 steps.
    @jax.jit
    def simulate(ctx0):
        def body(carry):
            i, ctx, clock = carry
            return i + 1, ctx + 1, clock + model(0, ctx.shape[0], ctx.sum())

        return jax.lax.while_loop(lambda c: c[0] < 50, body, (0, ctx0, jnp.float32(0)))[2]

    ctx0 = jnp.full((10,), 100, jnp.int32)
    expected = sum(float(model(0, 10, 10 * (100 + k))) for k in range(50))
    np.testing.assert_allclose(float(simulate(ctx0)), expected, rtol=1e-5)
    # Vectorized over a batch of steps.
    batch = model(jnp.array([0, 512]), jnp.array([32, 0]), jnp.array([8000, 0]))
    assert batch.shape == (2,) and batch.dtype == jnp.float32


def test_fitted_model_recovers_coefficients():
    rng = np.random.default_rng(0)
    n = 400
    prefill = rng.integers(0, 2048, n) * (rng.random(n) < 0.3)
    decode = rng.integers(0, 256, n)
    kv = decode * rng.integers(16, 2048, n)
    pairs = prefill**2 // 2
    true = (4e-3, 9e-5, 3e-5, 6e-8, 2e-10)
    t = true[0] + true[1] * prefill + true[2] * decode + true[3] * kv + true[4] * pairs
    noisy = t + rng.normal(0, 1e-5, n)
    fitted = FittedCostModel.fit(prefill, decode, kv, noisy, prefill_attn_pairs=pairs)
    np.testing.assert_allclose(fitted.coef, true, rtol=0.05)
    assert fitted.rms_residual_s < 2e-5
    np.testing.assert_allclose(jax.jit(fitted)(prefill, decode, kv, pairs), t, rtol=1e-3, atol=1e-4)


def test_fit_recovers_the_wake_cost_of_steps_after_idle():
    rng = np.random.default_rng(3)
    n = 400
    decode = rng.integers(1, 64, n)
    kv = decode * rng.integers(16, 512, n)
    woke = (rng.random(n) < 0.1).astype(float)
    t = 1e-3 + 2e-5 * decode + 1e-8 * kv + 1.5e-3 * woke + rng.normal(0, 1e-5, n)
    fitted = FittedCostModel.fit(np.zeros(n), decode, kv, t, nonnegative=True, after_idle=woke)
    assert fitted.wake_s == pytest.approx(1.5e-3, rel=0.05)
    np.testing.assert_allclose(fitted.coef[:4], (1e-3, 0.0, 2e-5, 1e-8), rtol=0.05, atol=1e-9)
    # Without the column the wake cost is smeared into the other terms (worse residual).
    blind = FittedCostModel.fit(np.zeros(n), decode, kv, t, nonnegative=True)
    assert blind.wake_s == 0.0 and blind.rms_residual_s > 10 * fitted.rms_residual_s
    with pytest.raises(ValueError, match="after_idle"):
        FittedCostModel.fit(np.zeros(n), decode, kv, t, after_idle=woke[:-1])


def test_nonnegative_fit_recovers_and_never_prices_work_below_zero():
    rng = np.random.default_rng(5)
    n = 400
    prefill = rng.integers(0, 2048, n) * (rng.random(n) < 0.3)
    decode = rng.integers(0, 256, n)
    kv = decode * rng.integers(16, 2048, n)
    pairs = prefill**2 // 2
    true = (4e-3, 9e-5, 3e-5, 6e-8, 2e-10)
    t = true[0] + true[1] * prefill + true[2] * decode + true[3] * kv + true[4] * pairs
    fitted = FittedCostModel.fit(prefill, decode, kv, t, pairs, nonnegative=True)
    np.testing.assert_allclose(fitted.coef, true, rtol=0.05)
    # Nearly collinear columns and noise: the free fit trades a negative KV cost
    # against decode; the constrained one keeps every coefficient >= 0.
    decode = rng.integers(1, 64, n)
    kv = decode * 100 + rng.integers(0, 3, n)
    t = 0.01 + 1e-3 * decode + rng.normal(0, 2e-3, n)
    free = FittedCostModel.fit(np.zeros(n), decode, kv, t)
    nonneg = FittedCostModel.fit(np.zeros(n), decode, kv, t, nonnegative=True)
    assert min(free.coef) < 0
    assert min(nonneg.coef) >= 0 and nonneg.rms_residual_s < 2.5e-3


def test_fit_to_roofline_samples_is_close_in_memory_bound_regime():
    # A fitted profile of decode-only steps of the roofline itself is linear there.
    model = roofline("A100-40GB", "opt-13b")
    rng = np.random.default_rng(1)
    decode = rng.integers(1, 64, 200)
    kv = decode * rng.integers(16, 1024, 200)
    t = np.asarray(model(0, decode, kv))
    fitted = FittedCostModel.fit(np.zeros(200), decode, kv, t)
    np.testing.assert_allclose(np.asarray(fitted(0, decode, kv)), t, rtol=1e-3)
    assert fitted.coef[1] == 0.0 and fitted.coef[4] == 0.0  # unseen features


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="gpu"):
        roofline("V100", "opt-13b")
    with pytest.raises(ValueError, match="name"):
        model_geometry("gpt-5")
    with pytest.raises(ValueError, match="mem_efficiency"):
        roofline("H200", "opt-13b", mem_efficiency=1.5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelGeometry("bad", 2, 64, 6, 4, 16, 128, 100)
    with pytest.raises(ValueError, match="step_time_s"):
        FittedCostModel.fit([1, 2], [1, 2], [1, 2], [1.0])


def test_swap_time_is_copies_plus_bytes_over_pcie():
    """OPT-13B on an A100: a 16-token block is 13.1 MB; 40 layers x K/V = 80 copies."""
    cm = roofline("A100-40GB", "opt-13b")
    assert float(cm.swap_time(0, 16)) == 0.0
    block_bytes = 16 * 819_200
    want = 80 * cm.copy_latency_s + block_bytes / (32e9 * cm.host_link_efficiency)
    assert float(cm.swap_time(1, 16)) == pytest.approx(want, rel=1e-5)
    assert float(cm.swap_time(10, 16)) == pytest.approx(10 * want, rel=1e-5)
    # The same tokens in 16x smaller blocks: equal bytes, 16x the fixed copy costs.
    small, big = float(cm.swap_time(16, 1)), float(cm.swap_time(1, 16))
    assert small - big == pytest.approx(15 * 80 * cm.copy_latency_s, rel=1e-4)


def test_moe_step_reads_only_the_experts_its_tokens_use():
    """Mixtral-8x7B: one decode token reads 2 of 8 experts per layer (~12.9B of 46.7B
    parameters: attention, router, LM head and 2 experts), a large batch nearly all; the
    expected count is E * (1 - (1 - k/E)^n) under uniform routing."""
    geom = MODEL_PRESETS["mixtral-8x7b"]
    np.testing.assert_allclose(float(geom.expected_experts_read(1)), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(geom.expected_experts_read(2)), 8 * (1 - 0.75**2), rtol=1e-6)
    assert 7.99 < float(geom.expected_experts_read(64)) <= 8.0
    one = float(geom.step_weight_bytes_read(1)) / geom.bytes_per_param / 1e9
    assert 12.5 < one < 13.0
    many = float(geom.step_weight_bytes_read(512))
    assert abs(many / geom.step_weight_bytes - 1) < 1e-6
    # FLOPs count the chosen experts only: per token 2 * (active params), not all 8 experts.
    model = roofline("H100-80GB", "mixtral-8x7b", step_overhead_s=0.0)
    dense_like = 2.0 * geom.num_layers * geom.layer_matmul_params
    per_token = float(model.step_flops(1, 0, 0))  # one prompt token, no logit row
    assert per_token < 0.35 * dense_like
    # A decode step of one sequence is much cheaper than one reading all experts.
    assert float(model.step_bytes(0, 1, 0)) < 0.3 * geom.step_weight_bytes


def test_dense_model_step_bytes_unchanged_by_the_moe_accounting():
    geom = MODEL_PRESETS["llama-2-7b"]
    for n in (1, 7, 300):
        assert float(geom.step_weight_bytes_read(n)) == pytest.approx(geom.step_weight_bytes)
    assert geom.active_layer_params == geom.layer_matmul_params


def test_block_time_charges_block_visits_and_whole_block_reads():
    """Issue 34: the paged kernel's block-granular access (systems.BLOCK_COSTS["kernel"])."""
    from types import SimpleNamespace

    from pagedjax.simulator.simulate import block_work
    from pagedjax.simulator.systems import make_cost_model

    none = make_cost_model("A100-40GB", "opt-13b")
    kern = make_cost_model("A100-40GB", "opt-13b", block_cost="kernel")
    assert float(none.block_time(100, 50)) == 0.0  # the default charges nothing
    per_token = 819_200 / (kern.mem_efficiency * 1.555e12)
    one = float(kern.block_time(1, 0))
    assert one == pytest.approx(0.23 * 16 * per_token, rel=0.02)
    assert float(kern.block_time(1, 10)) == pytest.approx(one + 10 * per_token, rel=0.02)
    # A decode at position 20 (context 21) and a prefill chunk with prefix 32, one pad row.
    batch = SimpleNamespace(
        seq_ids=jnp.array([0, 1, -1]), q_lens=jnp.array([1, 8, 0]),
        start_pos=jnp.array([20, 32, 0]),
    )  # fmt: skip
    blocks, pad = block_work(batch, 16)
    assert (float(blocks), float(pad)) == (2 + 2, 11 + 0)
    blocks, pad = block_work(batch, 1)
    assert (float(blocks), float(pad)) == (21 + 32, 0)
    with pytest.raises(ValueError, match="block_cost"):
        make_cost_model(block_cost="fast")
