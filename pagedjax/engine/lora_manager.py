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
    ModelArch; base_params: the placed model parameters; max_seqs: scheduler slots."""

    def __init__(self, config: LoRAConfig, arch: Any, base_params: Any, max_seqs: int):
        if arch.family != "llama":
            raise ValueError(f"LoRA is built for the Llama family, not {arch.family!r}")
        self.config = config
        self.shapes = llama_module_shapes(arch)
        self.num_layers = arch.num_layers
        self.table = LoRASlotTable(self.shapes, arch.num_layers, config.max_loras,
                                   config.max_lora_rank)  # fmt: skip
        self.base = base_params
        self.host: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()  # LRU
        self.resident: OrderedDict[int, None] = OrderedDict()  # loaded ids, LRU first
        self.seq_slots = np.zeros(max_seqs, np.int32)
        self.loads = self.evictions = self.waits = 0
        self.retired: set[int] = set()  # removed while in use: freed when no longer used
        self._params: Any = None

    # ------------------------------------------------------------------ host memory

    def prepare(self, lora: LoRARequest, live_ids: Iterable[int] = ()) -> None:
        """Read ``lora``'s adapter into host memory (once per id). Raises ValueError for
        a bad adapter, or an id already used by another name or path, changing nothing.
        live_ids: adapter ids of unfinished requests (never dropped from host memory)."""
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
            self.host.move_to_end(lora.lora_int_id)
            self.retired.discard(lora.lora_int_id)
            return
        adapter = load_peft_adapter(lora.lora_path, self.shapes, self.num_layers,
                                    self.config.max_lora_rank)  # fmt: skip
        self.host[lora.lora_int_id] = (lora, adapter)
        self.retired.discard(lora.lora_int_id)
        keep = set(live_ids) | {lora.lora_int_id}
        for i in [i for i in self.host if i not in keep]:  # LRU first
            if len(self.host) <= self.config.cpu_loras:
                break
            del self.host[i]

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
                self.table.remove(i)
                del self.resident[i]
                self._params = None

    def held_ids(self) -> set[int]:
        """Ids of the adapters held (host memory or a device slot), retired ones aside."""
        return (set(self.host) | set(self.resident)) - self.retired

    # ------------------------------------------------------------------ device slots

    def admit(self, lora: LoRARequest | None, in_use: Iterable[int]) -> bool:
        """Whether a request of adapter ``lora`` (None: base) may take a scheduler slot
        now, loading its adapter into a device slot if needed (module docstring).
        in_use: adapter ids of the requests that hold scheduler slots."""
        if lora is None:
            return True
        i = lora.lora_int_id
        if i in self.resident:
            self.resident.move_to_end(i)
            return True
        if len(self.resident) >= self.config.max_loras:
            busy = set(in_use)
            victim = next((v for v in self.resident if v not in busy), None)
            if victim is None:
                self.waits += 1
                return False
            self.table.remove(victim)
            del self.resident[victim]
            self.evictions += 1
        have = self.host.get(i)
        adapter = have[1] if have is not None else None  # None: read again (dropped)
        self.table.add(lora, adapter)
        self.resident[i] = None
        self.loads += 1
        self._params = None
        return True

    def bind(self, slot: int, lora: LoRARequest | None) -> None:
        """Scheduler slot ``slot`` now runs adapter ``lora`` (None: the base model); its
        adapter must be resident (``admit``)."""
        value = 0 if lora is None else self.table.slot_of(lora.lora_int_id)
        if self.seq_slots[slot] != value:
            self.seq_slots[slot] = value
            self._params = None

    def params(self) -> Any:
        """The step programs' parameters (module docstring); rebuilt only after a change
        (the adapter arrays are shared with the table, not copied)."""
        if self._params is None:
            self._params = {**self.table.attach(self.base),
                            LORA_SEQ_SLOTS: upload(self.seq_slots)}  # fmt: skip
        return self._params

    def stats(self) -> dict[str, int]:
        """lora_loads: adapters written into a device slot; lora_evictions: adapters
        evicted for another; lora_waits: admissions deferred for want of a slot;
        lora_resident: adapters on the device now."""
        return dict(lora_loads=self.loads, lora_evictions=self.evictions,
                    lora_waits=self.waits, lora_resident=len(self.resident))  # fmt: skip

    def reset_stats(self) -> None:
        """Zero the counters ``stats()`` reports (what is resident stays)."""
        self.loads = self.evictions = self.waits = 0


def check_lora_buildable(config: Any) -> None:
    """ValueError for an EngineConfig whose LoRA section meets a feature LoRA is not
    built with: speculative decoding, tensor parallelism (docs/lora.md)."""
    if config.lora is not None and (config.speculative is not None
                                    or config.parallel.tensor_parallel_size > 1):
        raise ValueError("enable_lora with speculative decoding or tensor_parallel_size > 1:"
                         " not built yet (docs/lora.md)")  # fmt: skip


def lora_reserved_bytes(config: LoRAConfig | None, arch: Any) -> int:
    """Bytes the slot table takes out of the KV budget: its whole size with
    ``config.memory == "unified"`` (the table ``LoRAManager`` allocates for ``arch``),
    0 when LoRA is off, "separate", or the model is not a Llama (refused later)."""
    if config is None or config.memory != "unified" or arch.family != "llama":
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
                    requests: Iterable[Any]) -> None:  # fmt: skip
    """``LLMEngine.add_request``'s (and ``add_lora``'s) check of an adapter: ValueError
    when LoRA is off, else ``manager.prepare`` with the adapters of ``requests`` (the
    unfinished ones, RequestStates) kept in host memory."""
    _require(manager).prepare(lora, live_lora_ids(requests))


def remove_adapter(manager: LoRAManager | None, lora_int_id: int,
                   requests: Iterable[Any]) -> bool:  # fmt: skip
    """``LLMEngine.remove_lora``: ``manager.remove`` with the unfinished ``requests``'
    adapters deferred; ValueError when LoRA is off."""
    if not isinstance(lora_int_id, int) or isinstance(lora_int_id, bool) or lora_int_id < 1:
        raise ValueError(f"lora_int_id must be an int >= 1, got {lora_int_id!r}")
    return _require(manager).remove(lora_int_id, live_lora_ids(requests))


__all__ = ["LoRAManager", "check_lora_buildable", "live_lora_ids", "lora_reserved_bytes",
           "prepare_request", "remove_adapter"]
