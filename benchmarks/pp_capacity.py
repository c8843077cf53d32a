"""Pipeline x tensor parallel capacity table: per-device weights and KV at TP x PP splits of
8 and 16 devices for Llama-3-70B and a 405B-class shape (Llama-3.1-405B's), the largest
batch of 2,048-token requests one replica holds, simulated decode tokens/s and the bubble
with one batch in flight (pagedjax's default), with PP micro-batches per step (pagedjax's
``pipeline_microbatches`` = PP) and with PP batches in flight (vLLM's scheme), a 2,048-token
prefill step at M = 1 / PP, and (``--step-time``) the measured CPU decode step at PP 1 / 2
/ 4, M = 1 and M = PP, of a tiny model.

    python benchmarks/pp_capacity.py [--step-time]

Bytes come from the real shardings: the script sees 16 host CPU devices, builds the
pipeline mesh of ``pagedjax/model/pipeline.py`` (stages x TP) and its ``pipeline_specs``
over the abstract bf16 parameters laid out in stage slots (nothing allocated), and reads
each array's per-device shard shape; the KV pool likewise (K + V, bf16). "Batch":
(80e9 x 0.9 - the largest device's weights) / KV bytes per token per device / 2,048
(activations not counted). Simulated columns (``pagedjax/simulator/pipeline.py``, a
roofline model, not a measurement): decode steps over 1,024-token contexts of that batch
(at most 256 sequences), TP all-reduces over NVLink, stage-to-stage sends over NVLink
within 8 GPUs and over a 400 Gb/s inter-node link for 16 (two nodes: PP across them).
The last line is ``pp_bubble_1_in_flight_pp4: <share>``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from pagedjax.machine import cpu_model  # noqa: E402
from pagedjax.model import abstract_params, arch_from_hf_config, preset_arch  # noqa: E402
from pagedjax.model.pipeline import make_pipeline, pipeline_specs  # noqa: E402
from pagedjax.simulator.cost_model import ModelGeometry, model_geometry, roofline  # noqa: E402
from pagedjax.simulator.pipeline import microbatch_step, pipeline_step  # noqa: E402

DEVICE_BYTES, UTILIZATION, CONTEXT, GB = 80e9, 0.9, 2048, 1e9
# Llama-3.1-405B's shape (its config.json), for both the real shardings and the simulator.
L405 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
            hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
            num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=131072,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)  # fmt: skip
G405 = ModelGeometry("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, gated_mlp=True,
                     tied_embeddings=False)  # fmt: skip
SPLITS = [(8, 1), (4, 2), (2, 4), (8, 2), (4, 4)]  # (TP, PP): 8 and 16 devices


def _padded(params, layout):
    """ShapeDtypeStructs of ``params`` with the layer stacks in stage slots."""
    lay = jax.tree.map(lambda s: jax.ShapeDtypeStruct((layout.pool_layers, *s.shape[1:]),
                                                      s.dtype), params["layers"])  # fmt: skip
    return dict(params, layers=lay)


def per_device(tree, specs, mesh) -> int:
    """Bytes the most loaded device holds of ``tree`` under ``specs``."""
    out: dict[int, int] = {}
    specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for leaf, spec in zip(jax.tree.leaves(tree), specs, strict=True):
        sh = NamedSharding(mesh, spec)
        n = int(np.prod(sh.shard_shape(leaf.shape))) * jnp.dtype(leaf.dtype).itemsize
        for d in sh.device_set:
            out[d.id] = out.get(d.id, 0) + n
    return max(out.values())


def rows_for(name: str, arch, geom: ModelGeometry) -> list[dict]:
    params = abstract_params(arch, jnp.bfloat16)
    rows = []
    for tp, pp in SPLITS:
        layout = make_pipeline(arch, pp, tp)
        padded = _padded(params, layout)
        w = per_device(padded, pipeline_specs(padded, layout), layout.tp.mesh)
        pool = (layout.pool_layers, 1, arch.num_kv_heads, 1, arch.head_dim)  # one token
        kv_tok = 2 * int(np.prod(layout.kv_sharding.shard_shape(pool))) * 2  # K+V, bf16
        free = DEVICE_BYTES * UTILIZATION - w
        batch = int(free // kv_tok // CONTEXT) if free > 0 else 0
        row = dict(model=name, devices=tp * pp, tp=tp, pp=pp, weights_gb=w / GB,
                   sim_weights_gb=geom.with_tp(tp).weight_bytes_per_gpu / pp / GB,
                   kv_kib=kv_tok / 1024, batch=batch)  # fmt: skip
        seqs = min(batch, 256)
        if seqs:
            cost = roofline("H100-80GB", geom, tp=tp)
            link = "internode" if tp * pp > 8 else "nvlink"
            one = pipeline_step(cost, pp, 0, seqs, seqs * 1024, link)
            row["tok_s_1"] = seqs * one.throughput_steps_per_s(1)
            micro = max(seqs // pp, 1)  # PP batches in flight, each 1 / PP of the sequences
            many = pipeline_step(cost, pp, 0, micro, micro * 1024, link)
            row["tok_s_pp"] = micro * many.throughput_steps_per_s(pp)
            row["bubble_1"], row["bubble_pp"] = many.bubble(1), many.bubble(pp)
            built = microbatch_step(cost, pp, pp, 0, seqs, seqs * 1024, link)
            row["tok_s_mb"], row["bubble_mb"] = seqs / built.latency(), built.bubble()
            row["prefill_ms"] = [microbatch_step(cost, pp, m, CONTEXT, 0, CONTEXT, link)
                                 .latency() * 1e3 for m in (1, pp)]  # fmt: skip
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print("| model | devices | TP x PP | weights / device GB (sim) | KV KiB / token / device"
          " | batch of 2k-token requests | sim tok/s, 1 batch in flight | sim tok/s, M = PP"
          " micro-batches | sim tok/s, PP in flight (vLLM) | bubble 1 / M = PP / vLLM"
          " | sim 2k prefill step ms, M = 1 / PP |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sim = (f"{r['tok_s_1']:,.0f} | {r['tok_s_mb']:,.0f} | {r['tok_s_pp']:,.0f} |"
               f" {r['bubble_1']:.2f} / {r['bubble_mb']:.2f} / {r['bubble_pp']:.2f} |"
               f" {r['prefill_ms'][0]:.1f} / {r['prefill_ms'][1]:.1f}"
               if "tok_s_1" in r else "- | - | - | - | -")  # fmt: skip
        batch = f"{r['batch']:,}" if r["batch"] else "weights do not fit"
        print(f"| {r['model']} | {r['devices']} | {r['tp']} x {r['pp']} |"
              f" {r['weights_gb']:.2f} ({r['sim_weights_gb']:.2f}) | {r['kv_kib']:.0f} |"
              f" {batch} | {sim} |")  # fmt: skip


def step_times(rounds: int, steps: int) -> dict[tuple[int, int], float]:
    """Median seconds per decode step (4 sequences) of a 4-layer tiny Llama at (PP, M) =
    (1, 1), (2, 1), (2, 2), (4, 1), (4, 4) (M: pipeline_microbatches) on simulated host
    devices, timed in alternating windows of ``steps`` steps."""
    from pagedjax.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from pagedjax.config import SchedulerConfig as SC
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.model import random_params
    from pagedjax.sampling import SamplingParams
    from pagedjax.tokenizer import ByteTokenizer

    arch = dataclasses.replace(preset_arch("tiny-llama-tp"), num_layers=4,
                               layer_windows=(None,) * 4)  # fmt: skip
    params = random_params(arch, 0, jnp.float32)
    engines = {}
    for pp, mb in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 4)):
        cfg = EngineConfig(
            model=ModelConfig(model="tiny-llama-tp", max_model_len=1024),
            cache=CacheConfig(block_size=16, num_gpu_blocks_override=300),
            scheduler=SC(max_num_batched_tokens=64, max_num_seqs=4, num_multi_steps=1),
            parallel=ParallelConfig(pipeline_parallel_size=pp, pipeline_microbatches=mb),
            warmup="none",
        )  # fmt: skip
        eng = LLMEngine(arch, params, ByteTokenizer(2, 1), cfg)
        p = SamplingParams(temperature=0.0, max_tokens=rounds * steps + 16, ignore_eos=True)
        for i in range(4):
            eng.add_request(str(i), list(range(3, 35)), p)
        for _ in range(6):  # prefill and the first decode steps (compilation)
            eng.step()
        engines[pp, mb] = eng
    times: dict[tuple[int, int], list[float]] = {key: [] for key in engines}
    for _ in range(rounds):
        for key, eng in engines.items():
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            times[key].append((time.perf_counter() - t) / steps)
    return {key: float(np.median(v)) for key, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step-time", action="store_true")
    ap.add_argument("--steps", type=int, default=10, help="decode steps per timing window")
    ap.add_argument("--rounds", type=int, default=5, help="alternating windows per engine")
    args = ap.parse_args()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()},"
          f" load {os.getloadavg()[0]:.2f}, jax {jax.__version__}, bf16 weights and KV,"
          f" {DEVICE_BYTES / GB:.0f} GB x {UTILIZATION} per device")  # fmt: skip
    rows = rows_for("Llama-3-70B", preset_arch("llama-3-70b"), model_geometry("llama-3-70b"))
    rows += rows_for("405B-class", arch_from_hf_config(L405), G405)
    print_rows(rows)
    if args.step_time:
        t = step_times(args.rounds, args.steps)
        print(f"CPU decode step (4-layer tiny Llama, 4 seqs, median of {args.rounds} alternating"
              f" windows): " + ", ".join(f"PP {pp} M {mb} {s * 1e3:.2f} ms"
                                         for (pp, mb), s in t.items())
              + f" (shared cores: overhead, not speed-up);"
              f" load {os.getloadavg()[0]:.2f}")  # fmt: skip
    pp4 = next(r for r in rows if r["pp"] == 4 and "bubble_1" in r)
    print(f"pp_bubble_1_in_flight_pp4: {pp4['bubble_1']:.2f}")


if __name__ == "__main__":
    main()
