"""Multi-LoRA end to end (docs/lora.md): the engine's adapter slots, prefix caching keyed
by adapter, ``LLM(enable_lora=True).generate(..., lora_request=...)`` against
transformers + peft, slot pressure, refusals, and the server serving an adapter by name.

Default tier: the LoRAManager's slot decisions (a Hypothesis state walk against a plain
model of LRU-with-pins), salted block hashes, the prefix hint's one-hash-per-block rule,
the config / CLI refusals. Tier 2: a tiny random ``LlamaForCausalLM`` (transformers) with
two random PEFT adapters written by peft, through the real engine and server.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.config import ConfigError, LoRAConfig
from pagedjax.engine.block_hashes import extend_hashes
from pagedjax.engine.lora_manager import LoRAManager
from pagedjax.lora import LORA_SEQ_SLOTS, LoRARequest, llama_module_shapes
from pagedjax.memory.prefix_cache import PrefixIndex, chain_hashes
from tests.engine_helpers import serve_in_thread

ARCH = SimpleNamespace(family="llama", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                       hidden_size=8, intermediate_size=12, num_experts=0)  # fmt: skip


def write_adapter(directory, r, seed, modules=("q_proj", "v_proj", "down_proj"), arch=ARCH):
    """A PEFT-layout adapter for ``arch`` written with numpy; its A weights by module."""
    from safetensors.numpy import save_file

    shapes = llama_module_shapes(arch)
    rng = np.random.default_rng(seed)
    tensors, want = {}, {}
    for m in modules:
        d_in, d_out = shapes[m]
        group = "mlp" if m.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
        a = rng.normal(size=(arch.num_layers, r, d_in)).astype(np.float32)
        b = rng.normal(size=(arch.num_layers, d_out, r)).astype(np.float32)
        for i in range(arch.num_layers):
            key = f"base_model.model.model.layers.{i}.{group}.{m}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a[i], b[i]
        want[m] = a.transpose(0, 2, 1)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    cfg = dict(peft_type="LORA", r=r, lora_alpha=2 * r, target_modules=list(modules))
    (directory / "adapter_config.json").write_text(json.dumps(cfg))
    return want


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Four small hand-written adapters (ids 1..4) for the manager's tests."""
    d = tmp_path_factory.mktemp("lora_manager")
    reqs, want = [], {}
    for i in range(1, 5):
        want[i] = write_adapter(d / f"a{i}", r=1 + i % 3, seed=i)
        reqs.append(LoRARequest(f"a{i}", i, str(d / f"a{i}")))
    return reqs, want, d


def _manager(max_loras, max_cpu_loras=None, max_seqs=4):
    base = {"layers": {"self_attn": {m: {} for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
                       "mlp": {m: {} for m in ("gate_proj", "up_proj", "down_proj")}}}  # fmt: skip
    cfg = LoRAConfig(max_loras=max_loras, max_lora_rank=4, max_cpu_loras=max_cpu_loras,
                     memory="static")  # the slot table (unified paging: test_lora_paging.py)
    return LoRAManager(cfg, ARCH, base, max_seqs)


# --------------------------------------------------------------- manager (default tier)


@settings(max_examples=20)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "finish"]), st.integers(0, 3)),
                    max_size=24))  # fmt: skip
def test_manager_lru_with_pins_matches_a_plain_model(adapters, ops):
    """Admissions of 4 adapters into 2 slots, requests finishing in any order: the manager
    admits exactly when a plain LRU-with-pins model does, evicts the model's victim, and
    every slot holds its adapter's weights (zero-padded to max_lora_rank)."""
    reqs, want, _ = adapters
    mgr = _manager(max_loras=2, max_cpu_loras=4)
    for r in reqs:
        mgr.prepare(r)
    resident: list[int] = []  # the model: LRU order, least recent first
    running: list[int] = []  # adapter ids of admitted, unfinished requests
    for op, k in ops:
        i = reqs[k].lora_int_id
        if op == "finish":
            if i in running:
                running.remove(i)
            continue
        free = [v for v in resident if v not in running]
        expect = i in resident or len(resident) < 2 or bool(free)
        assert mgr.admit(reqs[k], running) == expect
        if not expect:
            continue
        if i in resident:
            resident.remove(i)
        elif len(resident) == 2:
            resident.remove(free[0])
        resident.append(i)
        running.append(i)
        assert list(mgr.resident) == resident
    for i in resident:
        slot = mgr.table.slot_of(i)
        q = np.asarray(mgr.table.a["q_proj"])[:, slot]
        r = want[i]["q_proj"].shape[-1]
        np.testing.assert_array_equal(q[..., :r], want[i]["q_proj"])
        assert not q[..., r:].any()
        assert not np.asarray(mgr.table.a["k_proj"])[:, slot].any()  # not targeted


def test_manager_binds_slots_and_refuses_bad_adapters(adapters, tmp_path):
    reqs, _, d = adapters
    mgr = _manager(max_loras=1, max_cpu_loras=2)
    mgr.prepare(reqs[0])
    assert mgr.admit(reqs[0], []) and mgr.admit(None, [1])
    mgr.bind(2, reqs[0])
    mgr.bind(3, None)
    params = mgr.params()
    np.testing.assert_array_equal(params[LORA_SEQ_SLOTS], [0, 0, 1, 0])
    assert params["layers"]["self_attn"]["q_proj"]["lora_a"].shape == (2, 2, 8, 4)
    mgr.prepare(reqs[1])
    assert not mgr.admit(reqs[1], [1])  # the only slot's adapter is running: wait
    assert mgr.admit(reqs[1], []) and mgr.stats() == dict(
        lora_loads=2, lora_evictions=1, lora_waits=1, lora_resident=1, lora_blocks=0,
        lora_reliefs=0)  # fmt: skip
    # Host memory: the LRU beyond max_cpu_loras goes, unless a live request needs it.
    mgr.prepare(reqs[2], live_ids=[1])
    assert list(mgr.host) == [1, 3]
    with pytest.raises(ValueError, match="one id per adapter"):
        mgr.prepare(LoRARequest("other", 1, str(d / "a2")))
    with pytest.raises(ValueError, match="missing adapter_config.json"):
        mgr.prepare(LoRARequest("nope", 9, str(tmp_path / "nope")))
    write_adapter(tmp_path / "big", r=8, seed=0)
    with pytest.raises(ValueError, match="rank 8 exceeds max_lora_rank=4"):
        mgr.prepare(LoRARequest("big", 9, str(tmp_path / "big")))
    write_adapter(tmp_path / "emb", r=2, seed=0, modules=("q_proj",))
    cfg = json.loads((tmp_path / "emb" / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "embed_tokens"]
    (tmp_path / "emb" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="embed_tokens"):
        mgr.prepare(LoRARequest("emb", 9, str(tmp_path / "emb")))
    assert list(mgr.host) == [1, 3]  # refusals changed nothing
    with pytest.raises(ValueError, match="Llama family"):
        LoRAManager(LoRAConfig(), SimpleNamespace(family="opt"), {}, 4)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "finish", "remove"]), st.integers(0, 2)),
                    max_size=24))  # fmt: skip
def test_manager_removals_never_touch_a_running_adapter(adapters, ops):
    """Walks of add (prepare + admit, as add_request then admission), finish (then the
    next admission pass's release) and remove over three adapters and two slots, against
    a model: an adapter a running request uses stays resident with its own weights
    whatever is removed; a removed adapter no request uses is held nowhere."""
    reqs, want, _ = adapters
    mgr = _manager(max_loras=2, max_cpu_loras=4)
    running: list[int] = []
    removed: set[int] = set()  # the model: removed and not named again
    for op, k in ops:
        i = reqs[k].lora_int_id
        if op == "add":
            mgr.prepare(reqs[k], running)
            removed.discard(i)
            if mgr.admit(reqs[k], running):
                running.append(i)
        elif op == "finish":
            if i in running:
                running.remove(i)
            mgr.release_retired(running)
        else:
            mgr.remove(i, running)
            removed.add(i)
        for j in running:
            slot = mgr.table.slot_of(j)
            q = np.asarray(mgr.table.a["q_proj"])[:, slot]
            np.testing.assert_array_equal(q[..., : want[j]["q_proj"].shape[-1]], want[j]["q_proj"])
        gone = removed - set(running)
        assert not gone & mgr.held_ids() and not gone & set(mgr.resident)
        assert not gone & set(mgr.host)


def test_manager_remove_defers_while_requests_use_the_adapter(adapters):
    """remove (vLLM's remove_lora, the server's unload): an adapter a live request uses
    keeps its host copy and slot (weights intact) until released; then its slot is zeroed
    and free for the next adapter (no eviction); named again, it is live again."""
    reqs, want, _ = adapters
    mgr = _manager(max_loras=2, max_cpu_loras=4)
    for r in reqs[:3]:
        mgr.prepare(r)
    assert mgr.admit(reqs[0], []) and mgr.admit(reqs[1], [1])
    slot = mgr.table.slot_of(1)
    r1 = want[1]["q_proj"].shape[-1]
    assert mgr.remove(1, live_ids=[1, 2])  # a request of adapter 1 is unfinished: deferred
    assert mgr.held_ids() == {2, 3} and 1 in mgr.resident and 1 in mgr.host
    np.testing.assert_array_equal(np.asarray(mgr.table.a["q_proj"])[:, slot, :, :r1],
                                  want[1]["q_proj"])  # fmt: skip
    mgr.release_retired(live_ids=[1])  # still in use: nothing happens
    assert 1 in mgr.resident
    mgr.release_retired(live_ids=[2])  # finished: freed
    assert 1 not in mgr.resident and 1 not in mgr.host and not mgr.retired
    assert not np.asarray(mgr.table.a["q_proj"])[:, slot].any()
    assert mgr.admit(reqs[2], [2]) and mgr.table.slot_of(3) == slot
    assert mgr.stats()["lora_evictions"] == 0
    assert mgr.remove(3, live_ids=[]) and 3 not in mgr.resident  # unused: freed at once
    assert not mgr.remove(3, live_ids=[])  # no longer held
    assert mgr.remove(2, live_ids=[2])
    mgr.prepare(reqs[1])  # named again before its requests finished: live again
    mgr.release_retired(live_ids=[])
    assert 2 in mgr.held_ids() and 2 in mgr.resident
    mgr.prepare(reqs[0])  # removed, then named again: read from its path
    assert mgr.held_ids() == {1, 2}


# --------------------------------------------------------------- unified LoRA memory


@pytest.mark.tier2  # ~3 s: each drawn shape allocates (compiles) its own zeros
@settings(max_examples=8, deadline=None)
@given(layers=st.integers(1, 3), loras=st.integers(1, 4), rank=st.integers(1, 6),
       modules=st.lists(st.sampled_from(["q_proj", "k_proj", "o_proj", "up_proj"]),
                        min_size=1, max_size=4, unique=True))  # fmt: skip
def test_slot_table_bytes_equal_the_allocated_arrays(layers, loras, rank, modules):
    """slot_table_bytes (what unified memory takes out of the KV budget) is exactly the
    bytes of the arrays a LoRASlotTable allocates and its attach adds."""
    from pagedjax.lora import LoRASlotTable, slot_table_bytes

    shapes = {m: llama_module_shapes(ARCH)[m] for m in modules}
    table = LoRASlotTable(shapes, layers, loras, rank)
    base = {"layers": {"self_attn": {m: {} for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
                       "mlp": {m: {} for m in ("gate_proj", "up_proj", "down_proj")}}}  # fmt: skip
    tree = table.attach(base)["layers"]
    attached = sum(tree[g][m]["lora_scale"].nbytes for g in tree for m in tree[g]
                   if "lora_scale" in tree[g][m])  # fmt: skip
    arrays = sum(x.nbytes for x in (*table.a.values(), *table.b.values(), table.scale))
    assert slot_table_bytes(shapes, layers, loras, rank) == arrays + attached


def test_unified_lora_memory_shares_the_kv_budget():
    """Static: the table's bytes come out of every byte budget (the explicit one, a
    GPU's profiled free memory, the CPU default), never out of a block-count override;
    separate and unified (paging: no table): the full budget. Bad values are refused by
    name."""
    import jax

    from pagedjax.engine.kv_budget import cpu_default_kv_bytes, num_kv_blocks
    from pagedjax.engine.lora_manager import lora_reserved_bytes
    from pagedjax.lora import slot_table_bytes

    unified = LoRAConfig(max_loras=4, max_lora_rank=8)  # the default: "static"
    table = slot_table_bytes(llama_module_shapes(ARCH), ARCH.num_layers, 4, 8)
    # L=2 layers x 5 slots x r=8 x 4 bytes x (in + out) of q k v o gate up down, the
    # attached [L, slots] scales of the seven modules, the [slots] scale.
    assert lora_reserved_bytes(unified, ARCH) == table == 2 * 5 * 8 * 4 * (
        16 + 12 + 12 + 16 + 20 + 20 + 20) + 2 * 5 * 4 * 7 + 5 * 4  # fmt: skip
    assert lora_reserved_bytes(LoRAConfig(max_loras=4, max_lora_rank=8, memory="separate"),
                               ARCH) == 0 and lora_reserved_bytes(None, ARCH) == 0  # fmt: skip
    assert lora_reserved_bytes(LoRAConfig(max_loras=4, max_lora_rank=8, memory="unified"),
                               ARCH) == 0  # fmt: skip  # paging: blocks at run time
    kw = dict(kv_bytes_per_token=64, block_size=4, max_blocks_needed=10**9,
              gpu_memory_utilization=0.5, num_gpu_blocks_override=None,
              reserved_bytes=table, reserved_for="LoRA slots")  # fmt: skip
    cpu = jax.devices("cpu")[0]
    budget = 1 << 20
    assert num_kv_blocks(kv_cache_memory_bytes=budget, device=cpu, **kw) == (budget - table) // 256
    assert num_kv_blocks(kv_cache_memory_bytes=budget, device=cpu, **(kw | {"reserved_bytes": 0})
                         ) == budget // 256  # fmt: skip
    assert num_kv_blocks(kv_cache_memory_bytes=None, device=cpu, **kw) == (
        cpu_default_kv_bytes()[0] - table) // 256  # fmt: skip
    assert num_kv_blocks(kv_cache_memory_bytes=None, device=cpu,
                         **(kw | {"num_gpu_blocks_override": 7})) == 7  # fmt: skip
    gpu = SimpleNamespace(platform="gpu", memory_stats=lambda: dict(
        bytes_limit=8 << 20, peak_bytes_in_use=1 << 20))  # fmt: skip
    assert num_kv_blocks(kv_cache_memory_bytes=None, device=gpu, **kw) == (
        (4 << 20) - (1 << 20) - table) // 256  # fmt: skip
    with pytest.raises(ValueError, match="LoRA slots"):
        num_kv_blocks(kv_cache_memory_bytes=table + 300, device=cpu, **kw)
    with pytest.raises(ConfigError, match="lora.memory"):
        LoRAConfig(memory="shared")


# --------------------------------------------------------------- prefix cache keys


def test_salted_hashes_differ_per_adapter_and_unsalted_are_unchanged():
    ids = list(range(3, 40))
    plain, a, a2, b = [], [], [], []
    extend_hashes(plain, ids, 8, 4)
    extend_hashes(a, ids[:20], 8, 2, LoRARequest("a", 1, "/x").cache_salt)
    extend_hashes(a, ids, 8, 4, LoRARequest("a", 1, "/x").cache_salt)  # incremental
    extend_hashes(a2, ids, 8, 4, LoRARequest("a", 1, "/y").cache_salt)  # same adapter
    extend_hashes(b, ids, 8, 4, LoRARequest("b", 2, "/x").cache_salt)
    assert plain == chain_hashes(ids, 8)
    assert a == a2
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)


@settings(max_examples=100)
@given(st.lists(st.tuples(st.sampled_from(["record", "forget"]), st.integers(0, 5),
                          st.integers(1, 4)), max_size=30))  # fmt: skip
def test_prefix_hint_keeps_one_hash_per_block(ops):
    """Each block is proposed under the hash of its latest registration only: a block
    refilled (the same tokens under another adapter's salt) is never proposed for the
    old hash, whose KV it no longer holds."""
    index, latest = PrefixIndex(), {}  # latest: block -> hash of its newest record
    for op, h, block in ops:
        if op == "record":
            index.record([h], [block])
            latest = {b: x for b, x in latest.items() if x != h}
            latest[block] = h
        else:
            index.forget([h])
            latest = {b: x for b, x in latest.items() if x != h}
    for h in range(6):
        want = [b for b, x in latest.items() if x == h]
        assert index.propose([h]) == want


# --------------------------------------------------------------- config and CLI


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_loras=0), "lora.max_loras"),
        (dict(max_lora_rank=-1), "lora.max_lora_rank"),
        (dict(max_loras=4, max_cpu_loras=2), "must be >= max_loras"),
        (dict(max_loras=1.5), "lora.max_loras"),
    ],
)
def test_lora_options_refused_before_loading(kwargs, match):
    from pagedjax import LLM

    with pytest.raises(ConfigError, match=match):
        LLM(model="tiny-llama", enable_lora=True, **kwargs)
    with pytest.raises(TypeError, match="unknown keyword"):
        LLM(model="tiny-llama", enable_lora=True, max_lora=2)
    with pytest.raises(TypeError, match="enable_lora"):
        LLM(model="tiny-llama", enable_lora="yes")


def test_server_lora_flags():
    from pagedjax.entrypoints.openai import cli_args

    p = cli_args.make_parser()
    b_json = '{"name": "b", "path": "/y", "base_model_name": "m"}'
    args = p.parse_args(["--model", "m", "--enable-lora", "--max-loras", "2",
                         "--max-lora-rank", "8", "--max-cpu-loras", "3", "--lora-modules",
                         "a=/x", b_json, "--lora-memory", "separate"])  # fmt: skip
    kw = cli_args.llm_kwargs(args)
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"], kw["max_cpu_loras"],
            kw["lora_memory"]) == (True, 2, 8, 3, "separate")  # fmt: skip
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--lora-memory", "paged"])
    assert args.lora_modules == [{"name": "a", "path": "/x"},
                                 {"name": "b", "path": "/y", "base_model_name": "m"}]  # fmt: skip
    for bad in ("nopath", '{"name": "b"}', '{"name": "b", "path": "/y", "rank": 2}'):
        with pytest.raises(SystemExit):
            p.parse_args(["--model", "m", "--lora-modules", bad])
    with pytest.raises(SystemExit):  # still refused by name: not built
        p.parse_args(["--model", "m", "--fully-sharded-loras"])
    off = SimpleNamespace(config=SimpleNamespace(lora=None))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        cli_args.lora_requests(args, off, ["m"])
    on = SimpleNamespace(config=SimpleNamespace(lora=LoRAConfig()))
    dup = p.parse_args(["--model", "m", "--lora-modules", "m=/x"])
    with pytest.raises(ValueError, match="used twice"):
        cli_args.lora_requests(dup, on, ["m"])


# --------------------------------------------------------------- the engine (tier 2)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TIE_GAP = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama (with a byte-level tokenizer) and adapters A (rank 4, all seven
    modules) and B (rank 2, q/v/down), written by transformers and peft."""
    pytest.importorskip("peft")
    from tests.model_helpers import make_tiny_hf_model, peft_adapter, save_tiny_tokenizer

    d = tmp_path_factory.mktemp("lora_engine")
    base = make_tiny_hf_model("llama", seed=0, num_key_value_heads=2)
    base.save_pretrained(str(d / "base"))
    save_tiny_tokenizer(d / "base")
    models = {None: base, 1: peft_adapter(base, d / "a", 1, 4, ALL),
              2: peft_adapter(base, d / "b", 2, 2, ["q_proj", "v_proj", "down_proj"]),
              3: peft_adapter(base, d / "c", 3, 3, ["k_proj", "o_proj", "up_proj"])}  # fmt: skip
    loras = {i: LoRARequest(n, i, str(d / n.lower())) for i, n in ((1, "A"), (2, "B"), (3, "C"))}
    return SimpleNamespace(dir=d, models=models, loras=loras)


POOL = 24  # blocks of 4 tokens; block 0 is the null block: 23 usable = 92 tokens


@pytest.fixture(scope="module")
def llm(tiny):
    """One engine for every tier-2 test (one set of compiled programs): two adapter slots
    for three adapters, prefix caching on, a pool one 92-token request fills, decode in
    the fused 4-step loop (the adapters travel in its parameters)."""
    from pagedjax import LLM

    return LLM(model=str(tiny.dir / "base"), dtype="float32", block_size=4, max_model_len=96,
               max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=POOL,
               seed=0, enable_lora=True, max_loras=2, max_lora_rank=8, lora_memory="separate",
               num_scheduler_steps=4)  # fmt: skip  # the fused K-step loop too (GPU's default)


def _hf_greedy(model, prompt, n):
    """transformers(+peft) greedy ids (EOS off) and the top-2 logit gap of each step."""
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n,
                             min_new_tokens=0, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    gaps = [float(torch.topk(lg[0].double(), 2).values.diff().abs()) for lg in out.logits]
    return out.sequences[0, len(prompt):].tolist(), gaps


def _assert_greedy(tiny, prompt, lora_id, got, n):
    ref, gaps = _hf_greedy(tiny.models[lora_id], prompt, n)
    for i in range(n):
        if gaps[i] < TIE_GAP:  # a near-tie may break either way in fp32
            return
        assert got[i] == ref[i], f"adapter {lora_id}: step {i}: {got} vs {ref}"


N_NEW = 8


def _greedy(n=N_NEW):
    from pagedjax import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.tier2
def test_mixed_batch_equals_transformers_peft(tiny, llm):
    """Base, A, B, A in one generate call (one batch: their rows share steps) equal
    transformers + peft greedy for each; the adapters change the outputs."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (6, 13, 9, 21)]
    which = [None, 1, 2, 1]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False,
                        lora_request=[tiny.loras.get(i) for i in which])  # fmt: skip
    for p, i, o in zip(prompts, which, outs, strict=True):
        _assert_greedy(tiny, p, i, o.outputs[0].token_ids, N_NEW)
    base = llm.generate(prompts[1], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert base != outs[1].outputs[0].token_ids
    stats = llm.llm_engine.stats()
    assert stats["lora_resident"] == 2 and stats["lora_waits"] == 0
    assert stats["multi_step_iterations"] > 0  # decode ran in the fused loop


@pytest.mark.tier2
def test_bad_adapters_refused_and_engine_keeps_serving(tiny, llm, tmp_path):
    from tests.model_helpers import peft_adapter

    prompt = [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="missing adapter_config.json"):
        llm.generate([prompt, prompt], _greedy(), use_tqdm=False,
                     lora_request=[tiny.loras[1], LoRARequest("x", 7, str(tmp_path))])  # fmt: skip
    big = peft_adapter(tiny.models[None], tmp_path / "big", 3, 16, ["q_proj"])
    del big
    with pytest.raises(ValueError, match="rank 16 exceeds max_lora_rank=8"):
        llm.generate(prompt, _greedy(), use_tqdm=False,
                     lora_request=LoRARequest("big", 8, str(tmp_path / "big")))  # fmt: skip
    write_adapter(tmp_path / "other", r=2, seed=0, modules=("q_proj",))  # hidden 8, not 64
    with pytest.raises(ValueError, match="another base"):
        llm.generate(prompt, _greedy(), use_tqdm=False,
                     lora_request=LoRARequest("other", 9, str(tmp_path / "other")))  # fmt: skip
    with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
        llm.generate(prompt, _greedy(), use_tqdm=False, lora_request=[None, None])
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(prompt, _greedy(), use_tqdm=False, lora_request=tiny.loras[2])
    _assert_greedy(tiny, prompt, 2, out[0].outputs[0].token_ids, N_NEW)


@pytest.mark.tier2
def test_prefix_cache_never_shares_blocks_across_adapters(tiny, llm):
    """Prefix caching on: the same prompt under A, then B, then the base model, then A and
    B again; each request fills the whole pool, so the next one's blocks are the previous
    one's, refilled in place with the same tokens (the hint's stale entries verify on
    device unless dropped). Each gets its own adapter's output."""
    prompt = list(range(40, 124))  # 84 tokens + 8 new = 92: every usable block
    for i in [1, 2, None, 1, 2]:
        out = llm.generate(prompt, _greedy(), use_tqdm=False, lora_request=tiny.loras.get(i))
        _assert_greedy(tiny, prompt, i, out[0].outputs[0].token_ids, N_NEW)
    assert llm.llm_engine.num_free_blocks() == POOL - 1


@pytest.mark.tier2
def test_slot_pressure_waits_then_completes(tiny, llm):
    """Three adapters in flight on two slots (and the base model): the third waits at
    admission until a slot's requests finish, is loaded over the least recently used
    adapter, and every request gets its own adapter's output."""
    s = llm.llm_engine.stats()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (5, 7, 6, 4, 9, 8)]
    which = [1, 2, 3, None, 3, 1]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False,
                        lora_request=[tiny.loras.get(i) for i in which])  # fmt: skip
    for p, i, o in zip(prompts, which, outs, strict=True):
        _assert_greedy(tiny, p, i, o.outputs[0].token_ids, N_NEW)
    now = llm.llm_engine.stats()
    assert now["lora_waits"] > s["lora_waits"] and now["lora_evictions"] > s["lora_evictions"]
    assert now["lora_resident"] == 2


@pytest.mark.tier2
def test_core_loop_add_carries_the_lora_request(tiny, llm):
    """The engine core process' command loop (core_process.CoreLoop, run here on the
    in-process engine): an "add" message with a fifth element serves that adapter."""
    from pagedjax.engine.core_process import CoreLoop

    prompt = [9, 8, 7, 6, 5, 4, 3]
    want = llm.generate(prompt, _greedy(), use_tqdm=False, lora_request=tiny.loras[3])
    engine = llm.llm_engine
    CoreLoop(engine, None).apply(("add", "core-1", {"prompt_token_ids": prompt}, _greedy(),
                                  tiny.loras[3]))  # fmt: skip
    got = None
    while engine.has_unfinished_requests():
        got = [o for o in engine.step() if o.finished] or got
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


@pytest.mark.tier2
def test_remove_lora_defers_until_its_requests_finish(tiny, llm):
    """LLMEngine.add_lora / remove_lora (what the server's load / unload call): an
    adapter removed while one request of it runs and another waits in the queue serves
    both to the end, correct; the next admission pass frees it."""
    engine, c = llm.llm_engine, tiny.loras[3]
    prompts = {"rm-run": [9, 8, 7, 6, 5, 4, 3], "rm-queued": [3, 4, 5, 6, 7]}
    want = {rid: llm.generate(p, _greedy(), use_tqdm=False, lora_request=c)[0]
            .outputs[0].token_ids for rid, p in prompts.items()}  # fmt: skip
    engine.remove_lora(3)
    assert engine.add_lora(c) and 3 in engine.list_loras()
    engine.add_request("rm-run", prompts["rm-run"], _greedy(), lora_request=c)
    engine.step()  # admitted: C in a device slot, its request running
    engine.add_request("rm-queued", prompts["rm-queued"], _greedy(), lora_request=c)
    assert engine.remove_lora(3) and 3 not in engine.list_loras()
    assert 3 in engine.core.lora.resident  # not freed under its requests
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert got == want
    _assert_greedy(tiny, prompts["rm-run"], 3, got["rm-run"], N_NEW)
    llm.generate([5, 5, 5], _greedy(1), use_tqdm=False)  # one more admission pass
    assert 3 not in engine.core.lora.resident and 3 not in engine.core.lora.host
    assert not engine.remove_lora(3)


@pytest.mark.tier2
def test_engine_pool_shrinks_by_the_slot_table_under_unified_memory(tiny):
    """The engine's pool under one kv_cache_memory_bytes: static LoRA memory gives
    (budget - table bytes) // block bytes blocks, separate the whole budget's; the table
    the engine then allocates is exactly the bytes taken out."""
    from pagedjax import LLM
    from pagedjax.lora import slot_table_bytes

    budget, got = 1 << 20, {}
    for memory in ("static", "separate"):
        e = LLM(model=str(tiny.dir / "base"), dtype="float32", block_size=4, max_model_len=96,
                max_num_seqs=64, kv_cache_memory_bytes=budget, seed=0, enable_lora=True,
                max_loras=4, max_lora_rank=8, lora_memory=memory, warmup="none").llm_engine
        per_block = e.kv_spec.bytes_per_token * e.block_size
        table = e.core.lora.table
        got[memory] = e.num_blocks
        allocated = sum(x.nbytes for x in (*table.a.values(), *table.b.values(), table.scale))
        allocated += table.num_layers * table.num_slots * 4 * len(table.a)  # attached scales
        assert allocated == slot_table_bytes(table.module_shapes, table.num_layers, 4, 8)
    assert got == {"static": (budget - allocated) // per_block, "separate": budget // per_block}


PAGED_POOL = 48  # blocks of 4: A 16, B 8, C 12 pages of the 47 usable (S-LoRA paging)


@pytest.fixture(scope="module")
def paged(tiny):
    """``llm``'s engine with unified paging: the adapters' weights in blocks of a 48-block
    pool (A 16, B 8, C 12 of its 47 usable: they cannot all be resident beside a long
    request's KV), three adapter slots; the one-step path and no warm-up (fewer programs
    to compile: the K-step loop carries the same parameters as ``llm`` shows)."""
    from pagedjax import LLM

    return LLM(model=str(tiny.dir / "base"), dtype="float32", block_size=4, max_model_len=96,
               max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=PAGED_POOL,
               seed=0, enable_lora=True, max_loras=3, max_lora_rank=8, lora_memory="unified",
               warmup="none")  # fmt: skip  # only what it runs; the one-step path (CPU's)


@pytest.mark.tier2
def test_unified_paging_equals_the_separate_table_with_waits_and_preemption(tiny, llm, paged):
    """Unified paging (adapters in KV blocks) gives the separate table's greedy outputs on
    the same mixed requests (three adapters and the base model), through a wait for
    pages (C's 12 pages do not fit beside A's, B's and A's 46-token request: C waits
    until they finish, then loads over an idle adapter's pages) and preemption; blocks
    are lent at load and given back at eviction (free + lent == usable throughout), and
    removing every adapter frees the whole pool. An adapter whose pages and prompt can
    never fit is refused at add_request, and the engine serves on; no step program was
    traced twice (the page table's shapes never change)."""
    engine = paged.llm_engine
    usable = PAGED_POOL - 1
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (30, 7, 6, 4, 9, 8)]
    which = [1, 2, 3, None, 3, 1]
    loras = [tiny.loras.get(i) for i in which]
    want = llm.generate(prompts, _greedy(16), use_tqdm=False, lora_request=loras)
    lent = []

    def observe(_record):
        lent.append((engine.num_free_blocks(), engine.core.lora.pages.lent()))

    engine.add_step_observer(observe)
    got = paged.generate(prompts, _greedy(16), use_tqdm=False, lora_request=loras)
    engine.step_observers.remove(observe)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    s = engine.stats()
    assert s["lora_waits"] > 0 and s["lora_loads"] >= 3 and engine.num_preemptions > 0
    assert all(free + pages <= usable for free, pages in lent) and max(p for _, p in lent) > 0
    assert engine.num_free_blocks() + s["lora_blocks"] == usable  # idle adapters cached
    for i in (1, 2, 3):
        engine.remove_lora(i)
    assert engine.num_free_blocks() == usable and engine.stats()["lora_blocks"] == 0
    from tests.model_helpers import peft_adapter

    peft_adapter(tiny.models[None], tiny.dir / "d8", 4, 8, ALL)  # rank 8: 32 pages
    big = LoRARequest("D", 4, str(tiny.dir / "d8"))
    with pytest.raises(ValueError, match="can never fit"):
        paged.generate(list(range(3, 73)), _greedy(), use_tqdm=False, lora_request=big)
    out = paged.generate(prompts[1], _greedy(), use_tqdm=False, lora_request=tiny.loras[2])
    assert out[0].outputs[0].token_ids == want[1].outputs[0].token_ids[:N_NEW]
    # Adapters loaded, evicted and re-bound over these runs: each step program traced once.
    assert engine.runner.trace_count and set(engine.runner.trace_count.values()) == {1}


@pytest.mark.tier2
def test_core_loop_rpcs_load_and_remove_adapters(tiny, llm, tmp_path):
    """The core process' named RPCs with an argument (add_lora / remove_lora /
    list_loras, on the in-process engine): a bad adapter comes back with its type."""
    import pickle

    from pagedjax.engine.core_process import CoreLoop

    sent = []
    conn = SimpleNamespace(send_bytes=lambda b: sent.append(pickle.loads(b)))
    loop = CoreLoop(llm.llm_engine, conn)
    loop.apply(("rpc", 1, "add_lora", LoRARequest("x", 11, str(tmp_path / "nope"))))
    loop.apply(("rpc", 2, "add_lora", tiny.loras[3]))
    loop.apply(("rpc", 3, "list_loras"))
    loop.apply(("rpc", 4, "remove_lora", 3))
    loop.apply(("rpc", 5, "list_loras"))
    assert sent[0][:3] == ("rpc", 1, False) and sent[0][4] == "ValueError"
    assert "missing adapter_config.json" in sent[0][3]
    assert sent[1] == ("rpc", 2, True, True) and 3 in sent[2][3]
    assert sent[3] == ("rpc", 4, True, True) and 3 not in sent[4][3]


@pytest.mark.slow  # ~55 s on the loaded 2-core box (a core process starts and compiles)
def test_engine_core_process_serves_adapters(tiny, llm, tmp_path):
    """The server's default engine: the core in a process of its own (MPEngineClient).
    The LoRARequest crosses the process boundary with its request; a bad adapter is
    the add_request's ValueError in the API process, and LoRA off refuses one."""
    from pagedjax.engine.core_client import MPEngineClient
    from pagedjax.entrypoints.llm import engine_config
    from tests.model_helpers import peft_adapter

    prompts = {"r-base": None, "r-a": 1, "r-c": 3}
    prompt = [9, 8, 7, 6, 5, 4, 3]
    want = {rid: llm.generate(prompt, _greedy(), use_tqdm=False,
                              lora_request=tiny.loras.get(i))[0].outputs[0].token_ids
            for rid, i in prompts.items()}  # fmt: skip
    geometry = dict(dtype="float32", block_size=4, max_model_len=96, max_num_seqs=4,
                    max_num_batched_tokens=32, num_gpu_blocks_override=POOL, seed=0,
                    warmup="none")  # fmt: skip
    mp = MPEngineClient(engine_config(model=str(tiny.dir / "base"), enable_lora=True,
                                      max_loras=2, max_lora_rank=8, **geometry))  # fmt: skip
    try:
        with pytest.raises(ValueError, match="missing adapter_config.json"):
            mp.add_request("bad", prompt, _greedy(), LoRARequest("x", 9, str(tmp_path)))
        for rid, i in prompts.items():
            mp.add_request(rid, prompt, _greedy(), lora_request=tiny.loras.get(i))
        got = {}
        while mp.has_unfinished_requests():
            for o in mp.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
        assert got == want
        # Runtime adapters through the client protocol (the server's load / unload).
        with pytest.raises(ValueError, match="rank 16 exceeds"):
            peft_adapter(tiny.models[None], tmp_path / "big", 3, 16, ["q_proj"])
            mp.add_lora(LoRARequest("big", 12, str(tmp_path / "big")))
        assert mp.add_lora(tiny.loras[3]) and 3 in mp.list_loras()
        assert mp.remove_lora(3) and 3 not in mp.list_loras()
        assert not mp.remove_lora(3)
    finally:
        mp.shutdown()


@pytest.mark.tier2
def test_server_serves_an_adapter_by_model_name(tiny, llm):
    from starlette.testclient import TestClient

    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.api_server import build_app

    prompt = [7, 8, 9, 10, 11, 12]
    want = {i: llm.generate(prompt, _greedy(), use_tqdm=False, lora_request=tiny.loras.get(i))
            [0].outputs[0].text for i in (None, 1, 2)}  # fmt: skip
    engine = AsyncLLMEngine.from_llm(llm)
    b = LoRARequest("B", 2, tiny.loras[2].lora_path, base_model_name="tiny-alias")
    app = build_app(engine, ["tiny", "tiny-alias"], lora_modules={"A": tiny.loras[1], "B": b})
    try:
        with TestClient(app) as c:
            models = c.get("/v1/models").json()["data"]
            want_models = [("tiny", None), ("tiny-alias", None), ("A", "tiny"),
                           ("B", "tiny-alias")]  # fmt: skip
            assert [(m["id"], m["parent"]) for m in models] == want_models
            assert models[2]["root"] == tiny.loras[1].lora_path
            for name, i in (("tiny", None), ("A", 1), ("B", 2)):
                r = c.post("/v1/completions", json=dict(
                    model=name, prompt=prompt, max_tokens=N_NEW, temperature=0.0,
                    ignore_eos=True))  # fmt: skip
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want[i]
            r = c.post("/v1/completions", json=dict(model="C", prompt=prompt, max_tokens=2))
            assert r.status_code == 404
            assert r.json()["error"]["message"] == "The model `C` does not exist."
    finally:
        engine.shutdown()


def _serve(app):
    return serve_in_thread(app)


@pytest.mark.tier2
def test_server_loads_and_unloads_adapters_at_run_time(tiny, llm, tmp_path, monkeypatch):
    """The issue's acceptance with the official ``openai`` client: the server serves A and
    B by name, loads C at run time (PAGEDJAX_ALLOW_RUNTIME_LORA_UPDATING=true) whose
    greedy output equals ``LLM.generate(..., lora_request=C)``, refuses bad loads with a
    400 naming the cause while serving on, and unloads C while a stream of C runs: the
    stream ends with C's output, later requests for C are vLLM's 404."""
    import threading
    import time

    import openai
    from starlette.testclient import TestClient

    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.api_server import build_app
    from pagedjax.entrypoints.openai.lora_adapters import RUNTIME_LORA_ENV
    from tests.model_helpers import peft_adapter

    prompt, n_long = [7, 8, 9, 10, 11, 12], 48
    want = {i: llm.generate(prompt, _greedy(), use_tqdm=False, lora_request=tiny.loras.get(i))
            [0].outputs[0].text for i in (1, 2, 3)}  # fmt: skip
    want_long = llm.generate(prompt, _greedy(n_long), use_tqdm=False,
                             lora_request=tiny.loras[3])[0].outputs[0].text  # fmt: skip
    peft_adapter(tiny.models[None], tmp_path / "big", 3, 16, ["q_proj"])  # rank 16 > 8
    write_adapter(tmp_path / "other", r=2, seed=0, modules=("q_proj",))  # hidden 8, not 64
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "adapter_config.json").write_text(json.dumps(
        dict(peft_type="LORA", r=2, lora_alpha=4, target_modules=["q_proj"])))  # fmt: skip
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage")
    engine = AsyncLLMEngine.from_llm(llm)
    loras = {"A": tiny.loras[1], "B": tiny.loras[2]}
    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    with TestClient(build_app(engine, ["tiny"], lora_modules=loras)) as off:
        r = off.post("/v1/load_lora_adapter", json={"lora_name": "C", "lora_path": "/x"})
        assert r.status_code == 404 and RUNTIME_LORA_ENV in r.json()["error"]["message"]
    monkeypatch.setenv(RUNTIME_LORA_ENV, "true")
    app = build_app(engine, ["tiny"], lora_modules=loras)
    server, thread, url = _serve(app)
    client = openai.OpenAI(api_key="unused", base_url=url + "/v1", timeout=120, max_retries=0)

    def complete(model: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=N_NEW,
                                         temperature=0.0, extra_body={"ignore_eos": True}
                                         ).choices[0].text  # fmt: skip

    def load(name: str, path: str) -> str:
        return client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": path},
                           cast_to=str)  # fmt: skip

    try:
        assert [m.id for m in client.models.list()] == ["tiny", "A", "B"]
        assert complete("A") == want[1] and complete("B") == want[2]
        with pytest.raises(openai.NotFoundError, match="The model `C` does not exist"):
            complete("C")
        assert load("C", tiny.loras[3].lora_path) == "Success: LoRA adapter 'C' added successfully."
        cards = {m.id: m for m in client.models.list()}
        assert list(cards) == ["tiny", "A", "B", "C"] and cards["C"].root == tiny.loras[3].lora_path
        assert complete("C") == want[3]
        for name, path, match in [
            ("C", tiny.loras[3].lora_path, "'C' has already been loaded"),
            ("tiny", tiny.loras[3].lora_path, "served base model name"),
            ("D", "", "Both 'lora_name' and 'lora_path' must be provided"),
            ("D", str(tmp_path / "nope"), "missing adapter_config.json"),
            ("D", str(tmp_path / "corrupt"), "corrupt adapter_model.safetensors"),
            ("D", str(tmp_path / "big"), "rank 16 exceeds max_lora_rank=8"),
            ("D", str(tmp_path / "other"), "another base"),
        ]:  # fmt: skip
            with pytest.raises(openai.BadRequestError, match=match):
                load(name, path)
        with pytest.raises(openai.NotFoundError, match="The lora adapter 'D' cannot be found"):
            client.post("/unload_lora_adapter", body={"lora_name": "D"}, cast_to=str)
        assert [m.id for m in client.models.list()] == ["tiny", "A", "B", "C"]
        assert complete("B") == want[2]  # serving on
        # Unload C while a request of C waits in the engine, deterministically: the engine
        # thread is parked on a call, the request's add and then the unload's removal
        # queue behind it and are applied together, so the removal finds it unfinished.
        gate, got = threading.Event(), {}
        engine.call_future(lambda e: gate.wait(60))

        def in_thread(key, fn):
            t = threading.Thread(target=lambda: got.__setitem__(key, fn()), daemon=True)
            t.start()
            return t

        def until(cond):
            deadline = time.monotonic() + 60
            while not cond():
                assert time.monotonic() < deadline
                time.sleep(0.01)

        waiting = in_thread("text", lambda: "".join(ch.choices[0].text for ch in
                            client.completions.create(model="C", prompt=prompt,
                                                      max_tokens=n_long, temperature=0.0,
                                                      stream=True,
                                                      extra_body={"ignore_eos": True})))
        until(lambda: engine.num_in_flight >= 1)  # its add is queued behind the gate
        unload = in_thread("unload", lambda: client.post(
            "/unload_lora_adapter", body={"lora_name": "C"}, cast_to=str))  # fmt: skip
        until(lambda: "C" not in app.state.serving.loras.modules)  # its removal is queued
        gate.set()
        waiting.join(60)
        unload.join(60)
        assert got["unload"] == "Success: LoRA adapter 'C' removed successfully."
        assert got["text"] == want_long  # served with C to the end
        # Loaded again (a new id), unloaded while a stream of it runs (no parking here:
        # the stream is usually still running, else the removal is immediate).
        assert load("C", tiny.loras[3].lora_path).startswith("Success")
        assert complete("C") == want[3]
        chunks = iter(client.completions.create(model="C", prompt=prompt, max_tokens=n_long,
                                                temperature=0.0, stream=True,
                                                extra_body={"ignore_eos": True}))  # fmt: skip
        text = next(chunks).choices[0].text
        done = client.post("/unload_lora_adapter", body={"lora_name": "C"}, cast_to=str)
        assert done == "Success: LoRA adapter 'C' removed successfully."
        text += "".join(ch.choices[0].text for ch in chunks)
        assert text == want_long
        with pytest.raises(openai.NotFoundError, match="The model `C` does not exist"):
            complete("C")
        assert [m.id for m in client.models.list()] == ["tiny", "A", "B"]
        assert complete("A") == want[1]  # an admission pass: C's slot and copy are freed
        held = engine.call_future(lambda e: e.list_loras()).result(60)
        assert not held & {3, 4} and 1 in held
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()
