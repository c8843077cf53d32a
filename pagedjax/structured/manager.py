"""The structured-output manager: one per engine; picks the backend, compiles each
request's constraint once (cached, time-limited) and makes each sequence's Guide.

Contract: ``compile(params)`` runs at add_request, before the request touches engine
state, and raises ValueError naming the problem (an invalid schema, regex or grammar, a
keyword the chosen backend would not enforce, a compile over the time limit, a missing
backend package); nothing is lost. ``guide(compiled)`` is cheap (a matcher over the
shared compiled grammar), one per sample. Backends are imported on first use, so an
engine that never sees a constraint never imports them.

With ``config.reasoning_parser`` set and ``enable_in_reasoning`` false, ``guide`` and
``reasoning_gate`` take the request's prompt ids: a sample whose prompt did not end the
reasoning gets a gate in front of its constraint (reasoning.py: unconstrained until its
output ends with ``</think>``'s ids). ValueError at construction for an unknown parser.

Cost: a compile runs on a worker thread so it can be abandoned at ``compile_timeout_s``
(the thread finishes in the background: Python cannot stop it); the cache is keyed by
the backend and the constraint's canonical text (the tokenizer is the engine's own).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pagedjax.config import StructuredOutputsConfig
from pagedjax.sampling.params import StructuredOutputsParams
from pagedjax.structured import json_regex, spec, token_fsm
from pagedjax.structured.drafts import MAX_DRAFTS
from pagedjax.structured.reasoning import GatedGuide, ReasoningGate, ThinkTags
from pagedjax.structured.token_fsm import TokenFsm

BACKENDS = ("auto", "xgrammar", "guidance")

# stop_reason of a sequence finished because its grammar allowed no next token.
DEAD_END_REASON = "structured_output_dead_end"

_PACKAGES = {"xgrammar": "xgrammar", "guidance": "llguidance"}


def missing_backend_message(backend: str) -> str:
    """What to install for a backend whose package is missing."""
    return (
        f"structured outputs with backend {backend!r} need the {_PACKAGES[backend]!r}"
        " package: pip install pagedjax[structured]"
    )


class Guide(Protocol):
    """One sequence's grammar state on the host (backend_xgrammar / backend_guidance)."""

    backend: str

    def accept(self, token: int) -> bool: ...

    def fill_mask(self, out: np.ndarray) -> None: ...

    def is_terminated(self) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def jump_forward(self) -> list[int]: ...


@dataclass(frozen=True)
class Compiled:
    """A request's compiled constraint: which backend, and its handle."""

    backend: str
    handle: Any


@dataclass
class StructuredStats:
    """Counters since the engine started (``LLMEngine.stats``'s ``structured_*`` keys).
    device_fsm / host_masks: constrained samples given the device FSM / host masks while
    ``device_fsm`` is on; fsm_fallbacks: why the others were not (reason -> count)."""

    compiles: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0
    by_backend: dict[str, int] = field(default_factory=dict)
    device_fsm: int = 0
    host_masks: int = 0
    fsm_fallbacks: dict[str, int] = field(default_factory=dict)
    fsm_build_s: float = 0.0


class StructuredOutputManager:
    """See the module docstring. tokenizer: the engine's (HF or byte); vocab_size: the
    model's V (masks are [ceil(V / 32)] words); eos_ids: the ids that may end a
    constrained output where its grammar accepts termination."""

    def __init__(self, config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int,
                 eos_ids: list[int], max_rollback: int = 0):  # fmt: skip
        self.config = config
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._max_rollback = max_rollback
        self._backends: dict[str, Any] = {}
        self._cache: OrderedDict[tuple[str, str], Compiled] = OrderedDict()
        self._lock = threading.Lock()  # backends are built on the worker threads
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self.stats = StructuredStats()
        self._fsms: OrderedDict[str, TokenFsm | str] = OrderedDict()
        self._vocab: list[bytes | None] | None = None  # token bytes (token_fsm.vocab_bytes)
        # The think tags' ids when constraints start after the reasoning (else None).
        self.think = ThinkTags.for_config(config, tokenizer)

    def _backend(self, name: str) -> Any:
        with self._lock:
            if name not in self._backends:
                try:
                    if name == "xgrammar":
                        from pagedjax.structured.backend_xgrammar import XgrammarBackend as cls
                    else:
                        from pagedjax.structured.backend_guidance import GuidanceBackend as cls
                    self._backends[name] = cls(self._tokenizer, self.vocab_size, self._eos,
                                               self._max_rollback)  # fmt: skip
                except ImportError as e:
                    raise ValueError(missing_backend_message(name)) from e
            return self._backends[name]

    def compile(self, p: StructuredOutputsParams) -> Compiled:
        """The request's compiled constraint (see the module docstring)."""
        if p.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is an outlines option; the xgrammar"
                " and guidance backends take disable_any_whitespace instead"
            )
        cfg = self.config
        any_ws, closed = self._options(p)
        text = spec.constraint_text(p) + repr((any_ws, closed))
        for name in self._candidates(p):
            hit = self._cache.get((name, text))
            if hit is not None:
                self._cache.move_to_end((name, text))
                self.stats.cache_hits += 1
                return hit
        t0 = time.perf_counter()
        future = self._pool.submit(self._compile, p, any_ws, closed)
        try:
            compiled = future.result(timeout=cfg.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(
                f"compiling the {p.kind} constraint took longer than"
                f" compile_timeout_s={cfg.compile_timeout_s}"
            ) from None
        self.stats.compiles += 1
        self.stats.compile_s += time.perf_counter() - t0
        self.stats.by_backend[compiled.backend] = self.stats.by_backend.get(compiled.backend,
                                                                            0) + 1  # fmt: skip
        if cfg.cache_size:
            self._cache[(compiled.backend, text)] = compiled
            while len(self._cache) > cfg.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _candidates(self, p: StructuredOutputsParams) -> tuple[str, ...]:
        backend = self.config.backend
        if backend != "auto":
            return (backend,)
        # vLLM's "auto": xgrammar first; guidance when xgrammar refuses the constraint.
        # Structural tags are xgrammar's format only.
        return ("xgrammar",) if p.structural_tag is not None else ("xgrammar", "guidance")

    def _compile(self, p: StructuredOutputsParams, any_ws: bool, closed: bool) -> Compiled:
        names = self._candidates(p)
        errors = []
        bound = self.config.json_max_whitespace
        json_kind = p.json is not None or p.json_object
        for name in names:
            try:
                if name == "xgrammar" and bound and json_kind and any_ws:
                    return Compiled(name, self._backend(name).compile(p, any_ws, closed, bound))
                if bound and json_kind and any_ws:
                    raise ValueError(
                        f"structured_outputs_config.json_max_whitespace={bound} is"
                        f" xgrammar's max_whitespace_cnt; {name} cannot bound JSON"
                        " whitespace (set it to 0, or disable_any_whitespace)"
                    )
                backend = self._backend(name)
                return Compiled(name, backend.compile(p, any_ws, closed))
            except ValueError as e:
                errors.append(e)
                if len(names) == 1 or "pip install" in str(e):
                    raise
        raise ValueError("; ".join(f"{n}: {e}" for n, e in zip(names, errors, strict=True)))

    def _options(self, p: StructuredOutputsParams) -> tuple[bool, bool]:
        """(any_whitespace, disable_additional_properties) of a request under this config."""
        cfg = self.config
        return (not (cfg.disable_any_whitespace or p.disable_any_whitespace),
                cfg.disable_additional_properties or p.disable_additional_properties)  # fmt: skip

    def device_fsm(self, p: StructuredOutputsParams, backend: str) -> TokenFsm | str:
        """The constraint's token DFA for the device (``config.device_fsm``), or why it
        gets none (a reason string: the host path). backend: the one that compiled the
        constraint (a JSON schema's FSM follows xgrammar's language, so only xgrammar's
        JSON rows take it). Built on the worker pool within compile_timeout_s and cached
        by the constraint's text and options, reasons included."""
        if p.kind not in ("regex", "choice", "json", "json_object"):
            return f"{p.kind} constraints take the host path"
        if p.kind in ("json", "json_object") and backend != "xgrammar":
            return (f"JSON schemas compiled by {backend} take the host path (the device FSM"
                    " follows xgrammar's JSON language)")  # fmt: skip
        any_ws, closed = self._options(p)
        if p.kind in ("json", "json_object") and any_ws and self.config.json_max_whitespace:
            return "JSON with json_max_whitespace takes the host path (xgrammar's bound)"
        key = spec.constraint_text(p) + repr((any_ws, closed))
        hit = self._fsms.get(key)
        if hit is not None:
            self._fsms.move_to_end(key)
            return hit
        t0 = time.perf_counter()
        future = self._pool.submit(self._build_fsm, p, any_ws, closed)
        try:
            got: TokenFsm | str = future.result(timeout=self.config.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            limit = self.config.compile_timeout_s
            got = f"building the FSM took longer than compile_timeout_s={limit}"
        except token_fsm.FsmUnavailable as e:
            got = str(e)
        self.stats.fsm_build_s += time.perf_counter() - t0
        self._fsms[key] = got
        while len(self._fsms) > max(self.config.cache_size, 1):
            self._fsms.popitem(last=False)
        return got

    def _build_fsm(self, p: StructuredOutputsParams, any_ws: bool, closed: bool) -> TokenFsm:
        if p.kind in ("json", "json_object"):
            regex = json_regex.json_schema_regex(spec.schema_dict(p, closed), any_ws)
        else:
            regex = token_fsm.regex_of(p.kind, getattr(p, p.kind))
        with self._lock:
            if self._vocab is None:
                self._vocab = token_fsm.vocab_bytes(self._tokenizer, self.vocab_size)
        return token_fsm.build_token_fsm(regex, self._vocab, self._eos,
                                         self.config.device_fsm_max_bytes)  # fmt: skip

    def guide(self, compiled: Compiled, prompt_ids: Any = None) -> Guide:
        """A fresh matcher at the start of the constraint, for one sequence; behind a
        reasoning gate (``GatedGuide``) when ``reasoning_gate(prompt_ids)`` gives one."""
        guide = self._backend(compiled.backend).guide(compiled.handle)
        gate = self.reasoning_gate(prompt_ids)
        return guide if gate is None else GatedGuide(guide, gate)

    def reasoning_gate(self, prompt_ids: Any) -> ReasoningGate | None:
        """A sample's reasoning gate: None when nothing is gated (no reasoning parser,
        enable_in_reasoning, prompt_ids None) or the prompt already ended the reasoning."""
        if self.think is None or prompt_ids is None:
            return None
        # Speculative drafts roll the gate back (structured/drafts.py): up to MAX_DRAFTS.
        return self.think.gate(prompt_ids, max(self._max_rollback, MAX_DRAFTS))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = [
    "BACKENDS",
    "DEAD_END_REASON",
    "Compiled",
    "Guide",
    "StructuredOutputManager",
    "StructuredStats",
    "missing_backend_message",
]
