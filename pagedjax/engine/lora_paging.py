"""Unified paging (S-LoRA): resident LoRA adapters occupy blocks of the KV pool itself.

``lora_memory="unified"`` (docs/lora.md, "Unified memory"). Loading adapter i of rank r
onto the device lends ceil(r * S / F) blocks out of the KV block pool (the policy's
``lend_blocks``: the same free list the scheduler allocates sequences from, so KV
admission and growth see them gone) and writes the adapter's weights into those blocks'
K and V pages (``model/lora_pages.py``: rank-major, float32 bits in the pool's dtype);
evicting it returns the blocks to the free list. The step reads the adapters through a
page table that travels in the parameters (``PagedLoRA``: pages, rank, scale per slot),
so shapes depend only on (max_loras, max_lora_rank) and nothing recompiles.

This object is the host's bookkeeping of that: which adapter id sits in which slot, its
blocks, and the page table. It decides nothing about *when* to load or evict (that is
``LoRAManager.admit``'s), and it never evicts on its own. Invariant (tested): the pool's
free blocks + the blocks held by sequences + ``lent()`` == the usable blocks.

Refused: a quantized (8-bit values + scales) KV pool (its pages are not raw bytes), a
non-paged memory policy (no block pool to lend from).
"""

from __future__ import annotations

import jax
import numpy as np

from pagedjax.engine.device_state import DeviceState
from pagedjax.lora import LoRAAdapter
from pagedjax.lora.checkpoint import ATTENTION_MODULES
from pagedjax.model.lora_pages import (
    PAGED_KEY,
    PagedLoRA,
    block_floats,
    layout_adapter,
    pages_for_rank,
    rank_slice_floats,
    to_pages,
)


class AdapterPages:
    """Adapters in KV blocks (module docstring). module_shapes: {module: (in, out)};
    max_loras: slots (besides slot 0, the base model); max_lora_rank: the largest rank
    (the page table's width: pages of one max-rank adapter)."""

    def __init__(self, module_shapes: dict[str, tuple[int, int]], num_layers: int,
                 max_loras: int, max_lora_rank: int, device: DeviceState):  # fmt: skip
        k_pool = jax.tree.leaves(device.kv)[0]
        if not isinstance(device.kv, tuple) or len(jax.tree.leaves(device.kv)) != 2:
            raise ValueError("lora_memory='unified' pages adapters in the KV pool's raw pages;"
                             " a quantized KV cache (8-bit values with scales) has none: use"
                             " lora_memory='separate' (or 'static')")  # fmt: skip
        if not hasattr(device.policy, "lend_blocks"):
            raise ValueError("lora_memory='unified' needs the paged block pool")
        self.device = device
        self.num_layers, self.max_loras, self.max_rank = num_layers, max_loras, max_lora_rank
        self.modules = tuple(("self_attn" if m in ATTENTION_MODULES else "mlp", m, i, o)
                             for m, (i, o) in module_shapes.items())  # fmt: skip
        self.slice_floats = rank_slice_floats(self.modules)
        self.page_shape = tuple(k_pool.shape[2:])
        self.dtype = k_pool.dtype
        self.per_block = block_floats(k_pool.shape, k_pool.dtype.itemsize)
        self.max_pages = pages_for_rank(max_lora_rank, self.slice_floats, self.per_block)
        self.usable = k_pool.shape[1] - 1  # block 0 is the null block
        slots = max_loras + 1
        self.pages = np.zeros((slots, self.max_pages), np.int32)
        self.rank = np.zeros(slots, np.int32)
        self.scale = np.zeros(slots, np.float32)
        self.slot_by_id: dict[int, int] = {}
        self.blocks_by_id: dict[int, np.ndarray] = {}

    def pages_needed(self, rank: int) -> int:
        """Blocks an adapter of ``rank`` occupies."""
        return pages_for_rank(rank, self.slice_floats, self.per_block)

    def lent(self) -> int:
        """Blocks the resident adapters hold now."""
        return sum(len(b) for b in self.blocks_by_id.values())

    def has_free_slot(self) -> bool:
        return len(self.slot_by_id) < self.max_loras

    def load(self, lora_int_id: int, adapter: LoRAAdapter) -> bool:
        """Lend the adapter's blocks from the pool, write its weights there, give it a
        free slot. False (nothing changed) when the pool has too few free blocks; a full
        slot table is the caller's error (ValueError)."""
        if lora_int_id in self.slot_by_id:
            return True
        if not self.has_free_slot():
            raise ValueError(f"all {self.max_loras} adapter slots are in use")
        n = self.pages_needed(adapter.rank)
        blocks = self.device.lend_blocks(n, self.max_pages)
        if blocks is None:
            return False
        flat = np.zeros((self.num_layers, self.max_pages * self.per_block), np.float32)
        data = layout_adapter(adapter.weights, adapter.rank, self.modules, self.num_layers)
        flat[:, : data.shape[1]] = data
        self.device.write_lent_pages(blocks, to_pages(flat, self.dtype, self.page_shape))
        slot = min(set(range(1, self.max_loras + 1)) - set(self.slot_by_id.values()))
        self.pages[slot, :n] = blocks
        self.rank[slot], self.scale[slot] = adapter.rank, adapter.scale
        self.slot_by_id[lora_int_id] = slot
        self.blocks_by_id[lora_int_id] = blocks
        return True

    def evict(self, lora_int_id: int) -> None:
        """Return the adapter's blocks to the pool and empty its slot."""
        slot = self.slot_by_id.pop(lora_int_id)
        self.device.return_blocks(self.blocks_by_id.pop(lora_int_id), self.max_pages)
        self.pages[slot] = 0
        self.rank[slot], self.scale[slot] = 0, 0.0

    def slot_of(self, lora_int_id: int | None) -> int:
        """The slot of a resident adapter; None / 0 -> 0 (the base model)."""
        return self.slot_by_id[lora_int_id] if lora_int_id else 0

    def attach(self, params: dict) -> dict:
        """A copy of a Llama-family tree ({"params": ...} or its inside) with the page
        table as ``layers["lora_paged"]`` (``PagedLoRA``, each field stacked over the
        layers: the layer loop slices it and ``materialize`` reads the pool)."""
        if "params" in params:
            return {**params, "params": self.attach(params["params"])}
        n = self.num_layers
        paged = PagedLoRA(np.broadcast_to(self.pages, (n, *self.pages.shape)).copy(),
                          np.broadcast_to(self.rank, (n, *self.rank.shape)).copy(),
                          np.broadcast_to(self.scale, (n, *self.scale.shape)).copy(),
                          self.modules, self.max_rank)  # fmt: skip
        return {**params, "layers": {**params["layers"], PAGED_KEY: jax.device_put(paged)}}


__all__ = ["AdapterPages"]
