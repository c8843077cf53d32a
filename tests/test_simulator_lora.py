"""The simulated multi-LoRA server (pagedjax/simulator/lora.py), its trace
(pagedjax/workloads/adapters.py) and experiment (experiments/lora.py); docs/lora.md,
"Simulated: S-LoRA at paper scale"."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.simulator.cost_model import model_geometry, roofline
from pagedjax.simulator.lora import AdapterSpec, LoRASimConfig, LoRAStepCost, simulate_lora
from pagedjax.workloads.adapters import slora_workload, zipf_popularity

GIB = 1 << 30
CM = roofline("A100-80GB", "llama-2-7b")
GEOM = CM.model


def _link_s(nbytes: float) -> float:
    """One adapter's copy time as the cost model's swap numbers give it."""
    bw = CM.gpu.host_link_bytes_per_s * CM.host_link_efficiency
    return nbytes / bw + GEOM.num_layers * CM.copy_latency_s


def test_adapter_bytes_hand_count_and_refusals():
    # Llama-7B, q/k/v/o, rank 8, fp16: 8 matrices of 4096 x 8 per layer, 32 layers.
    assert AdapterSpec((8,)).adapter_bytes(GEOM, 0) == 8 * 4096 * 8 * 32 * 2 == 16 << 20
    spec = AdapterSpec((64, 8), ("q_proj", "down_proj"))
    assert spec.rank(0) == 64 and spec.rank(3) == 8
    assert spec.adapter_bytes(GEOM, 1) == 32 * 8 * ((4096 + 4096) + (11008 + 4096)) * 2
    with pytest.raises(ValueError, match="gate_proj"):  # OPT has no gated MLP
        AdapterSpec((8,), ("gate_proj",)).adapter_bytes(model_geometry("opt-13b"), 0)
    with pytest.raises(ValueError, match="unknown target module"):
        AdapterSpec((8,), ("lm_head",))
    with pytest.raises(ValueError, match="ranks"):
        AdapterSpec(())
    with pytest.raises(ValueError, match="memory"):
        LoRASimConfig(GIB, memory="shared")
    with pytest.raises(ValueError, match="no KV block"):
        simulate_lora(slora_workload(8, 1.0, 4), CM, AdapterSpec((64,)),
                      LoRASimConfig(GIB, "separate", max_loras=16))  # fmt: skip


def test_zipf_trace_shares_lengths_and_arrivals_across_adapter_counts():
    p = zipf_popularity(5, 1.0)
    assert p.sum() == pytest.approx(1.0) and np.all(np.diff(p) < 0)
    assert np.allclose(zipf_popularity(4, 0.0), 0.25)
    a, b = slora_workload(300, 5.0, 10, seed=3), slora_workload(300, 5.0, 1000, seed=3)
    assert np.array_equal(a.requests.prompt_len, b.requests.prompt_len)
    assert np.array_equal(a.requests.arrival_time, b.requests.arrival_time)
    assert a.requests.prompt_len.min() >= 8 and a.requests.output_len.max() <= 512
    assert a.adapter.max() < 10 and np.all(slora_workload(5, 1.0, 0).adapter == -1)
    # Zipf(1) over 10: adapter 0 takes 1 / H_10 = 34 % of the requests.
    assert 0.27 < np.mean(a.adapter == 0) < 0.41


def test_delta_cost_adds_to_the_roofline_terms():
    cost = LoRAStepCost.from_roofline(CM)
    base = float(cost(0.0, 64, 64 * 500))
    assert base == pytest.approx(float(CM(0.0, 64, 64 * 500)), rel=1e-6)
    nbytes = 16 << 20  # one rank-8 adapter read once
    with_lora = float(cost(0.0, 64, 64 * 500, lora_bytes=nbytes, lora_flops=2 * 64 * 8e6))
    # A decode step is memory-bound: the bytes add at the effective bandwidth.
    assert with_lora - base == pytest.approx(nbytes / (0.85 * CM.gpu.hbm_bytes_per_s), rel=1e-3)


def test_unified_one_adapter_equals_the_base_within_the_delta_cost():
    """Same trace, a pool that never binds (max_num_seqs does): the schedule is the base
    model's step for step, and the makespan grows by at most every step's delta bound
    (one adapter's bytes at HBM speed + its FLOPs) plus the one load."""
    w0 = slora_workload(200, float("inf"), 0, seed=1)
    w1 = slora_workload(200, float("inf"), 1, seed=1)
    spec = AdapterSpec((16,))
    conf = LoRASimConfig(60 * GIB, "unified", max_num_seqs=32, load="sync")
    r0, r1 = simulate_lora(w0, CM, spec, conf), simulate_lora(w1, CM, spec, conf)
    assert r1.steps == r0.steps and r1.max_batch == r0.max_batch == 32
    nbytes = spec.adapter_bytes(GEOM, 0)
    tokens = int(w1.requests.prompt_len.sum() + w1.requests.output_len.sum())
    bound = (r1.steps * nbytes / (CM.mem_efficiency * CM.gpu.hbm_bytes_per_s)
             + 2 * tokens * (nbytes / 2) / (CM.flop_efficiency * CM.gpu.peak_flops)
             + _link_s(nbytes))  # fmt: skip
    extra = r1.makespan_s - r0.makespan_s
    assert 0 < extra <= bound * (1 + 1e-6)
    assert r1.loads == 1 and r1.load_s == pytest.approx(_link_s(nbytes))


@pytest.mark.parametrize("memory", ["unified", "separate"])
def test_loading_is_counted_once_per_activation(memory):
    w = slora_workload(300, 20.0, 12, seed=2)
    spec = AdapterSpec((8, 64))
    distinct = sorted(set(w.adapter.tolist()))
    # Room for every adapter: each is loaded once, never evicted, whatever reuses it.
    roomy = LoRASimConfig(40 * GIB, memory, max_loras=12)
    r = simulate_lora(w, CM, spec, roomy)
    assert r.loads == len(distinct) and r.evictions == 0
    want = sum(_link_s(spec.adapter_bytes(GEOM, a)) for a in distinct)
    assert r.load_s == pytest.approx(want)
    assert r.load_bytes == sum(spec.adapter_bytes(GEOM, a) for a in distinct)
    # Tight: reloads happen, but only after an eviction (loads - evictions = resident).
    tight = LoRASimConfig(40 * GIB if memory == "separate" else 2.2 * GIB, memory, max_loras=2)
    r2 = simulate_lora(w, CM, spec, tight)
    resident_at_end = r2.loads - r2.evictions
    assert r2.loads > len(distinct) and r2.evictions > 0
    assert 1 <= resident_at_end <= (2 if memory == "separate" else len(distinct))
    assert np.all(np.isfinite(r2.finish_s))


def test_separate_pools_lose_throughput_as_adapters_grow_and_unified_does_not():
    """Same requests, more adapters: separate pools (4 slots) never gain throughput;
    unified memory keeps within a few % of one adapter."""
    spec = AdapterSpec((16,))
    sep, uni = [], []
    for n in (1, 4, 16, 64, 256):
        w = slora_workload(240, float("inf"), n, seed=4)
        sep.append(simulate_lora(w, CM, spec, LoRASimConfig(20 * GIB, "separate", 4)).summary())
        uni.append(simulate_lora(w, CM, spec, LoRASimConfig(20 * GIB, "unified")).summary())
    tput = [s["requests_per_s"] for s in sep]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(tput, tput[1:], strict=False)), tput
    assert tput[-1] < 0.8 * tput[0]  # 256 adapters through 4 slots: mostly waiting
    assert uni[-1]["requests_per_s"] > 0.9 * uni[0]["requests_per_s"]
    assert uni[-1]["requests_per_s"] > tput[-1]
    assert sep[-1]["skips"] > 0 == sep[0]["skips"]


def test_separate_pool_is_carved_out_of_the_budget_and_gathered_costs_more():
    w = slora_workload(100, float("inf"), 8, seed=5)
    spec = AdapterSpec((64, 8))
    block_bytes = 16 * GEOM.kv_bytes_per_token_per_gpu
    r = simulate_lora(w, CM, spec, LoRASimConfig(10 * GIB, "separate", max_loras=8))
    assert r.kv_blocks == int((10 * GIB - 8 * spec.adapter_bytes(GEOM, 0)) // block_bytes)
    u = simulate_lora(w, CM, spec, LoRASimConfig(10 * GIB, "unified"))
    assert u.kv_blocks == int(10 * GIB // block_bytes)
    g = simulate_lora(w, CM, spec, LoRASimConfig(10 * GIB, "unified", kernel="gathered"))
    assert g.makespan_s > u.makespan_s


def test_experiment_runs_small_and_reads_its_claims(tmp_path):
    from experiments import lora
    from experiments.claims import claims
    from experiments.config import ExperimentConfig, LoraSettings
    from pagedjax.config import ConfigError

    s = LoraSettings(
        budget_gib=20, rank_sets={"S1": [8], "S2": [64, 32, 16, 8]},
        num_adapters=[0, 5, 2000], separate_max_loras=[4], num_requests=80,
    )  # fmt: skip
    cfg = ExperimentConfig(experiments=["lora"], lora=s)
    summary = lora.run(cfg, tmp_path, lambda it, **_: it)
    per = summary["rank_sets"]["S2"]
    assert per["unified"]["0"] == per["separate_4"]["0"]  # the base model, once
    assert 0 < per["unified_2000_over_5"] <= 1.0
    assert per["separate_4"]["2000"]["requests_per_s"] < per["unified"]["2000"]["requests_per_s"]
    rows = claims({"lora": summary}, cfg)
    assert {r["key"] for r in rows} == {"lora.S1.2000/5", "lora.S2.2000/5"}
    assert (tmp_path / "lora.csv").exists() and (tmp_path / "lora.png").exists()
    assert lora.table(summary)
    with pytest.raises(ConfigError, match="lora.rank_sets.x"):
        LoraSettings(rank_sets={"x": [0]})
    with pytest.raises(ConfigError, match="lora.input_range"):
        LoraSettings(input_range=[9, 8])
