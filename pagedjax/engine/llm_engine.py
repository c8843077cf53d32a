"""LLMEngine: requests in, streamed RequestOutputs out, one iteration per ``step()``.

One step, whatever runs on the device (docs/engine.md, docs/architecture.md):

1. host: give queued sequences free slots; one jitted ``add_requests`` for all of them.
   When nothing needs the host between iterations, the fused K-step decode program
   runs instead of 2-6 (``multi_step.py``) and its tokens go to step 5's processor.
2. host: with speculative decoding, plan each decoding slot's speculative slots and
   the n-gram drafts (``spec/decoder.py``).
3. device: ``schedule`` (jitted) picks rows, budgets their tokens (drafts included)
   and grows their blocks; host: read back the batch's sizes and rows (one sync) to
   pick the bucket (T, S); swap copies the schedule decided (``swap_copies.py``).
4. device: one program for (T, S): the ModelRunner step (ragged input from the device
   token buffer, copy-on-write copies, forward with the KV donated, sample, append the
   ids), or, when rows have drafts, the verification program. With grammar masks to
   fill, forward and sampling as two programs, the masks filled between them.
5. host: the output processor (``output_processor.py``) reads the sampled ids (second
   sync), records them (detokenize; EOS / stop ids / stop strings / length), registers
   filled prefix blocks, forks n > 1 samples.
6. device: ``update`` with the stop mask and the accepted drafts (rollback of rejected
   ones), then ``recycle`` of finished slots (async); host: release, retire, outputs.

Token ids live in both places: the device buffer ``int32[max_seqs, max_model_len]``
feeds the model (the host never uploads a batch); the host keeps them for detokenization
(``detokenize=False``: ids only, the engine core process' client detokenizes).
Block sharing (docs/engine.md): with prefix caching on, a sequence admitted to a slot
(new, or preempted by recompute) first reuses the verified cached blocks of its longest
cached prefix (``sharing.attach_hits``), and the blocks each step fills are registered
after it (``sharing.register_step``). A request with n > 1 prefills its prompt once as
sample 0; when that prompt is done, samples 1..n-1 fork its blocks into their own slots.

Sequence groups and swap (docs/engine.md): a request's samples form a group, preempted
all or nothing; a group preempted by swap has its blocks copied to a host KV pool (numpy,
``swap_space`` GiB) in step 3b, before the step's forward overwrites the freed device
blocks, and back into fresh device blocks when it is swapped in.

State (docs/architecture.md): device arrays in ``DeviceState`` (``device_state.py``),
host bookkeeping in ``RequestBook`` (``request_book.py``), both in one ``EngineCore``
(``core.py``) that the decode loop, warm-up and beam search share through public
methods; ``state``, ``kv``, ``book`` and ``params`` here are views of the core's.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from pagedjax import compile_cache
from pagedjax.attention import select_attention_backend
from pagedjax.compile_cache import CompileCounter
from pagedjax.config import EngineConfig
from pagedjax.engine import admission
from pagedjax.engine import lora_manager as lora
from pagedjax.engine.buckets import pick, seq_buckets_for, seqs_for_tokens, step_buckets
from pagedjax.engine.core import CoreView, EngineCore
from pagedjax.engine.device_state import DeviceState, num_host_blocks
from pagedjax.engine.engine_stats import engine_stats
from pagedjax.engine.kv_budget import num_kv_blocks, profile_forward
from pagedjax.engine.kv_cache_spec import KVCacheSpec
from pagedjax.engine.kv_offload import build_host_tier
from pagedjax.engine.logit_controls import LogitControls
from pagedjax.engine.model_runner import ModelRunner
from pagedjax.engine.multi_step import MultiStepDecoder, resolve_num_steps
from pagedjax.engine.multimodal import MultiModalRunner, VisionModel, load_engine_model, split_mm
from pagedjax.engine.output_processor import OutputProcessor, SampledRows
from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.parallel import DevicePlacement
from pagedjax.engine.prompts import (
    check_request,
    check_request_args,
    record_prompt_logprobs,
    tokenize_prompt,
)
from pagedjax.engine.request_book import RequestBook
from pagedjax.engine.schedule_readback import read_schedule
from pagedjax.engine.sequence import RequestState
from pagedjax.engine.spec.decoder import build_speculator, load_draft
from pagedjax.engine.spec.verify import sampled_offsets
from pagedjax.engine.step_record import StepObserver, notify
from pagedjax.engine.swap_copies import apply_swap_copies
from pagedjax.engine.unbuilt import reject_unbuilt_features
from pagedjax.engine.warmup import warm_up
from pagedjax.lora import LoRARequest
from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.memory.radix_hint import prefix_hint
from pagedjax.model import ModelArch, compute_dtype
from pagedjax.sampling import SamplingParams
from pagedjax.sampling.params import MAX_SEED
from pagedjax.scheduler import SchedulerLimits
from pagedjax.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_LOGPROBS = 20  # vLLM's max_logprobs default


class LLMEngine:
    """The serving engine over one model (see the module docstring for one step).

    arch, params: the model (params in their compute dtype). tokenizer: for text prompts,
    detokenization and EOS. config: EngineConfig (cache / scheduler / model sections).
    kv_dtype: the pool's dtype under cache.cache_dtype "auto" (default: the params' dtype).
    """

    def __init__(
        self,
        arch: ModelArch,
        params: Any,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        kv_dtype: Any = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        kv_fill_value: float = 0.0,
        devices: Sequence[Any] | None = None,
        detokenize: bool = True,
        vision: VisionModel | None = None,
    ):
        reject_unbuilt_features(config)
        self.detokenize, self.mm = detokenize, MultiModalRunner.build(vision, config, arch)
        compile_cache.enable(config.compilation_cache)  # idempotent
        cc, sc, par = config.cache, config.scheduler, config.parallel  # par: TP (parallel.py)
        self.arch, self.tokenizer, self.config = arch, tokenizer, config
        dtype = compute_dtype(params)  # not a quantized weight's int codes
        self.kv_spec = KVCacheSpec.resolve(arch, dtype, cc.cache_dtype, kv_dtype, cc.kv_scales)
        self.placement = place = DevicePlacement(
            arch, par.tensor_parallel_size, devices, par.pipeline_parallel_size,
            par.pipeline_layer_partition, par.pipeline_microbatches)  # fmt: skip
        params = place.params(params, self.kv_spec)  # refuses what is not sharded yet
        log.info("devices: %s", place.describe())
        self.max_model_len = config.model.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's"
                             f" max_position_embeddings={arch.max_position_embeddings}")
        self.block_size = cc.block_size
        self.max_seqs = sc.max_num_seqs  # slots (vLLM's max_num_seqs); the queue waits on the host
        max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        backend = select_attention_backend(place.backend_request(config.attention_backend))
        log.info("attention backend: %s (%s)", backend.name, backend.reason)
        self.attention_backend = backend.name  # "native_cpu", "reference", "pallas" or "triton"
        place.check_attention_backend(backend.name)  # PP: the GPU kernels are not tested
        attention = place.attention(backend.ragged_paged_attention)
        self.runner = ModelRunner(arch, self.block_size, attention, max_logprobs,
                                  place.num_devices == 1, place.layer_stack)  # fmt: skip
        self.max_logprobs, self.max_blocks_per_seq = max_logprobs, max_blocks_per_seq
        budget = sc.max_num_batched_tokens
        self.token_buckets = step_buckets(budget, smallest=min(16, budget))
        self.seq_buckets = seq_buckets_for(self.token_buckets, self.max_seqs)  # S from T
        draft, kv_per_token = load_draft(config.speculative, config.model.model, arch, tokenizer,
                                         self.kv_spec, self.max_model_len, config.model.seed)
        self.num_blocks = num_kv_blocks(  # per device: its share of each block
            kv_bytes_per_token=place.kv_share(kv_per_token),
            block_size=self.block_size,
            max_blocks_needed=self.max_seqs * max_blocks_per_seq,
            num_gpu_blocks_override=cc.num_gpu_blocks_override,
            kv_cache_memory_bytes=cc.kv_cache_memory_bytes,
            gpu_memory_utilization=cc.gpu_memory_utilization,
            device=place.device,
            # PP: an unpipelined profile would gather every stage's weights (docs/parallelism.md)
            profile=None if place.pipeline else functools.partial(
                profile_forward, arch, params, self.kv_spec, self.block_size, budget,
                self.max_seqs, max_blocks_per_seq,
            ),
            # LoRA's unified memory: the adapter slots share the KV budget (lora_manager.py)
            reserved_bytes=lora.lora_reserved_bytes(config.lora, arch), reserved_for="LoRA slots",
        )
        self.num_host_blocks = num_host_blocks(
            cc.swap_space,
            kv_per_token * self.block_size,
            self.max_seqs * max_blocks_per_seq,
            sc.preemption_mode,
        )
        tier = build_host_tier(config, kv_per_token * self.block_size)  # in the host pool
        self.num_host_blocks += tier.capacity if tier is not None else 0
        self.policy = PagedPolicy(
            self.num_blocks, self.block_size, self.max_seqs, max_blocks_per_seq,
            watermark_frac=sc.watermark, enable_prefix_caching=cc.enable_prefix_caching,
            num_host_blocks=self.num_host_blocks, track_evictions=tier is not None,
            eviction_policy=cc.eviction_policy)  # fmt: skip
        self.enable_prefix_caching = cc.enable_prefix_caching
        self.sched_limits = SchedulerLimits(
            max_seqs=self.max_seqs, max_num_batched_tokens=budget,
            max_num_seqs=self.max_seqs, max_model_len=self.max_model_len,
            mode=sc.scheduling_mode, priority=sc.policy, preemption_mode=sc.preemption_mode,
        )  # fmt: skip
        log.info("%s", self.kv_spec.describe(self.num_blocks, self.block_size))
        kv = place.allocate_kv(self.kv_spec, self.num_blocks, self.block_size, kv_fill_value)
        device_state = DeviceState(self.policy, self.sched_limits, kv, vocab_size=arch.vocab_size,
                                   max_model_len=self.max_model_len,
                                   num_host_blocks=self.num_host_blocks)  # fmt: skip
        place.place_state(device_state)
        self.speculator = build_speculator(config.speculative, arch, self.block_size, attention,
                                           max_logprobs, self.policy, draft, place.num_devices == 1)
        k = resolve_num_steps(sc.num_multi_steps, place.device.platform)  # multi_step.py
        spec = self.speculator
        # Speculation with a drafting model runs one step at a time (its proposals are
        # separate programs); the n-gram method runs inside the fused K-step program.
        num_steps = 1 if spec is not None and not spec.fusable else k
        self.multi_step = MultiStepDecoder(self.runner, self.policy, self.sched_limits,
                                           num_steps, spec)  # fmt: skip
        eos = {i for i in (*arch.eos_token_ids, tokenizer.eos_token_id) if i is not None}
        self.core = EngineCore(
            params=params, runner=self.runner, device=device_state,
            book=RequestBook(self.max_seqs, eos),
            prefix_index=prefix_hint(cc.prefix_index, self.block_size),
            block_size=self.block_size, max_seqs=self.max_seqs, max_model_len=self.max_model_len,
            kv_calibration=self.kv_spec.calibrator(),
            max_blocks_per_seq=max_blocks_per_seq, token_buckets=self.token_buckets,
            seq_buckets=self.seq_buckets, enable_prefix_caching=self.enable_prefix_caching,
            controls=LogitControls(arch.vocab_size, tokenizer, config.structured_outputs, eos,
                                   place.device.platform),
            host_tier=tier, admit_gate=self.mm, rope_deltas=getattr(self.mm, "rope_deltas", None),
        )  # fmt: skip
        if config.lora is not None:  # adapters in the step's parameters (lora_manager.py)
            self.core.lora = lora.LoRAManager.for_core(self.core, config.lora, arch, params)
            self.core.params = self.core.lora.params()
        self.outputs = OutputProcessor(self.core)  # the host half of every step
        self.reset_stats()
        self.step_observers: list[StepObserver] = []  # add_step_observer
        self._rng = np.random.default_rng(config.model.seed)
        self.num_preemptions = 0
        # Start-up compilation, counted (programs, and how many came from the cache).
        self.startup_compiles = CompileCounter()
        if config.warmup != "none":
            with self.startup_compiles:
                self.warmup(mode=config.warmup, progress=True)
            log.info("warm-up: %s", self.startup_compiles.summary())

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> LLMEngine:
        """Load config.model (directory or preset; compilation cache on first), build."""
        reject_unbuilt_features(config)  # before spending time on loading weights
        compile_cache.enable(config.compilation_cache)
        arch, params, tokenizer, vision = load_engine_model(config.model)  # vision: LLaVA, Idefics3
        return cls(arch, params, tokenizer, config, vision=vision, **kwargs)

    # Views of the core's state (core.py): one copy of each, the old names kept.
    params = CoreView("params", "The model parameters (replaceable between steps).")
    book = CoreView("book", "Host bookkeeping: requests, queue, slot owners (RequestBook).")
    state = CoreView("device.state", "The scheduler state (pool, tables, lengths) on device.")
    kv = CoreView("device.kv", "(k, v) KV pool, each [layers, blocks, kv heads, block, dim].")
    num_steps = CoreView("num_steps", "Engine iterations run so far.")

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | dict,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. prompt: text, token ids, or {"prompt_token_ids": [...]} /
        {"prompt": "..."} (vLLM's TextPrompt / TokensPrompt; "multi_modal_data": images,
        multimodal.py); lora_request: its adapter (docs/lora.md). Raises (changing nothing)
        on a duplicate id, bad ids, a prompt over max_model_len (or the token budget in
        paper/static mode), a prompt the KV pool can never hold, unsupported options, an
        adapter that cannot be served, or images the model or prompt cannot take."""
        book = self.core.book
        params = check_request_args(request_id, params, book.requests)
        prompt, mm_data = split_mm(prompt, self.mm)  # refuses images to a text-only model
        text, ids = self.tokenize_prompt(prompt)
        mm = self.mm.prepare(ids, mm_data, params) if self.mm is not None else None
        ids = ids if mm is None else mm.token_ids  # checked as real ids, kept as identity ids
        self.check_request(ids, params)
        controls = self.core.controls.prepare(params)  # bad words' ids, compiled grammar
        if lora_request is not None:  # read the adapter now: its errors are this call's
            lora.prepare_request(self.core.lora, lora_request, book.requests.values(), len(ids))
        if params.seed is None and not params.greedy:
            # Drawn here, once, so the request's samples survive preemption unchanged.
            params = params.with_seed(int(self._rng.integers(0, MAX_SEED + 1)))
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        target = max(1, min(max_tokens, self.max_model_len - len(ids)))
        req = RequestState.new(
            request_id, text, ids if mm is None else mm.cache_ids, params, target,
            self.tokenizer, book.next_arrival, detokenize=self.detokenize,
        )
        req.multi_modal = mm
        self.core.controls.attach(req, controls)
        req.lora_request = lora_request  # LoRA: its adapter slot, its prefix-cache salt
        # n > 1: only sample 0 prefills; the others fork its blocks when its prompt is done.
        book.add(req)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop requests now: their blocks return to the pool at once. Unknown ids are
        ignored (as vLLM: the request may have finished in the meantime)."""
        self.core.abort([request_id] if isinstance(request_id, str) else list(request_id))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: read and check the adapter now (ValueError, nothing changed, if bad)."""
        lora.prepare_request(self.core.lora, lora_request, self.core.book.requests.values())
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: forget it, freed when its requests finish; False if not held."""
        return lora.remove_adapter(self.core.lora, lora_id, self.core.book.requests.values())

    def list_loras(self) -> set[int]:
        """Ids of the adapters the engine holds (empty with LoRA off)."""
        return set() if self.core.lora is None else self.core.lora.held_ids()

    def has_unfinished_requests(self) -> bool:
        return bool(self.core.book.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.core.book.requests)

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        """(text or None, checked token ids) of a prompt (``prompts.tokenize_prompt``)."""
        return tokenize_prompt(self.tokenizer, self.arch.vocab_size, prompt)

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """ValueError if a request of these ids and params can never run here."""
        check_request(
            ids, params, sched_limits=self.sched_limits, max_model_len=self.max_model_len,
            num_blocks=self.num_blocks, block_size=self.block_size,
            watermark_blocks=self.policy.watermark_blocks, max_logprobs=self.max_logprobs,
            vocab_size=self.arch.vocab_size,
        )  # fmt: skip

    def request_counts(self) -> dict[str, int]:
        """Unfinished requests by where they are (``RequestBook.request_counts``)."""
        return self.core.book.request_counts()

    # ------------------------------------------------------------------ the step

    def add_step_observer(self, fn: StepObserver) -> None:
        """fn(StepRecord) after each iteration, the K-step loop's too (step_record.py)."""
        self.step_observers.append(fn)

    def step(self) -> list[RequestOutput]:
        """One iteration (the module docstring's pipeline); returns the requests that got
        a token or finished (cumulative). Every kind of step ends in the output processor."""
        core, dev, book, t0 = self.core, self.core.device, self.core.book, time.perf_counter()
        self.assign_slots()
        if not book.slot_owner:
            return []
        outputs = self.multi_step.step(core, self.outputs)  # None: run the one-step path
        if outputs is not None:  # observers see each iteration it ran (step_record.py)
            return notify(self.step_observers, t0, outputs, self.multi_step.last_loop)
        spec = self.speculator
        lookahead, drafts = spec.plan(core) if spec is not None else (None, None)
        batch = dev.schedule(lookahead)
        host = read_schedule(core, batch)  # the one sync after schedule
        self.multi_step.note_step(core, host)
        self.num_preemptions += int(host["preempted"].sum())
        core.num_steps += 1
        c = apply_swap_copies(core, self.speculator, batch, host)  # before the forward
        self.num_preemptions_swap += c.preempted_swap
        self.num_preemptions_recompute += c.preempted_recompute
        self.num_swapped_out_blocks += c.blocks_out
        self.num_swapped_in_blocks += c.blocks_in
        core.sharing.record_usage(int(host["used"]), int(host["unshared"]))
        if self.enable_prefix_caching:
            book.relookup.difference_update(int(x) for x in host["seq_ids"][: host["num_seqs"]])
            # Preempted by recompute, or a waiting hit released: look the prefix up again.
            recomputed = (host["preempted"] & ~host["swapped_out"]) | host["released"]
            book.relookup.update(int(x) for x in np.flatnonzero(recomputed))
        out = self.outputs.begin()
        for slot in np.flatnonzero(host["rejected"]):
            self.outputs.reject(out, int(slot), int(host["reason"][slot]))
        accepted = self._run(batch, host, drafts, out) if int(host["num_seqs"]) > 0 else None
        dev.update(batch, out.finished_rows, out.recycle, accepted)
        return notify(self.step_observers, t0, self.outputs.finish(out), host)

    def _buckets(self, num_tokens: int) -> tuple[int, int]:
        """The compiled (T, S) bucket of a step of ``num_tokens`` tokens."""
        padded_tokens = pick(self.token_buckets, num_tokens)
        return padded_tokens, seqs_for_tokens(self.seq_buckets, padded_tokens)

    def _run(self, batch: Any, host: dict[str, np.ndarray], drafts: np.ndarray | None,
             out: Any) -> np.ndarray | None:  # fmt: skip
        """The step's device program (the plain step, or the verification when rows have
        drafts), its tokens read back in one transfer and handed to the output processor.
        Returns the drafts accepted per batch row (int32[max_seqs]), None for a plain step."""
        core, dev = self.core, self.core.device
        num_seqs = int(host["num_seqs"])
        seq_ids, emits = host["seq_ids"], host["emits"]
        owners = [core.book.owner(int(seq_ids[r])) for r in range(num_seqs)]
        # A row holding prompt tokens of a request that wants prompt logprobs.
        all_logits = any(
            req.prompt_logprobs is not None and host["start_pos"][r] < len(req.prompt_token_ids)
            for r, (req, _) in enumerate(owners)
        )
        rows = [r for r in range(num_seqs) if emits[r]]
        # Grammar masks filled while a plain step's forward runs (after), or now.
        after = None if core.controls is None else core.controls.step_fills(
            dev, owners, rows, can_overlap=self.speculator is None)
        verified, t0 = None, time.perf_counter()
        if self.speculator is not None:
            verified = self.speculator.run(core, batch, host, drafts, self._buckets, all_logits)
        plp = None
        if verified is None:
            padded_tokens, padded_seqs = self._buckets(int(host["num_tokens"]))
            mm = self.mm.step_inputs(host, owners, padded_tokens) if self.mm is not None else None
            sampled, plp = dev.run_step(
                self.runner, core.params,
                batch._replace(swap=None),  # applied by apply_swap_copies; one pytree with warmup
                after, num_tokens=padded_tokens, num_seqs=padded_seqs, all_logits=all_logits,
                mm=mm,
            )  # fmt: skip
        else:
            sampled, acc_dev = verified
        want_top = any(owners[r][1].logprobs is not None for r in rows)
        fetch = {"ids": sampled.token_ids, "lps": sampled.logprobs}
        if verified is not None:
            fetch["accepted"] = acc_dev
        if want_top:  # [S, K] arrays: fetched only when a row asked for logprobs
            fetch["top"] = (sampled.ranks, sampled.top_ids, sampled.top_logprobs)
        got = jax.device_get(fetch)
        if self.speculator is not None:  # the automatic k rule's cost table (spec/k_schedule.py)
            self.speculator.observe(self._buckets(int(host["num_tokens"])),
                                    time.perf_counter() - t0)  # fmt: skip
        if plp is not None:
            record_prompt_logprobs(self.tokenizer.decode, host, owners, jax.device_get(plp))
        if verified is None:
            rows_out = SampledRows.one_per_row(got["ids"], got["lps"], got.get("top"), num_seqs)
            self.outputs.record(out, owners, rows, rows_out)
            self.outputs.register_blocks(batch, host, owners)
            self.outputs.fork_samples(owners, rows)
            return None
        spec_lens = host["spec_lens"][:num_seqs].astype(np.int64)
        acc = np.zeros(core.max_seqs, np.int32)
        acc[:num_seqs] = np.where(spec_lens > 0, got["accepted"][:num_seqs], 0)
        packed = SampledRows(got["ids"], got["lps"], got.get("top"),
                             sampled_offsets(spec_lens, num_seqs), 1 + acc[:num_seqs])  # fmt: skip
        recorded = self.outputs.record(out, owners, rows, packed)
        self.speculator.count(spec_lens, acc[:num_seqs], recorded)
        # Registered: each row's computed tokens that stay (a stop inside an accepted run
        # keeps its KV up to the stop; the rejected drafts' blocks are rolled back).
        q_acc = host["q_lens"].copy()
        spec_rows = np.flatnonzero(spec_lens)
        q_acc[spec_rows] = np.minimum(1 + acc[spec_rows], recorded[spec_rows] + 1)
        self.outputs.register_blocks(batch, host, owners, q_acc)
        self.outputs.fork_samples(owners, rows)
        return acc

    def assign_slots(self) -> None:
        """Give queued sequences free slots (FCFS) and attach cached prefixes
        (``admission.assign_slots``); ``step`` starts with it."""
        admission.assign_slots(self.core)

    def warmup(self, pairs: Iterable[tuple[int, int]] | None = None, *, mode: str = "decode",
               progress: bool = False) -> list[tuple[int, int]]:  # fmt: skip
        """Compile now, on no-op inputs (``warmup.py``; an image model's encoder and image
        steps too): ``mode`` "decode" (decode pairs, the largest prefill pair, decode loops,
        state functions), "all" (every (T, S) pair) or "none"; ``pairs``: just those."""
        done = warm_up(self.core, self.multi_step, mode, pairs, progress, images=self.mm)
        if self.speculator is not None:  # its verification (and draft) programs too
            self.speculator.warm_up(self.core, done)
        return done

    # ------------------------------------------------------------------ introspection

    def num_free_blocks(self) -> int:
        return int(self.state.mem.pool.num_free)

    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_free_host_blocks(self) -> int:
        """Free blocks of the host swap pool (0 without one)."""
        host = self.state.mem.host_pool
        return int(host.num_free) if host is not None else 0

    def _counted(self) -> list[Any]:
        """The optional parts that keep counters of their own (stats / reset_stats)."""
        parts = (self.speculator, self.core.lora, self.mm, self.core.host_tier)
        return [p for p in parts if p is not None]

    def reset_stats(self) -> None:
        """Zero the counters ``stats()`` reports (the prefix cache's contents stay)."""
        self.core.sharing = type(self.core.sharing)()
        self.outputs.num_forked = 0
        self.multi_step.reset_stats()
        for part in self._counted():
            part.reset_stats()
        self.num_preemptions_recompute = self.num_preemptions_swap = 0
        self.num_swapped_out_blocks = self.num_swapped_in_blocks = 0
        self.core.prefix_index.reset_counters()

    def stats(self) -> dict[str, float | int]:
        """Counters since the last ``reset_stats``: ``engine_stats.engine_stats`` gives
        the keys' meanings; spec_*: ``spec/decoder.py``'s ``SpecCounters``."""
        own = [part.stats() for part in self._counted()]  # spec_*, lora_*, mm_*, tier
        return functools.reduce(operator.or_, own, {}) | self.core.controls.stats() | engine_stats(
            self.core, self.multi_step, forked_samples=self.outputs.num_forked,
            preemptions_recompute=self.num_preemptions_recompute,
            preemptions_swap=self.num_preemptions_swap,
            swapped_out_blocks=self.num_swapped_out_blocks,
            swapped_in_blocks=self.num_swapped_in_blocks,
        )  # fmt: skip

