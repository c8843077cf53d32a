"""The handle a request names its adapter by, as vLLM's ``vllm.lora.request.LoRARequest``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter to serve a request with: ``lora_name`` (a human name), ``lora_int_id``
    (the identity: a positive int, unique per adapter; 0 is reserved for "no adapter",
    the slot table's slot 0) and ``lora_path`` (a PEFT checkpoint directory holding
    adapter_config.json and adapter_model.safetensors). Equality and hashing follow
    ``lora_int_id`` alone, as vLLM's: the id is what caches (slots, prefix-cache keys) key
    on, so two requests naming the same id share one loaded adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str = dataclasses.field(compare=False)
    # The served model it belongs to (vLLM's field; the server's /v1/models "parent").
    base_model_name: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1 (0 means no adapter), got "
                             f"{self.lora_int_id!r}")  # fmt: skip
        if not self.lora_path:
            raise ValueError("lora_path must name a PEFT adapter directory")

    @property
    def cache_salt(self) -> bytes:
        """The prefix cache's salt for this adapter's requests (``block_hashes``): the
        same prompt under two adapters (or an adapter and the base model) has different
        KV, so its blocks must never be shared. Id and name both, as vLLM keys on the
        name: two handles that differ in either never share blocks."""
        return f"lora:{self.lora_int_id}:{self.lora_name}".encode()

    def __hash__(self) -> int:
        return hash(self.lora_int_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_int_id == self.lora_int_id
