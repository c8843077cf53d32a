"""Tensor-parallel capacity table: per-device parameter and KV bytes at TP 1/2/4/8, the
largest KV pool one 80 GB device holds, the simulated step time with NVLink or PCIe, and
(``--step-time``) the measured CPU step-time ratio TP 2 / TP 1.

    python benchmarks/tp_capacity.py [--models llama-2-7b llama-3-70b] [--step-time]

Bytes come from the shardings, not by hand: the script sees 8 host CPU devices
(``--xla_force_host_platform_device_count=8``, set before JAX starts), builds the real
mesh and Megatron ``param_specs`` of ``pagedjax/model/sharding.py`` over the abstract
parameters (bf16, nothing allocated) and reads each array's per-device shard shape from
its ``NamedSharding``; the KV pool likewise (bf16 KV, one block of 16 tokens). "KV tokens
on 80 GB": (80e9 x 0.9 gpu_memory_utilization - parameter bytes) / KV bytes per token,
activations and workspace not counted (the engine profiles those at start-up), "-" when
the weights alone do not fit. The simulator's geometry (``pagedjax.simulator``) counts
the same bytes independently (matrices only, no norms): its figure is printed beside.

Simulated columns (labelled so): the roofline's decode step (64 sequences, 1,024-token
contexts) on H100-80GB with the TP all-reduces over NVLink or over PCIe 5.0.

``--step-time`` (CPU): decode steps of the ``tiny-llama-tp`` preset (random weights,
widened to ``--hidden``) at TP 1 and TP 2 on simulated host devices, timed in alternating
windows (median per engine). They
share the same cores, so the ratio measures the overhead of the sharded program
(collectives, shard_map), not a speed-up. The last line is ``kv_tokens_70b_tp8: <n>``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pagedjax.machine import cpu_model  # noqa: E402
from pagedjax.model import abstract_params, preset_arch  # noqa: E402
from pagedjax.model.kv_cache import kv_cache_shape  # noqa: E402
from pagedjax.model.sharding import make_layout, param_specs  # noqa: E402
from pagedjax.simulator.cost_model import model_geometry, roofline  # noqa: E402

DEVICE_BYTES = 80e9
UTILIZATION = 0.9
BLOCK = 16
GB = 1e9


def sharded_bytes(tree, specs, layout) -> int:
    """Bytes one device holds of ``tree`` (ShapeDtypeStructs) under ``specs``."""
    total = 0
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)), strict=True):
        shard = layout.sharding(spec).shard_shape(leaf.shape)
        total += int(np.prod(shard)) * jnp.dtype(leaf.dtype).itemsize
    return total  # fmt: skip


def capacity_rows(model: str) -> list[dict]:
    arch = preset_arch(model)
    params = abstract_params(arch, jnp.bfloat16)
    rows = []
    for tp in (1, 2, 4, 8):
        layout = make_layout(arch, tp)
        p_dev = sharded_bytes(params, param_specs(params, layout), layout)
        pool = kv_cache_shape(arch, 1, BLOCK)  # one block, every layer
        kv_block = 2 * int(np.prod(layout.kv_sharding.shard_shape(pool))) * 2  # K+V, bf16
        kv_tok = kv_block // BLOCK
        free = DEVICE_BYTES * UTILIZATION - p_dev
        geom = model_geometry(model, tp)
        sim = roofline("H100-80GB", geom)
        pcie = roofline("H100-80GB", geom, link="pcie")
        decode = dict(prefill_tokens=0, decode_seqs=64, kv_tokens=64 * 1024)
        rows.append(dict(
            model=model, tp=tp, params_gb=p_dev / GB, sim_params_gb=geom.weight_bytes_per_gpu / GB,
            kv_kib_per_token=kv_tok / 1024, sim_kv_kib=geom.kv_bytes_per_token_per_gpu / 1024,
            kv_tokens=int(free // kv_tok) if free > 0 else None,
            step_nvlink_ms=float(sim(**decode)) * 1e3, step_pcie_ms=float(pcie(**decode)) * 1e3,
            allreduce_nvlink_us=float(sim.allreduce_time(64)) * 1e6,
            allreduce_pcie_us=float(pcie.allreduce_time(64)) * 1e6,
        ))  # fmt: skip
    return rows


def print_capacity(rows: list[dict]) -> None:
    print(f"{'model':<12} {'TP':>2} {'params/dev GB':>13} {'(sim)':>7} {'KV KiB/tok':>10}"
          f" {'(sim)':>6} {'KV tokens on 80GB':>17} {'sim step NVLink ms':>18}"
          f" {'sim step PCIe ms':>16} {'sim AR(64) NVL/PCIe us':>22}")  # fmt: skip
    for r in rows:
        tokens = f"{r['kv_tokens']:,}" if r["kv_tokens"] is not None else "- (no fit)"
        print(f"{r['model']:<12} {r['tp']:>2} {r['params_gb']:>13.2f} {r['sim_params_gb']:>7.2f}"
              f" {r['kv_kib_per_token']:>10.1f} {r['sim_kv_kib']:>6.1f} {tokens:>17}"
              f" {r['step_nvlink_ms']:>18.2f} {r['step_pcie_ms']:>16.2f}"
              f" {r['allreduce_nvlink_us']:>10.1f}/{r['allreduce_pcie_us']:<10.1f}")  # fmt: skip


def decode_engine(tp: int, hidden: int, steps: int):
    """An engine at TP ``tp`` decoding 4 sequences (prefill and compilation done)."""
    import dataclasses

    from pagedjax.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from pagedjax.config import SchedulerConfig as SC
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.model import random_params
    from pagedjax.sampling import SamplingParams
    from pagedjax.tokenizer import ByteTokenizer

    arch = preset_arch("tiny-llama-tp")
    arch = dataclasses.replace(arch, hidden_size=hidden, head_dim=hidden // arch.num_heads,
                               intermediate_size=4 * hidden)  # fmt: skip
    cfg = EngineConfig(
        model=ModelConfig(model="tiny-llama-tp", max_model_len=1024),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=300),
        scheduler=SC(max_num_batched_tokens=64, max_num_seqs=4, num_multi_steps=1),
        parallel=ParallelConfig(tensor_parallel_size=tp), warmup="none",
    )  # fmt: skip
    eng = LLMEngine(arch, random_params(arch, 0, jnp.float32), ByteTokenizer(2, 1), cfg)
    p = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(4):
        eng.add_request(str(i), list(range(3, 35)), p)
    for _ in range(6):  # prefill + first decode steps (compilation)
        eng.step()
    return eng


def step_times(hidden: int, rounds: int, steps: int) -> tuple[float, float]:
    """Median seconds per decode step at TP 1 and TP 2: the two engines are timed in
    alternating windows of ``steps`` steps, so load changes on a shared box hit both."""
    engines = {tp: decode_engine(tp, hidden, rounds * steps) for tp in (1, 2)}
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(rounds):
        for tp, eng in engines.items():
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            times[tp].append((time.perf_counter() - t) / steps)
    return float(np.median(times[1])), float(np.median(times[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-2-7b", "llama-3-70b"])
    ap.add_argument("--step-time", action="store_true")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="decode steps per timing window")
    ap.add_argument("--rounds", type=int, default=7, help="alternating windows per engine")
    args = ap.parse_args()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()},"
          f" load {os.getloadavg()[0]:.2f}, jax {jax.__version__}, bf16 weights and KV,"
          f" {DEVICE_BYTES / GB:.0f} GB x {UTILIZATION} per device")  # fmt: skip
    rows = [r for m in args.models for r in capacity_rows(m)]
    print_capacity(rows)
    if args.step_time:
        t1, t2 = step_times(args.hidden, args.rounds, args.steps)
        print(f"CPU decode step (tiny-llama-tp widened to hidden {args.hidden}, 4 seqs, median"
              f" of {args.rounds} alternating windows):"
              f" TP1 {t1 * 1e3:.2f} ms, TP2 {t2 * 1e3:.2f} ms, ratio {t2 / t1:.2f}"
              f" (shared cores: overhead, not speed-up);"
              f" load {os.getloadavg()[0]:.2f}")  # fmt: skip
    last = [r for r in rows if r["tp"] == 8][-1]
    print(f"kv_tokens_{last['model'].split('-')[-1]}_tp8: {last['kv_tokens']}")


if __name__ == "__main__":
    main()
