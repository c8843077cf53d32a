"""The fixed-shape adapter slot table: every loaded adapter's A and B in one stacked array per
module, padded to ``max_lora_rank``, so the step program's shapes never depend on which
adapters are loaded (swapping one is a device copy, never a recompile).

Layout per module: A [L, slots, in, r_max], B [L, slots, r_max, out], and one scale per
slot. slots = max_loras + 1; slot 0 is "no adapter" and stays all zeros, so a base row's
delta is exactly 0. An adapter of rank r < r_max fills A[..., :r] and B[..., :r, :] and
leaves the rest zero: the padded columns of x @ A are 0 and meet zero rows of B, so the
result is exact, not approximate. A module the adapter does not target is zero in its slot.

The table is host-side bookkeeping (which id sits in which slot) around device arrays;
``attach`` puts the arrays into a Llama-family parameter tree where the model's linears
find them (``lora_a``/``lora_b``/``lora_scale`` next to each targeted ``kernel``, stacked
over layers like the kernels, so the layer loop slices them per layer).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.lora.checkpoint import ATTENTION_MODULES, LoRAAdapter, load_peft_adapter
from pagedjax.lora.request import LoRARequest

# The engine's parameter tree may carry, beside the model's parameters, each scheduler
# slot's adapter slot (int32 [max_seqs], engine/lora_manager.py) under this key; the step
# builds ModelInput.lora_slots from it (``split_seq_slots``).
LORA_SEQ_SLOTS = "lora_seq_slots"


def split_seq_slots(params: Any) -> tuple[Any, jax.Array | None]:
    """(the model's parameters, the per-scheduler-slot adapter slots or None): the tree
    without ``LORA_SEQ_SLOTS``, so the model never sees a key it has no module for."""
    if isinstance(params, dict) and LORA_SEQ_SLOTS in params:
        rest = {k: v for k, v in params.items() if k != LORA_SEQ_SLOTS}
        return rest, params[LORA_SEQ_SLOTS]
    return params, None


def slot_table_bytes(module_shapes: dict[str, tuple[int, int]], num_layers: int,
                     max_loras: int, max_lora_rank: int, itemsize: int = 4) -> int:  # fmt: skip
    """Device bytes of a ``LoRASlotTable`` of these sizes and its ``attach``: per module
    A [L, slots, in, r] and B [L, slots, r, out] of ``itemsize`` bytes (float32: 4) and the
    [L, slots] float32 scale ``attach`` broadcasts beside them, plus the [slots] scale;
    slots = max_loras + 1. What the engine's unified LoRA memory takes out of the KV
    budget (config.LoRAConfig.memory). Independent of which adapters are loaded: the
    shapes are fixed (module docstring)."""
    slots, r = max_loras + 1, max_lora_rank
    per_module = sum(num_layers * slots * (i + o) * r * itemsize + num_layers * slots * 4
                     for i, o in module_shapes.values())  # fmt: skip
    return per_module + slots * 4


@functools.partial(jax.jit, donate_argnums=0)
def _set_slot(stacked: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """stacked [L, slots, ...] with [:, slot] = value [L, ...]; slot traced: one program
    for every slot (donated: updated in place where the backend can)."""
    return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), slot, 1)


class LoRASlotTable:
    """Up to ``max_loras`` adapters of rank <= ``max_lora_rank`` for a base model whose
    servable linears have ``module_shapes`` ({module: (in, out)}) over ``num_layers``.

    ``add(request)`` loads (or finds) an adapter and returns its slot; ``remove(id)`` frees
    it; ``slot_of(id)`` maps a request's adapter id (None/0: base) to its slot, refusing an
    unknown id; ``slot_ids(ids)`` does so for a batch's rows. A full table refuses ``add``
    (eviction is the scheduler's decision, not the table's)."""

    def __init__(
        self, module_shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int,
        max_lora_rank: int, dtype: Any = jnp.float32,
    ) -> None:  # fmt: skip
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) "
                             f"must be >= 1")  # fmt: skip
        self.module_shapes = dict(module_shapes)
        self.num_layers, self.max_loras, self.max_lora_rank = num_layers, max_loras, max_lora_rank
        self.num_slots = max_loras + 1
        n, s, r = num_layers, self.num_slots, max_lora_rank
        self.a = {m: jnp.zeros((n, s, i, r), dtype) for m, (i, _) in self.module_shapes.items()}
        self.b = {m: jnp.zeros((n, s, r, o), dtype) for m, (_, o) in self.module_shapes.items()}
        self.scale = jnp.zeros((s,), jnp.float32)
        self._slot_by_id: dict[int, int] = {}

    def add(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> int:
        """The slot of ``request``'s adapter, loading it (from ``adapter`` if given, else
        from request.lora_path) into a free slot if it is not loaded yet."""
        if request.lora_int_id in self._slot_by_id:
            return self._slot_by_id[request.lora_int_id]
        free = sorted(set(range(1, self.num_slots)) - set(self._slot_by_id.values()))
        if not free:
            raise ValueError(f"all {self.max_loras} LoRA slots are in use; remove one first "
                             f"(loaded ids: {sorted(self._slot_by_id)})")  # fmt: skip
        if adapter is None:
            adapter = load_peft_adapter(Path(request.lora_path), self.module_shapes,
                                        self.num_layers, self.max_lora_rank)  # fmt: skip
        self._write(free[0], adapter)
        self._slot_by_id[request.lora_int_id] = free[0]
        return free[0]

    def remove(self, lora_int_id: int) -> None:
        """Frees the adapter's slot (zeroed, so a stale slot id reads as the base model)."""
        slot = self.slot_of(lora_int_id)
        if slot == 0:
            raise ValueError("lora_int_id 0 is the base model, not a loaded adapter")
        self._write(slot, None)
        del self._slot_by_id[lora_int_id]

    def slot_of(self, lora_int_id: int | None) -> int:
        """The slot holding adapter ``lora_int_id``; None or 0 -> 0 (base model)."""
        if not lora_int_id:
            return 0
        if lora_int_id not in self._slot_by_id:
            raise ValueError(f"unknown LoRA adapter id {lora_int_id}; loaded: "
                             f"{sorted(self._slot_by_id)}")  # fmt: skip
        return self._slot_by_id[lora_int_id]

    def slot_ids(self, lora_int_ids: list[int | None]) -> np.ndarray:
        """int32 [rows]: each row's slot (a batch's per-token adapter ids -> slot ids)."""
        return np.asarray([self.slot_of(i) for i in lora_int_ids], np.int32)

    def _write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Slot ``slot`` := adapter zero-padded to max_lora_rank (None: all zeros)."""
        n, r_max = self.num_layers, self.max_lora_rank
        for m, (d_in, d_out) in self.module_shapes.items():
            a = np.zeros((n, d_in, r_max), np.float32)
            b = np.zeros((n, r_max, d_out), np.float32)
            if adapter is not None and m in adapter.weights:
                wa, wb = adapter.weights[m]
                a[:, :, : adapter.rank], b[:, : adapter.rank, :] = wa, wb
            idx = jnp.asarray(slot, jnp.int32)
            self.a[m] = _set_slot(self.a[m], idx, jnp.asarray(a))
            self.b[m] = _set_slot(self.b[m], idx, jnp.asarray(b))
        self.scale = self.scale.at[slot].set(0.0 if adapter is None else adapter.scale)

    def attach(self, params: dict) -> dict:
        """A copy of a Llama-family parameter tree ({"params": ...} or its inside) with
        ``lora_a`` [L, slots, in, r_max], ``lora_b`` [L, slots, r_max, out] and
        ``lora_scale`` [L, slots] beside each servable module's kernel under ``layers``.
        The input tree is not modified; its arrays are shared, not copied."""
        if "params" in params:
            return {**params, "params": self.attach(params["params"])}
        layers = dict(params["layers"])
        for m in self.module_shapes:
            group = "self_attn" if m in ATTENTION_MODULES else "mlp"
            sub = dict(layers[group])
            sub[m] = {
                **sub[m],
                "lora_a": self.a[m],
                "lora_b": self.b[m],
                "lora_scale": jnp.broadcast_to(self.scale, (self.num_layers, self.num_slots)),
            }
            layers[group] = sub
        return {**params, "layers": layers}
