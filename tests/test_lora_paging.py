"""Unified paging of LoRA adapters (S-LoRA; docs/lora.md "Unified memory"): adapter weights
in KV pool blocks lent from the allocator, read back through a page table.

Default tier (no model, no engine): the rank-major page layout read back by
``materialize`` equals the fixed slot table's arrays exactly (float32 and bfloat16 pools,
a NaN-filled pool: padding and empty slots never leak), and a Hypothesis walk of adapter
admissions, finishes, reliefs and sequences' KV growth / release on a real ``DeviceState``
keeps the pool's accounting exact (free + sequences' blocks + adapters' pages == usable,
the two sets disjoint), waits only when even evicting every idle adapter would not make
room, and keeps every resident adapter's weights intact. The engine's tests (outputs
equal to the separate table under preemption, waits, refusal) are in test_lora_engine.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.config import LoRAConfig
from pagedjax.engine.device_state import DeviceState
from pagedjax.engine.lora_manager import LoRAManager
from pagedjax.lora import LoRARequest, LoRASlotTable, llama_module_shapes, load_peft_adapter
from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.model.lora_pages import PAGED_KEY, materialize
from pagedjax.scheduler import SchedulerLimits, init_state
from tests.test_lora_engine import ARCH, write_adapter

NUM_BLOCKS, BLOCK, SEQS = 40, 4, 4  # ARCH: 2 layers, 1 KV head of 4: pages of 16 values
BASE = {"layers": {"self_attn": {m: {} for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
                   "mlp": {m: {} for m in ("gate_proj", "up_proj", "down_proj")}}}  # fmt: skip


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Four adapters for ARCH (ids 1..4, ranks 2, 3, 1, 2) on different modules."""
    d = tmp_path_factory.mktemp("lora_paging")
    mods = [("q_proj", "v_proj", "down_proj"), ("k_proj", "o_proj", "up_proj"),
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            ("gate_proj",)]  # fmt: skip
    reqs = []
    for i in range(1, 5):
        write_adapter(d / f"a{i}", r=1 + i % 3, seed=i, modules=mods[i - 1])
        reqs.append(LoRARequest(f"a{i}", i, str(d / f"a{i}")))
    return reqs


def _device(dtype=jnp.float32, fill=float("nan")) -> DeviceState:
    policy = PagedPolicy(NUM_BLOCKS, BLOCK, SEQS, max_blocks_per_seq=8)
    limits = SchedulerLimits(max_seqs=SEQS, max_num_batched_tokens=32, max_num_seqs=SEQS,
                             max_model_len=32)  # fmt: skip
    shape = (ARCH.num_layers, NUM_BLOCKS, ARCH.num_kv_heads, BLOCK, ARCH.head_dim)
    kv = (jnp.full(shape, fill, dtype), jnp.full(shape, fill, dtype))
    return DeviceState(policy, limits, kv, max_model_len=32, num_host_blocks=0)


_WALK: list = []


def _walk_device() -> tuple:
    """One DeviceState and its KV grow / release programs for every Hypothesis example
    (each new DeviceState or jit would compile its programs again)."""
    if not _WALK:
        device = _device()
        grow = jax.jit(lambda mem, ids, lens, m: device.policy.grow(mem, ids, lens, lens, lens,
                                                                    m, False)[0])  # fmt: skip
        _WALK.extend([device, grow, jax.jit(device.policy.release)])
    return tuple(_WALK)


def _manager(device: DeviceState, max_loras: int = 2) -> LoRAManager:
    cfg = LoRAConfig(max_loras=max_loras, max_lora_rank=4, max_cpu_loras=4, memory="unified")
    return LoRAManager(cfg, ARCH, BASE, SEQS, device)


def _read_back(mgr: LoRAManager, layer: int) -> dict:
    """Layer ``layer``'s lora arrays as the step reads them from the pool."""
    tree = mgr.pages.attach(BASE)["layers"]
    view = jax.tree.map(lambda a: a[layer], {PAGED_KEY: tree[PAGED_KEY]})
    view = {**{k: v for k, v in tree.items() if k != PAGED_KEY}, **view}
    return materialize(view, (None, *mgr.pages.device.kv), jnp.int32(layer))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_adapters_read_back_as_the_slot_table(adapters, dtype):
    """Three adapters paged into a NaN-filled pool (a bf16 pool holds the float32 bits in
    two elements each) read back exactly as the fixed slot table holds them; slot 0 and
    the empty slot are zeros; the pool lent exactly their pages."""
    device = _device(dtype)
    mgr = _manager(device, max_loras=3)
    table = LoRASlotTable(llama_module_shapes(ARCH), ARCH.num_layers, 3, 4)
    for r in adapters[:2]:
        mgr.prepare(r)
        assert mgr.admit(r, [])
        table.add(r, load_peft_adapter(r.lora_path, llama_module_shapes(ARCH), 2, 4))
    pages = mgr.pages
    assert device.num_free_blocks() == NUM_BLOCKS - 1 - pages.lent()
    assert pages.lent() == pages.pages_needed(2) + pages.pages_needed(3)
    for layer in range(ARCH.num_layers):
        got = _read_back(mgr, layer)
        for subs in got.values():
            for m, leaves in subs.items():
                if "lora_a" not in leaves:
                    continue
                for slot_id in (1, 2):
                    s, t = pages.slot_of(slot_id), table.slot_of(slot_id)
                    np.testing.assert_array_equal(leaves["lora_a"][s],
                                                  table.a[m][layer, t])  # fmt: skip
                    np.testing.assert_array_equal(leaves["lora_b"][s], table.b[m][layer, t])
                    assert leaves["lora_scale"][s] == table.scale[t]
                for s in (0, 3):  # the base model's slot, the empty slot
                    assert not np.asarray(leaves["lora_a"][s]).any()
                    assert not np.asarray(leaves["lora_b"][s]).any()


@settings(max_examples=20, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "finish", "grow", "release",
                                               "relieve"]),
                              st.integers(0, 3), st.integers(1, 24)), max_size=20))  # fmt: skip
def test_pool_accounting_under_random_adapters_and_sequences(adapters, ops):
    """Admissions (with eviction of idle adapters), finishes, reliefs and sequences
    growing / releasing KV on the real allocator: free + KV blocks + adapter pages ==
    usable blocks after every operation, KV and adapter blocks disjoint, a wait only when
    no choice of idle victims makes room or the pinned adapters' pages would leave too
    little KV for the largest request."""
    device, grow, release = _walk_device()
    device.state = init_state(device.policy, SEQS)  # a fresh pool (the kv keeps garbage)
    mgr = _manager(device)
    pages = mgr.pages
    running: list[int] = []  # adapter ids of admitted unfinished requests
    lens = np.zeros(SEQS, np.int32)
    for r in adapters:
        mgr.prepare(r)
    for op, k, n in ops:
        r = adapters[k]
        if op == "admit":
            idle = [v for v in mgr.resident if v not in running]
            resident = r.lora_int_id in mgr.resident
            need = pages.pages_needed(load_peft_adapter(
                r.lora_path, mgr.shapes, 2, 4).rank)  # fmt: skip
            room = device.num_free_blocks() + sum(len(pages.blocks_by_id[v]) for v in idle)
            slot_ok = pages.has_free_slot() or bool(idle)
            pinned = sum(len(pages.blocks_by_id[v]) for v in set(running))
            livelock = bool(pinned) and pinned + need + n > NUM_BLOCKS - 1
            ok = mgr.admit(r, running, kv_blocks=n)  # n: the largest request's KV blocks
            assert ok == (resident or (room >= need and slot_ok and not livelock))
            if ok:
                running.append(r.lora_int_id)
        elif op == "finish" and r.lora_int_id in running:
            running.remove(r.lora_int_id)
        elif op == "relieve":
            mgr.relieve(running, want_free=n)
            idle = [v for v in mgr.resident if v not in running]
            assert device.num_free_blocks() >= n or not idle
        elif op in ("grow", "release"):
            slot = k % SEQS
            mask = np.arange(SEQS) == slot
            ids = np.arange(SEQS, dtype=np.int32)
            if op == "grow":
                want = np.where(mask, np.minimum(lens + n, 32), lens).astype(np.int32)
                mem = grow(device.state.mem, ids, want, mask)
            else:
                want = np.where(mask, 0, lens).astype(np.int32)
                mem = release(device.state.mem, ids, mask)
            device.state = device.state._replace(mem=mem)
            lens = np.asarray(device.state.mem.tables.lengths)  # a refused grow: unchanged
        tables = np.asarray(device.state.mem.tables.tables)
        kv_blocks = {int(b) for s in range(SEQS) for b in tables[s, : -(-int(lens[s]) // BLOCK)]}
        lent = {int(b) for b in np.concatenate([np.zeros(0, np.int32),
                                                *pages.blocks_by_id.values()])}  # fmt: skip
        assert not kv_blocks & lent and 0 not in lent
        assert device.num_free_blocks() + len(kv_blocks) + len(lent) == NUM_BLOCKS - 1
        assert len(lent) == pages.lent() == mgr.stats()["lora_blocks"]
        assert set(running) <= set(mgr.resident)
    got = _read_back(mgr, layer=1)
    for i in mgr.resident:  # the weights as the step reads them
        ad = load_peft_adapter(adapters[i - 1].lora_path, mgr.shapes, 2, 4)
        for m, (a, b) in ad.weights.items():
            leaves = got["mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"][m]
            np.testing.assert_array_equal(leaves["lora_a"][pages.slot_of(i)][:, : ad.rank], a[1])
            np.testing.assert_array_equal(leaves["lora_b"][pages.slot_of(i)][: ad.rank], b[1])
    for i in list(mgr.resident):
        mgr.remove(i, [])
    assert pages.lent() == 0 and not mgr.resident


def test_unified_paging_refusals():
    """Unified paging needs the engine's device state, and a pool of raw pages (an 8-bit
    pool's values + scales hold none); both refused by name, before anything is built."""
    from types import SimpleNamespace

    from pagedjax.engine.lora_paging import AdapterPages

    with pytest.raises(ValueError, match="needs the engine's DeviceState"):
        LoRAManager(LoRAConfig(memory="unified"), ARCH, BASE, SEQS)
    pages = jnp.zeros((2, 8, 1, 4, 4), jnp.int8)
    quantized = SimpleNamespace(kv=((pages, pages[..., :1]), (pages, pages[..., :1])))
    with pytest.raises(ValueError, match="quantized KV cache"):
        AdapterPages(llama_module_shapes(ARCH), 2, 2, 4, quantized)
