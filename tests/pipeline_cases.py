"""Pipeline-parallel cases, run as a script in a subprocess that sees 8 host CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``; tests/test_pipeline.py; the
device count must be fixed before JAX starts, as in tests/parallel_cases.py).

``python tests/pipeline_cases.py CASE [CASE ...]`` runs each case, asserts inside it, and
prints one JSON line ``{"case": ..., ...facts}`` per case.

The model is a tiny Llama from a transformers ``LlamaConfig``-shaped config (8 query / 2 KV
heads, vocabulary 512, hidden 64) with 4 layers (3 for the uneven splits), random fp32
weights.

- ``forward-pp2``: the model function alone (no engine): a prefill of two sequences and
  a decode step over it, PP 2 on 2 devices, equal one device's logits (fp32 rounding)
  and KV pool (every model layer's pages, read from its stage's slot); bytes per device
  from the arrays' addressable shards equal a count made here from the unsharded
  parameters (layers / PP, embedding and head / PP, the final norm whole) and are about
  1 / PP of one device's; the Pallas backend is refused under PP by name.
  ``forward-pp2-opt`` / ``forward-pp2-gpt_neox``: the same for a 2-layer OPT and GPT-NeoX
  (the other families on the layer loop). A ``-mb<B>`` suffix: B pipeline micro-batches
  (at B = 2 the prefill's first sequence, 5 tokens, is cut 4 + 1 between them).
- ``engine-pp<N>[-tp<M>][-k<K>][-part<a_b>][-layers<L>][-mb<B>]``: tests/parallel_cases.py's
  mixed workload (chunked prefill, decode, preemption by recompute and by swap, a prefix
  hit, n = 2 seeded samples, then beam search) on an engine at PP N (x TP M, K-step decode
  loop K, layer partition a,b, B pipeline micro-batches) equals the same engine
  configuration on one device token for token; the pool keeps its stage sharding; nothing
  recompiles.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections import defaultdict

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PAGEDJAX_WARMUP", "none")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pagedjax.attention import PAD_SLOT  # noqa: E402
from pagedjax.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedjax.engine.llm_engine import LLMEngine  # noqa: E402
from pagedjax.engine.parallel import DevicePlacement  # noqa: E402
from pagedjax.model import (  # noqa: E402
    ModelInput,
    abstract_params,
    arch_from_hf_config,
    forward,
    preset_arch,
)
from pagedjax.model.pipeline import (  # noqa: E402
    make_pipeline,
    place_params,
)
from pagedjax.tokenizer import ByteTokenizer  # noqa: E402
from tests.parallel_cases import (  # noqa: E402
    BLOCK,
    BUDGET,
    MAX_LEN,
    MAX_SEQS,
    NUM_BLOCKS,
    beams,
    drain,
    workload,
)


@functools.cache
def tiny_llama(layers: int):
    """(arch, fp32 params): the config transformers' ``LlamaConfig`` writes (its keys, as
    a dict: importing transformers costs seconds), random weights drawn with numpy (std
    0.15: greedy choices are rarely near-ties, as parallel_cases.py; norms 1; a jitted
    ``random_params`` compiles for ~10 s on the loaded 2-core box)."""
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512,
               hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
               hidden_act="silu", rope_theta=10000.0)  # fmt: skip
    return numpy_params(arch_from_hf_config(cfg))


def numpy_params(arch):
    """(arch, fp32 params) drawn with numpy: normal(0.15) matrices and embeddings, norm
    gains 1 (RMSNorm "weight", LayerNorm "scale"), biases 0."""
    rng = np.random.default_rng(0)

    def draw(path, s):
        name = str(getattr(path[-1], "key", ""))
        if name in ("weight", "scale"):
            return jnp.ones(s.shape, jnp.float32)
        if name == "bias":
            return jnp.zeros(s.shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, 0.15, s.shape), jnp.float32)

    return arch, jax.tree_util.tree_map_with_path(draw, abstract_params(arch))


@functools.cache
def family_model(family: str):
    """A 2-layer OPT (8 heads: biases, learned positions) or GPT-NeoX (3 heads, partial
    rotary, parallel residual; tests/model_helpers.py's config) with numpy weights."""
    if family == "opt":
        return numpy_params(preset_arch("tiny-opt-tp"))
    from tests.model_helpers import TINY_HF_CONFIGS

    cfg = dict(TINY_HF_CONFIGS["gpt_neox"][1], model_type="gpt_neox",
               architectures=["GPTNeoXForCausalLM"])  # fmt: skip
    return numpy_params(arch_from_hf_config(cfg))


def shard_bytes(tree) -> dict[int, int]:
    """Bytes each device holds of ``tree``'s arrays, from the buffers themselves
    (``addressable_shards``), not from the shardings' arithmetic."""
    out: dict[int, int] = defaultdict(int)
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device.id] += shard.data.nbytes
    return dict(out)


def _batches(vocab: int) -> list[ModelInput]:
    """A prefill of two sequences (5 tokens in blocks 1, 2; 3 tokens in block 3), then one
    decode token each, both padded to 8 tokens."""
    rng = np.random.default_rng(0)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    prefill = ModelInput(
        tokens=i32(list(rng.integers(3, vocab, 8))),
        positions=i32([0, 1, 2, 3, 4, 0, 1, 2]),
        slot_mapping=i32([4, 5, 6, 7, 8, 12, 13, 14]),
        block_tables=i32([[1, 2], [3, 0]]),
        kv_lens=i32([5, 3]),
        cu_q_lens=i32([0, 5, 8]),
        logits_indices=i32([4, 7]),
    )
    pad = [PAD_SLOT] * 6  # the same 8-token shape: one compilation per forward
    decode = ModelInput(
        tokens=i32(list(rng.integers(3, vocab, 8))),
        positions=i32([5, 3, 0, 0, 0, 0, 0, 0]),
        slot_mapping=i32([9, 15, *pad]),
        block_tables=i32([[1, 2], [3, 0]]),
        kv_lens=i32([6, 4]),
        cu_q_lens=i32([0, 1, 2]),
        logits_indices=i32([0, 1]),
    )
    return [prefill, decode]


def case_forward(pp: int, family: str = "llama", mb: int = 1) -> dict:
    arch, params = tiny_llama(4) if family == "llama" else family_model(family)
    layout = make_pipeline(arch, pp, microbatches=mb)
    shape = (arch.num_layers, 4, arch.num_kv_heads, BLOCK, arch.head_dim)
    one_kv = (jnp.zeros(shape), jnp.zeros(shape))
    pp_kv = tuple(jax.device_put(jnp.zeros((layout.pool_layers, *shape[1:])),
                                 layout.kv_sharding) for _ in range(2))  # fmt: skip
    pp_params = place_params(params, layout)
    one = jax.jit(functools.partial(forward, arch=arch))
    many = jax.jit(functools.partial(forward, arch=arch, layer_stack=layout.stack()))
    diffs = []
    for batch in _batches(arch.vocab_size):
        one_kv, want = one(params, one_kv, batch)
        pp_kv, got = many(pp_params, pp_kv, batch)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        diffs.append(float(np.max(np.abs(np.asarray(got) - np.asarray(want)))))
    slots = layout.slot_layers
    for a, b in zip(one_kv, pp_kv, strict=True):
        b = np.asarray(b)
        for slot, layer in enumerate(slots):
            if layer >= 0:
                np.testing.assert_allclose(b[slot], np.asarray(a)[layer], rtol=1e-5, atol=1e-6)
    assert pp_kv[0].sharding.is_equivalent_to(layout.kv_sharding, 5)
    # Bytes per device, counted here from the unsharded tree: each layer leaf split over
    # the stages, the embedding and the LM head over every device, the final norm whole.
    expected = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(k, "key", k)) for k in path]
        vocab = names[0] in ("embed_tokens", "lm_head", "embed_in", "embed_out")
        if names[0] == "layers" or (vocab and arch.vocab_size % pp == 0):
            expected += leaf.nbytes // pp
        else:
            expected += leaf.nbytes
    got_params, got_kv = shard_bytes(pp_params), shard_bytes(pp_kv)
    assert sorted(got_params) == list(range(pp)), got_params
    assert all(b == expected for b in got_params.values()), (got_params, expected)
    one_total = sum(x.nbytes for x in jax.tree.leaves(params)) + 2 * one_kv[0].nbytes
    assert all(b * pp == 2 * one_kv[0].nbytes for b in got_kv.values()), got_kv
    worst = max(got_params[d] + got_kv[d] for d in got_params)
    ratio = worst / one_total
    if family == "llama":
        assert abs(ratio - 1 / pp) < 0.01, ratio  # only the final norm is replicated
    # The GPU kernels are refused under PP (never run inside the ring), by name.
    place = DevicePlacement(arch, 1, pp=pp)
    place.check_attention_backend("native_cpu")
    # "auto" stays on a CPU (native_cpu / reference); explicit names pass through
    assert place.backend_request("auto") == "auto" and place.backend_request("pallas") == "pallas"
    try:
        place.check_attention_backend("pallas")
    except ValueError as e:
        assert f"attention_backend='pallas' with pipeline_parallel_size={pp}" in str(e), e
    else:
        raise AssertionError("pallas accepted under PP")
    return dict(max_logit_diff=max(diffs), params_per_device=expected,
                kv_per_device=got_kv[0], one_device_total=one_total, ratio=ratio)  # fmt: skip


def config(pp: int, tp: int, k: int, partition, swap_space: float = 0.01,
           mb: int = 1) -> EngineConfig:  # fmt: skip
    return EngineConfig(
        model=ModelConfig(model="tiny-llama-pp", max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                          enable_prefix_caching=True, swap_space=swap_space),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
                                  watermark=0.0, num_multi_steps=k),
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                pipeline_layer_partition=partition,
                                pipeline_microbatches=mb),
    )  # fmt: skip


def engine(layers: int, pp: int, tp: int = 1, k: int = 1, partition=None,
           swap_space: float = 0.01, mb: int = 1) -> LLMEngine:  # fmt: skip
    arch, params = tiny_llama(layers)
    tok = ByteTokenizer(eos_token_id=arch.eos_token_id, bos_token_id=arch.bos_token_id)
    # NaN pages: a read of a slot a sequence does not own poisons its logits.
    return LLMEngine(arch, params, tok, config(pp, tp, k, partition, swap_space, mb),
                     kv_fill_value=float("nan"))  # fmt: skip


@functools.cache
def reference(layers: int, k: int) -> tuple[dict, list, dict]:
    """One device's outputs of the workload and of beam search, and the counters that show
    the workload exercised what it is meant to."""
    eng = engine(layers, 1, k=k)
    vocab = eng.arch.vocab_size
    outs, _ = drain(eng, workload(vocab))
    stats = eng.stats()
    facts = {key: stats[key] for key in ("preemptions_recompute", "preemptions_swap",
                                         "prefix_cache_hit_tokens", "forked_samples")}  # fmt: skip
    assert all(v > 0 for v in facts.values()), facts
    return outs, beams(eng, vocab), facts


def case_engine(pp: int, tp: int, k: int, partition, layers: int, mb: int = 1) -> dict:
    ref_outs, ref_beams, facts = reference(layers, k)
    eng = engine(layers, pp, tp, k, partition, mb=mb)
    outs, _ = drain(eng, workload(eng.arch.vocab_size))
    for rid in ref_outs:
        assert outs[rid] == ref_outs[rid], f"{rid}: PP {pp} {outs[rid]} vs 1 {ref_outs[rid]}"
    got_beams = beams(eng, eng.arch.vocab_size)
    assert got_beams == ref_beams, f"beams: PP {pp} {got_beams} vs one device {ref_beams}"
    pipe = eng.placement.pipeline
    for p in eng.kv:
        assert p.sharding.is_equivalent_to(pipe.kv_sharding, p.ndim), p.sharding
    traces = {f"{key}": c for key, c in eng.runner.trace_count.items()}
    assert all(c == 1 for c in traces.values()), f"recompiled: {traces}"
    kv = shard_bytes(eng.kv)
    assert len(kv) == pp * tp, kv
    return dict(facts, ranges=pipe.ranges, attention_backend=eng.attention_backend,
                microbatches=eng.runner.layer_stack.microbatches,
                kv_per_device=max(kv.values()), kv_total=sum(p.nbytes for p in eng.kv),
                params_per_device=max(shard_bytes(eng.params).values()),
                multi_step_loops=eng.stats().get("multi_step_loops", None))  # fmt: skip


def run(name: str) -> dict:
    if name.startswith("forward-pp"):  # forward-pp2, forward-pp2-opt, forward-pp2-gpt_neox-mb2
        pp, *rest = name.removeprefix("forward-pp").split("-")
        mb = [int(p.removeprefix("mb")) for p in rest if p.startswith("mb")]
        family = [p for p in rest if not p.startswith("mb")]
        return case_forward(int(pp), *family, mb=mb[0] if mb else 1)
    if name.startswith("engine-"):
        opts = dict(pp=1, tp=1, k=1, partition=None, layers=4, mb=1)
        for part in name.split("-")[1:]:
            for key in ("layers", "part", "pp", "tp", "k", "mb"):
                if part.startswith(key):
                    value = part.removeprefix(key)
                    opts[{"part": "partition"}.get(key, key)] = (
                        tuple(int(n) for n in value.split("_")) if key == "part" else int(value))
                    break
            else:
                raise ValueError(f"unknown option {part!r} in {name!r}")
        return case_engine(**opts)
    raise ValueError(f"unknown case {name!r}")


if __name__ == "__main__":
    import time

    for case in sys.argv[1:]:
        t = time.perf_counter()
        facts = run(case)
        facts["seconds"] = round(time.perf_counter() - t, 1)
        print(json.dumps({"case": case, **facts}, default=str), flush=True)
