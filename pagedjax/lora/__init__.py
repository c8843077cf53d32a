"""Multi-LoRA serving, the foundation (docs/lora.md): the request handle (``LoRARequest``),
the PEFT checkpoint loader (``load_peft_adapter``), the fixed-shape adapter slot table
(``LoRASlotTable``) and the per-row delta matmuls the model's linears add to their output
(``lora_delta``: the gathered or the dense form by shape; ``lora_delta_grouped``)."""

from pagedjax.lora.checkpoint import (
    LLAMA_TARGET_MODULES,
    LoRAAdapter,
    llama_module_shapes,
    load_peft_adapter,
)
from pagedjax.lora.request import LoRARequest
from pagedjax.lora.slots import LORA_SEQ_SLOTS, LoRASlotTable, slot_table_bytes, split_seq_slots
from pagedjax.model.lora_delta import (
    benchmark_lora_delta,
    lora_delta,
    lora_delta_dense,
    lora_delta_form,
    lora_delta_gathered,
    lora_delta_grouped,
)

__all__ = [
    "LLAMA_TARGET_MODULES",
    "LORA_SEQ_SLOTS",
    "LoRAAdapter",
    "LoRARequest",
    "LoRASlotTable",
    "benchmark_lora_delta",
    "llama_module_shapes",
    "load_peft_adapter",
    "lora_delta",
    "lora_delta_dense",
    "lora_delta_form",
    "lora_delta_gathered",
    "lora_delta_grouped",
    "slot_table_bytes",
    "split_seq_slots",
]
