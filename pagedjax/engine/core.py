"""The engine core: what one iteration reads and writes, shared by every way to run one.

Four modules drive iterations of the same engine: the one-step path (``llm_engine``),
the K-step decode loop (``multi_step``), warm-up (``warmup``) and beam search
(``beams``). They share this object, not each other's private members: the device state
(``DeviceState``: scheduler state, KV pool, token buffer, sampling rows), the host
bookkeeping (``RequestBook``: requests, queue, slot owners), the model runner and the
prefix-cache hint, plus the engine's fixed sizes and the counters a step adds to.
``LLMEngine`` builds one and is the public API over it; the layering inside
``pagedjax/engine/`` runs llm_engine / beams -> multi_step, warmup -> core ->
device_state, request_book (tests/test_import_layers.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedjax.engine.device_state import DeviceState
from pagedjax.engine.request_book import RequestBook
from pagedjax.engine.sequence import RequestState, SequenceState
from pagedjax.memory.prefix_cache import PrefixIndex
from pagedjax.memory.radix_hint import RadixHint


@dataclass
class SharingCounters:
    """Block-sharing and prefix-cache counters since the last reset (``LLMEngine.stats``).

    steps: iterations in which some sequence held blocks; saved_frac_sum: sum over them
    of 1 - used / unshared; used_sum, unshared_sum: the sums of both; lookup_tokens,
    hit_tokens: tokens looked up in / reused from the prefix cache.
    """

    steps: int = 0
    saved_frac_sum: float = 0.0
    used_sum: int = 0
    unshared_sum: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0

    def record_usage(self, used: int, unshared: int) -> None:
        """One iteration's blocks referenced (used) and blocks without sharing."""
        if unshared > 0:
            self.steps += 1
            self.saved_frac_sum += 1.0 - used / unshared
            self.used_sum += used
            self.unshared_sum += unshared


@dataclass
class EngineCore:
    """See the module docstring. Sizes are fixed at construction; ``params`` may be
    replaced (same tree structure and shapes) between steps."""

    params: Any
    runner: Any  # model_runner.ModelRunner
    device: DeviceState
    book: RequestBook
    prefix_index: PrefixIndex | RadixHint  # CacheConfig.prefix_index
    block_size: int
    max_seqs: int  # scheduler slots = most sequences in one step (max_num_seqs)
    max_model_len: int
    max_blocks_per_seq: int
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    enable_prefix_caching: bool
    sharing: SharingCounters = field(default_factory=SharingCounters)
    # kv_scales="calibrate": called once with the first admitted prompts, then None
    # (kv_calibration.calibrate_core; admission.assign_slots calls it).
    kv_calibration: Any = None
    num_steps: int = 0  # engine iterations run (one-step path and decode loop)
    # logit_controls.LogitControls: dynamic masks (min_tokens, bad_words, grammars).
    controls: Any = None
    # lora_manager.LoRAManager when LoRA is on (None: off); params is then its params().
    lora: Any = None
    # kv_offload.HostTier: prefix blocks evicted from the device kept on the host
    # (kv_offloading_size > 0); None when off.
    host_tier: Any = None
    # multimodal.MultiModalRunner when the model takes images: ``begin_pass()`` then
    # ``admit(request)`` per queued request (False: it waits, its images being encoded
    # under the encoder budget). None: every request is admitted as slots allow.
    admit_gate: Any = None
    # mrope.RopeDeltas for an M-RoPE model (Qwen2-VL): each slot's rotary offset, in the
    # step's parameters (params is then its params()); None for every other model.
    rope_deltas: Any = None

    def __post_init__(self) -> None:
        if self.rope_deltas is not None:
            self.params = self.rope_deltas.params(self.params)

    def take_slot(self, req: RequestState, seq: SequenceState) -> int:
        """Bind a free slot to seq: owner, token-buffer row (prompt + any output kept for
        a recompute) and sampling row. Returns the slot."""
        slot = self.book.bind_slot(req, seq)
        if req.metrics.first_scheduled_time is None:  # serving metrics (queue time)
            req.metrics.first_scheduled_time = time.monotonic()
        ids = req.prompt_token_ids + seq.detok.ids
        row = np.zeros(self.max_model_len, np.int32)
        row[: len(ids)] = ids
        self.device.set_token_row(np.int32(slot), row)
        self.device.set_sampling_row(slot, seq.params, seq.index, len(seq.detok.ids))
        if self.lora is not None:  # the slot's adapter (admitted: resident) for its rows
            self.lora.bind(slot, req.lora_request)
            self.params = self.lora.params()
        if self.rope_deltas is not None:  # the request's M-RoPE offset for its decode rows
            self.rope_deltas.bind(slot, req)
            self.params = self.rope_deltas.params(self.params)
        return slot

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop these requests now (``LLMEngine.abort_request``): their slots and blocks
        are freed at once; unknown ids are ignored."""
        mask = np.zeros(self.max_seqs, bool)
        for rid in request_ids:
            req = self.book.drop(rid)
            for seq in req.seqs if req is not None else ():
                if seq.slot is not None:
                    mask[seq.slot] = True
                    self.book.release_slot(seq)
        if mask.any():
            self.device.abort(np.arange(self.max_seqs, dtype=np.int32), mask)

    def stop_samples(self, request_id: str, indices: Iterable[int]) -> None:
        """End these samples of a request now, as a stop string ends them: the engine
        core process' client matches stop strings in the API process and sends this
        when one ends a sample. Their slots and blocks are freed before the next step
        (shared blocks stay with the other samples); the request is forgotten when no
        sample is left, without another output (the client already has the final one).
        Unknown requests, indices and finished samples are ignored."""
        req = self.book.requests.get(request_id)
        if req is None:
            return
        wanted = set(indices)
        mask = np.zeros(self.max_seqs, bool)
        for seq in req.seqs:
            if seq.index not in wanted or seq.finish_reason is not None:
                continue
            seq.finish_reason = "stop"
            if seq.slot is not None:
                mask[seq.slot] = True
                self.book.release_slot(seq)
        req.pending = [s for s in req.pending if s.finish_reason is None]
        self.book.unqueue(req, [s for s in req.seqs if s.finish_reason is not None])
        if req.finished:
            self.book.drop(request_id)
        if mask.any():
            self.device.abort(np.arange(self.max_seqs, dtype=np.int32), mask)


class CoreView:
    """A read-write attribute of the engine that is its core's ``core.<path>`` (e.g.
    ``LLMEngine.kv`` is ``engine.core.device.kv``): one copy of each piece of state, and
    the engine's public attribute names stay as they were."""

    def __init__(self, path: str, doc: str = ""):
        self.path = path.split(".")
        self.__doc__ = doc or f"The engine core's ``{path}``."

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        x = obj.core
        for name in self.path:
            x = getattr(x, name)
        return x

    def __set__(self, obj: Any, value: Any) -> None:
        x = obj.core
        for name in self.path[:-1]:
            x = getattr(x, name)
        setattr(x, self.path[-1], value)


__all__ = ["CoreView", "EngineCore", "SharingCounters"]
