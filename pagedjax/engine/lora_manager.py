"""Multi-LoRA in the engine: which adapters are on the device, and which rows use which.

The slot table (``pagedjax/lora/slots.py``) holds at most ``max_loras`` adapters in
fixed-shape device arrays (slot 0: the base model). This module makes the serving
decisions around it, on the host, between steps (docs/lora.md):

- ``prepare`` (``LLMEngine.add_request``): read the request's adapter into host memory
  (an LRU of ``max_cpu_loras`` adapters; those of unfinished requests always stay), so a
  bad path, a rank above ``max_lora_rank`` or a target module the model lacks is that
  request's ValueError before it is queued, and nothing else is touched.
- ``admit`` (``admission.assign_slots``): the adapter gets a device slot before its
  request gets a scheduler slot: already loaded (an LRU touch), a free slot, or the
  least recently used loaded adapter that no request holding a scheduler slot uses,
  evicted. When every slot's adapter is in use the request waits in the queue (vLLM's
  scheduler skips it the same way) and is admitted when a slot frees up.
- ``bind`` (``EngineCore.take_slot``): scheduler slot -> adapter slot, int32[max_seqs].
- ``params``: what the step programs take as their parameters: the base tree with the
  table attached (``LoRASlotTable.attach``) and the per-scheduler-slot adapter slots
  under ``LORA_SEQ_SLOTS``; ``model_runner.build_model_input`` turns those into each
  token's ``ModelInput.lora_slots``. Shapes never change, so loading, evicting or
  rebinding an adapter never recompiles a step program, and every path that steps the
  engine (one step, the K-step loop, warm-up) serves LoRA rows without a new argument.

A sequence keeps its scheduler slot from admission to its end (preemption keeps it), so
its adapter stays resident for as long as the sequence lives.

Memory (``LoRAConfig.memory``): "unified" keeps resident adapters in blocks of the KV pool
(``lora_paging.AdapterPages``: blocks lent from the allocator at load, returned at
eviction), so ``admit`` also needs the adapter's pages: free blocks, else idle adapters
(LRU) evicted until they suffice, else the request waits as one whose KV does not fit.
``relieve`` (each admission pass) returns idle adapters' blocks to KV when the pool runs
short. "static" / "separate": the fixed slot table (``LoRASlotTable``), inside the KV
budget or beside it, and only slots are counted.

Runtime loading (vLLM's ``add_lora`` / ``remove_lora``, the server's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``): adding is ``prepare`` (read
and check now, so a bad adapter is the call's ValueError; the device slot is taken at
its first request's admission, as for any adapter). ``remove`` retires an adapter: its
host copy and device slot are freed at once when no unfinished request uses it, else
*deferred* (vLLM's unload does not touch running requests either): the requests already
added finish with it, and ``release_retired`` (each admission pass) frees it once none is
left. A retired id named again (``prepare``) is simply live again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from pagedjax.config import LoRAConfig
from pagedjax.engine.host_arrays import upload
from pagedjax.engine.lora_paging import AdapterPages
from pagedjax.lora import (
    LoRAAdapter,
    LoRARequest,
    LoRASlotTable,
    llama_module_shapes,
    load_peft_adapter,
    slot_table_bytes,
)
from pagedjax.lora.slots import LORA_SEQ_SLOTS


class LoRAManager:
    """The engine's adapters (module docstring). config: LoRAConfig; arch: a Llama-family
    ModelArch; base_params: the placed model parameters; max_seqs: scheduler slots;
    device: the engine's DeviceState (needed by memory "unified": the pool it pages in)."""

    def __init__(self, config: LoRAConfig, arch: Any, base_params: Any, max_seqs: int,
                 device: Any = None):  # fmt: skip
        if arch.family != "llama":
            raise ValueError(f"LoRA is built for the Llama family, not {arch.family!r}")
        self.config = config
        self.shapes = llama_module_shapes(arch)
        self.num_layers = arch.num_layers
        self.table: LoRASlotTable | None = None
        self.pages: AdapterPages | None = None
        if config.memory == "unified":
            if device is None:
                raise ValueError("lora memory 'unified' pages adapters in the KV pool: "
                                 "LoRAManager needs the engine's DeviceState")  # fmt: skip
            self.pages = AdapterPages(self.shapes, arch.num_layers, config.max_loras,
                                      config.max_lora_rank, device)  # fmt: skip
        else:
            self.table = LoRASlotTable(self.shapes, arch.num_layers, config.max_loras,
                                       config.max_lora_rank)  # fmt: skip
        self.base = base_params
        self.host: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()  # LRU
        self.resident: OrderedDict[int, None] = OrderedDict()  # loaded ids, LRU first
        self.seq_slots = np.zeros(max_seqs, np.int32)
        self.loads = self.evictions = self.waits = self.reliefs = 0
        self.retired: set[int] = set()  # removed while in use: freed when no longer used
        self._params: Any = None

    @classmethod
    def for_core(cls, core: Any, config: LoRAConfig, arch: Any, base_params: Any) -> LoRAManager:
        """The manager of an engine core (``core.EngineCore``: its slots and device state)."""
        return cls(config, arch, base_params, core.max_seqs, core.device)

    # ------------------------------------------------------------------ host memory

    def prepare(self, lora: LoRARequest, live_ids: Iterable[int] = (),
                kv_blocks: int = 0) -> None:  # fmt: skip
        """Read ``lora``'s adapter into host memory (once per id). Raises ValueError for
        a bad adapter, or an id already used by another name or path, or (memory
        "unified") an adapter whose pages and ``kv_blocks`` (its request's prompt KV)
        could never fit in the pool together, changing nothing. live_ids: adapter ids of
        unfinished requests (never dropped from host memory)."""
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        have = self.host.get(lora.lora_int_id)
        if have is not None:
            old = have[0]
            if (old.lora_name, old.lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is adapter {old.lora_name!r} "
                    f"({old.lora_path}); it cannot also name {lora.lora_name!r} "
                    f"({lora.lora_path}): one id per adapter"
                )
            self._check_fits(lora, have[1].rank, kv_blocks)
            self.host.move_to_end(lora.lora_int_id)
            self.retired.discard(lora.lora_int_id)
            return
        adapter = load_peft_adapter(lora.lora_path, self.shapes, self.num_layers,
                                    self.config.max_lora_rank)  # fmt: skip
        self._check_fits(lora, adapter.rank, kv_blocks)
        self.host[lora.lora_int_id] = (lora, adapter)
        self.retired.discard(lora.lora_int_id)
        keep = set(live_ids) | {lora.lora_int_id}
        for i in [i for i in self.host if i not in keep]:  # LRU first
            if len(self.host) <= self.config.cpu_loras:
                break
            del self.host[i]

    def _check_fits(self, lora: LoRARequest, rank: int, kv_blocks: int) -> None:
        """ValueError when (unified paging) the adapter's pages plus ``kv_blocks`` exceed
        the pool's usable blocks: its request could never run, so it is refused now
        instead of waiting forever."""
        if self.pages is None:
            return
        need = self.pages.pages_needed(rank)
        if need + max(kv_blocks, 1) > self.pages.usable:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} (rank {rank}) needs {need} KV blocks of"
                f" the pool's {self.pages.usable} (lora_memory='unified'), and its request"
                f" {max(kv_blocks, 1)} more for its prompt: it can never fit; give the KV"
                f" cache more memory, use a lower rank, or lora_memory='separate'"
            )

    def remove(self, lora_int_id: int, live_ids: Iterable[int]) -> bool:
        """Retire adapter ``lora_int_id`` (vLLM's remove_lora): its host copy and device
        slot are freed now when no unfinished request uses it (live_ids: their adapter
        ids), else once they have finished (``release_retired``), so no running or queued
        request loses its adapter. False for an id this manager does not hold."""
        if lora_int_id not in self.host and lora_int_id not in self.resident:
            return False
        self.retired.add(lora_int_id)
        self.release_retired(live_ids)
        return True

    def release_retired(self, live_ids: Iterable[int]) -> None:
        """Free the retired adapters no unfinished request (live_ids) uses: host copy
        dropped, device slot zeroed and free (a request holding a scheduler slot is live,
        so no bound row reads a freed slot)."""
        live = set(live_ids)
        for i in [i for i in self.retired if i not in live]:
            self.retired.discard(i)
            self.host.pop(i, None)
            if i in self.resident:
                self._unload(i)

    def held_ids(self) -> set[int]:
        """Ids of the adapters held (host memory or a device slot), retired ones aside."""
        return (set(self.host) | set(self.resident)) - self.retired

    # ------------------------------------------------------------------ device slots

    def admit(self, lora: LoRARequest | None, in_use: Iterable[int], kv_blocks: int = 0) -> bool:
        """Whether a request of adapter ``lora`` (None: base) may take a scheduler slot
        now, loading its adapter onto the device if needed (module docstring).
        in_use: adapter ids of the requests that hold scheduler slots; kv_blocks (unified
        paging): the most KV blocks one of those requests or this one needs at its full
        length (``_admit_paged``)."""
        if lora is None:
            return True
        i = lora.lora_int_id
        if i in self.resident:
            self.resident.move_to_end(i)
            return True
        busy = set(in_use)
        idle = [v for v in self.resident if v not in busy]  # LRU first
        have = self.host.get(i)
        if self.pages is not None:
            if have is None:  # dropped from host memory: read again
                self.prepare(lora, busy)
                have = self.host[i]
            return self._admit_paged(i, have[1], idle, busy, kv_blocks)
        if len(self.resident) >= self.config.max_loras:
            if not idle:
                self.waits += 1
                return False
            self._unload(idle[0])
            self.evictions += 1
        adapter = have[1] if have is not None else None  # None: read again (dropped)
        self.table.add(lora, adapter)
        self._loaded(i)
        return True

    def _admit_paged(self, i: int, adapter: LoRAAdapter, idle: list[int], busy: set[int],
                     kv_blocks: int) -> bool:  # fmt: skip
        """Unified paging: a free slot and the adapter's pages, evicting idle adapters
        (LRU first) only as far as they make both fit; else wait, evicting nothing.

        Also waits when adapters are pinned (busy) and their pages, this adapter's and
        ``kv_blocks`` (the largest full-length KV of the slotted requests and this one)
        exceed the pool: pinned pages cannot be preempted as KV can, so admitting it could
        leave some slotted request unable ever to run (a livelock); it runs once the
        pinned adapters' requests finish. Nothing pinned: it is admitted whenever its
        pages fit (alone, a request runs as on a base engine)."""
        pages = self.pages
        need = pages.pages_needed(adapter.rank)
        pinned = sum(len(pages.blocks_by_id[v]) for v in self.resident if v in busy)
        if pinned and pinned + need + kv_blocks > pages.usable:
            self.waits += 1
            return False
        free = pages.device.num_free_blocks()
        victims: list[int] = []
        for v in idle:
            if free >= need and (pages.has_free_slot() or victims):
                break
            victims.append(v)
            free += len(pages.blocks_by_id[v])
        if free < need or not (pages.has_free_slot() or victims):
            self.waits += 1
            return False
        for v in victims:
            self._unload(v)
            self.evictions += 1
        if not pages.load(i, adapter):  # counted free blocks above: cannot happen
            raise RuntimeError(f"LoRA adapter {i}: {need} blocks were free but not lent")
        self._loaded(i)
        return True

    def relieve(self, in_use: Iterable[int], want_free: int) -> None:
        """Unified paging: while the pool has fewer than ``want_free`` free blocks, give
        idle adapters' blocks (no request holding a scheduler slot uses them; LRU first)
        back to KV. One scalar read of the pool when an idle adapter is resident."""
        if self.pages is None:
            return
        busy = set(in_use)
        idle = [v for v in self.resident if v not in busy]
        if not idle:
            return
        free = self.pages.device.num_free_blocks()
        for v in idle:
            if free >= want_free:
                break
            free += len(self.pages.blocks_by_id[v])
            self._unload(v)
            self.reliefs += 1

    def _loaded(self, i: int) -> None:
        self.resident[i] = None
        self.loads += 1
        self._params = None

    def _unload(self, i: int) -> None:
        """Adapter ``i`` off the device: its slot emptied (unified: its blocks back to KV)."""
        if self.pages is not None:
            self.pages.evict(i)
        else:
            self.table.remove(i)
        del self.resident[i]
        self._params = None

    def bind(self, slot: int, lora: LoRARequest | None) -> None:
        """Scheduler slot ``slot`` now runs adapter ``lora`` (None: the base model); its
        adapter must be resident (``admit``)."""
        i = None if lora is None else lora.lora_int_id
        value = (self.pages or self.table).slot_of(i)
        if self.seq_slots[slot] != value:
            self.seq_slots[slot] = value
            self._params = None

    def params(self) -> Any:
        """The step programs' parameters (module docstring); rebuilt only after a change
        (the adapter arrays are shared with the table, not copied)."""
        if self._params is None:
            self._params = {**(self.pages or self.table).attach(self.base),
                            LORA_SEQ_SLOTS: upload(self.seq_slots)}  # fmt: skip
        return self._params

    def stats(self) -> dict[str, int]:
        """lora_loads: adapters written into a device slot; lora_evictions: adapters
        evicted for another; lora_waits: admissions deferred for want of a slot (or, under
        unified paging, of free blocks for its pages); lora_resident: adapters on the
        device now; lora_blocks: KV blocks their pages hold (unified; else 0);
        lora_reliefs: idle adapters evicted to give their blocks back to KV."""
        return dict(lora_loads=self.loads, lora_evictions=self.evictions,
                    lora_waits=self.waits, lora_resident=len(self.resident),
                    lora_blocks=0 if self.pages is None else self.pages.lent(),
                    lora_reliefs=self.reliefs)  # fmt: skip

    def reset_stats(self) -> None:
        """Zero the counters ``stats()`` reports (what is resident stays)."""
        self.loads = self.evictions = self.waits = self.reliefs = 0


def check_lora_buildable(config: Any) -> None:
    """ValueError for an EngineConfig whose LoRA section meets a feature LoRA is not
    built with: speculative decoding, tensor parallelism (docs/lora.md)."""
    if config.lora is not None and (config.speculative is not None
                                    or config.parallel.tensor_parallel_size > 1):
        raise ValueError("enable_lora with speculative decoding or tensor_parallel_size > 1:"
                         " not built yet (docs/lora.md)")  # fmt: skip


def lora_reserved_bytes(config: LoRAConfig | None, arch: Any) -> int:
    """Bytes the slot table takes out of the KV budget up front: its whole size with
    ``config.memory == "static"`` (the table ``LoRAManager`` allocates for ``arch``); 0
    when LoRA is off, "separate" (beside the budget), "unified" (adapters take pool
    blocks at run time instead: no table), or the model is not a Llama (refused later)."""
    if config is None or config.memory != "static" or arch.family != "llama":
        return 0
    return slot_table_bytes(llama_module_shapes(arch), arch.num_layers, config.max_loras,
                            config.max_lora_rank)  # fmt: skip


def live_lora_ids(requests: Iterable[Any]) -> set[int]:
    """Adapter ids of ``requests`` (RequestStates: the unfinished ones)."""
    return {r.lora_request.lora_int_id for r in requests if r.lora_request is not None}


def _require(manager: LoRAManager | None) -> LoRAManager:
    if manager is None:
        raise ValueError("lora_request given but LoRA is not enabled: build the engine with"
                         " enable_lora=True (LLM(..., enable_lora=True); the server:"
                         " --enable-lora)")  # fmt: skip
    return manager


def prepare_request(manager: LoRAManager | None, lora: LoRARequest,
                    requests: Iterable[Any], prompt_len: int = 0) -> None:  # fmt: skip
    """``LLMEngine.add_request``'s (and ``add_lora``'s) check of an adapter: ValueError
    when LoRA is off, else ``manager.prepare`` with the adapters of ``requests`` (the
    unfinished ones, RequestStates) kept in host memory, and (unified paging) the
    adapter's pages checked against the pool with a prompt of ``prompt_len`` tokens."""
    m = _require(manager)
    block = m.pages.device.block_size if m.pages is not None else 1
    m.prepare(lora, live_lora_ids(requests), -(-(prompt_len + 1) // block))


def remove_adapter(manager: LoRAManager | None, lora_int_id: int,
                   requests: Iterable[Any]) -> bool:  # fmt: skip
    """``LLMEngine.remove_lora``: ``manager.remove`` with the unfinished ``requests``'
    adapters deferred; ValueError when LoRA is off."""
    if not isinstance(lora_int_id, int) or isinstance(lora_int_id, bool) or lora_int_id < 1:
        raise ValueError(f"lora_int_id must be an int >= 1, got {lora_int_id!r}")
    return _require(manager).remove(lora_int_id, live_lora_ids(requests))


__all__ = ["LoRAManager", "check_lora_buildable", "live_lora_ids", "lora_reserved_bytes",
           "prepare_request", "remove_adapter"]
