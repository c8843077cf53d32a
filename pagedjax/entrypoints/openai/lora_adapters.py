"""The server's LoRA adapters by name: the static ``--lora-modules`` and those loaded at run
time through vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
(docs/lora.md).

Runtime updating is off unless the environment variable
``PAGEDJAX_ALLOW_RUNTIME_LORA_UPDATING`` is true ("1" / "true", vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): loading code paths named by a client is an
operator's decision. vLLM does not register the two routes then (a bare 404); here they
answer 404 with a message naming the variable.

- load ``{"lora_name", "lora_path"}``: the name must be new (neither an adapter's nor a
  served base model's); the adapter gets the next id (ids are never reused, so nothing
  cached under an old id, in the engine or its prefix cache, can ever be mistaken for a
  new adapter) and the engine reads and checks it now (``add_lora``, through the engine
  client: in the core process by default), so a missing or corrupt checkpoint, a rank
  above ``max_lora_rank``, target modules the model lacks or an adapter for another base
  is this call's 400 and nothing changes. Then it is in /v1/models and usable as
  ``"model"``. 200 with vLLM's text "Success: LoRA adapter 'x' added successfully.".
- unload ``{"lora_name"}`` (or ``"lora_int_id"``): as vLLM, the name is gone at once (a
  new request naming it is a 404 "The model `x` does not exist."), while requests
  already added keep their adapter to the end: the engine frees its host copy and device
  slot only when none of them is unfinished (``LoRAManager.remove``: deferred, never
  refused). An unknown name is vLLM's 404 "The lora adapter 'x' cannot be found.".

One asyncio lock orders loads and unloads (a name checked free stays free until its
load has finished or failed).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.openai.limits import error_for
from pagedjax.entrypoints.openai.protocol import JsonFields, OpenAIError, bad

if TYPE_CHECKING:  # pagedjax.lora imports JAX: only when an adapter is loaded
    from pagedjax.lora import LoRARequest

log = logging.getLogger("pagedjax.server")

RUNTIME_LORA_ENV = "PAGEDJAX_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``RUNTIME_LORA_ENV`` is set true ("1" or "true", any case), as vLLM reads
    its variable."""
    return environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


class LoRAAdapters:
    """{name: LoRARequest} of the adapters served by name (module docstring).

    engine: the server's AsyncLLMEngine; base_names: the served model names (an adapter
    may not take one); modules: the static adapters (``--lora-modules``, ids from 1);
    allow_runtime: whether load / unload are on (None: ``runtime_updating_allowed()``)."""

    def __init__(self, engine: AsyncLLMEngine, base_names: list[str],
                 modules: dict[str, LoRARequest] | None = None,
                 allow_runtime: bool | None = None):  # fmt: skip
        self.engine = engine
        self.base_names = list(base_names)
        self.modules: dict[str, LoRARequest] = dict(modules or {})
        self.allow_runtime = runtime_updating_allowed() if allow_runtime is None else allow_runtime
        self._next_id = max((r.lora_int_id for r in self.modules.values()), default=0) + 1
        self._lock = asyncio.Lock()

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter served as ``name`` (None: not an adapter's name)."""
        return None if name is None else self.modules.get(name)

    def _check_allowed(self) -> None:
        if not self.allow_runtime:
            raise OpenAIError(404, f"loading and unloading LoRA adapters at run time is off:"
                                   f" start the server with {RUNTIME_LORA_ENV}=true")  # fmt: skip

    async def load(self, body: Any) -> str:
        """POST /v1/load_lora_adapter (module docstring); the success text."""
        self._check_allowed()
        b = JsonFields(body, {"lora_name", "lora_path", "load_inplace"})
        name, path = b.str("lora_name"), b.str("lora_path")
        if not name or not path:
            raise bad("Both 'lora_name' and 'lora_path' must be provided.")
        if b.bool("load_inplace", False):  # vLLM's replace-in-place of a loaded name
            raise bad("load_inplace is not supported: unload the adapter, then load it",
                      "load_inplace")  # fmt: skip
        b.warn_unknown("load_lora_adapter")
        from pagedjax.lora import LoRARequest

        async with self._lock:
            if name in self.modules:
                raise bad(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            if name in self.base_names:
                raise bad(f"'{name}' is a served base model name; an adapter needs another",
                          "lora_name")  # fmt: skip
            lora = LoRARequest(name, self._next_id, path)
            self._next_id += 1  # never reused, even after a failed load
            try:
                await self.engine.add_lora(lora)
            except (ValueError, TypeError) as e:  # the adapter's fault: a 400
                raise bad(str(e), "lora_path") from None
            except Exception as e:  # noqa: BLE001 - limits.error_for's table (a dead engine)
                raise error_for(e) from e
            self.modules[name] = lora
        log.info("loaded LoRA adapter %r (id %d) from %s", name, lora.lora_int_id, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: Any) -> str:
        """POST /v1/unload_lora_adapter (module docstring); the success text."""
        self._check_allowed()
        b = JsonFields(body, {"lora_name", "lora_int_id"})
        name, lora_id = b.str("lora_name"), b.int("lora_int_id")
        if not name and lora_id is None:
            raise bad("'lora_name' needs to be provided to unload a LoRA adapter.")
        b.warn_unknown("unload_lora_adapter")
        async with self._lock:
            if name:
                lora = self.modules.get(name)
            else:
                lora = next((r for r in self.modules.values() if r.lora_int_id == lora_id), None)
            if lora is None or (lora_id is not None and lora.lora_int_id != lora_id):
                raise OpenAIError(404, f"The lora adapter '{name or lora_id}' cannot be found.",
                                  "lora_name")  # fmt: skip
            del self.modules[lora.lora_name]  # new requests: 404 from now on
            try:
                await self.engine.remove_lora(lora.lora_int_id)
            except Exception as e:  # noqa: BLE001 - the name is gone either way
                raise error_for(e) from e
        log.info("unloaded LoRA adapter %r (id %d)", lora.lora_name, lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."


__all__ = ["RUNTIME_LORA_ENV", "LoRAAdapters", "runtime_updating_allowed"]
