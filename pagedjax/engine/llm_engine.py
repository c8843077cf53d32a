"""LLMEngine: requests in, streamed RequestOutputs out, one iteration per ``step()``.

One step (docs/engine.md gives the reasons):

1. host: give queued sequences free slots; one jitted ``add_requests`` for all of them.
2. device: ``schedule`` (jitted) picks rows and grows their blocks.
3. host: read back the batch's sizes and rows (one sync) to pick the bucket (T, S).
3b. swap copies the schedule decided (``_apply_swaps``): device -> host blocks of groups
   swapped out, then host -> device blocks of groups swapped in.
4. device: the ModelRunner step for (T, S): ragged input from the device token buffer,
   copy-on-write copies, forward (KV donated), sample, append the ids. With speculative
   decoding, a step with proposals verifies them instead (``speculative.py``).
5. host: read the sampled ids (second sync), detokenize, check EOS / stop ids / stop
   strings / length, build the RequestOutputs.
6. device: ``update`` with the stop mask, then ``recycle`` of finished slots (async).

Token ids live in both places: the device buffer ``int32[max_seqs, max_model_len]``
feeds the model (prefill, decode and recompute after preemption read it there, so the
host never uploads a batch), and the host keeps each sequence's ids for detokenization.
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
methods; ``state``, ``kv``, ``tokens`` and ``params`` here are views of the core's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from pagedjax import compile_cache
from pagedjax.attention import select_attention_backend
from pagedjax.compile_cache import CompileCounter
from pagedjax.config import EngineConfig
from pagedjax.engine import admission
from pagedjax.engine.buckets import pick, seq_buckets_for, seqs_for_tokens, step_buckets
from pagedjax.engine.core import CoreView, EngineCore
from pagedjax.engine.device_state import DeviceState, num_host_blocks, padding_bucket
from pagedjax.engine.engine_stats import engine_stats
from pagedjax.engine.kv_budget import num_kv_blocks, profile_forward
from pagedjax.engine.kv_cache_spec import KVCacheSpec
from pagedjax.engine.loading import load_model
from pagedjax.engine.model_runner import ModelRunner
from pagedjax.engine.multi_step import MultiStepDecoder, resolve_num_steps
from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.parallel import DevicePlacement, check_device_count
from pagedjax.engine.prompts import check_request, record_prompt_logprobs, tokenize_prompt
from pagedjax.engine.request_book import RequestBook
from pagedjax.engine.sequence import RequestState, SequenceState
from pagedjax.engine.spec.decoder import build_speculator, check_buildable, load_draft
from pagedjax.engine.warmup import warm_up
from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.memory.prefix_cache import PrefixIndex
from pagedjax.model import ModelArch, compute_dtype
from pagedjax.sampling import BeamSearchParams, SamplingParams
from pagedjax.sampling.params import MAX_SEED
from pagedjax.scheduler import REASON_CAPACITY, REASON_TOO_LONG, ScheduledBatch, SchedulerConfig
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
    ):
        _reject_unbuilt_features(config)
        compile_cache.enable(config.compilation_cache)  # idempotent
        cc, sc, par = config.cache, config.scheduler, config.parallel  # par: TP (parallel.py)
        self.arch, self.tokenizer, self.config = arch, tokenizer, config
        dtype = compute_dtype(params)  # not a quantized weight's int codes
        self.kv_spec = KVCacheSpec.resolve(arch, dtype, cc.cache_dtype, kv_dtype, cc.kv_scales)
        self.kv_dtype = self.kv_spec.dtype  # what the values are (int8 / fp8: kv_cache_spec.py)
        self.placement = place = DevicePlacement(arch, par.tensor_parallel_size, devices)
        params = place.params(params, self.kv_spec)  # refuses what is not sharded yet
        self.max_model_len = config.model.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's"
                             f" max_position_embeddings={arch.max_position_embeddings}")
        self.block_size = cc.block_size
        self.max_num_seqs = self.max_seqs = sc.max_num_seqs  # slots; the queue waits on the host
        max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        backend = select_attention_backend(config.attention_backend)
        log.info("attention backend: %s (%s)", backend.name, backend.reason)
        self.attention_backend = backend.name  # "native_cpu", "reference", "pallas" or "triton"
        attention = place.attention(backend.ragged_paged_attention)
        self.runner = ModelRunner(arch, self.block_size, attention, max_logprobs, place.size == 1)
        self.max_logprobs, self.max_blocks_per_seq = max_logprobs, max_blocks_per_seq
        budget = sc.max_num_batched_tokens
        self.token_buckets = step_buckets(budget, smallest=min(16, budget))
        self.seq_buckets = seq_buckets_for(self.token_buckets, self.max_num_seqs)  # S from T
        draft, kv_per_token = load_draft(config.speculative, config.model.model, arch, tokenizer,
                                         self.kv_spec, self.max_model_len, config.model.seed)
        self.num_blocks = num_kv_blocks(  # per device: its share of each block
            kv_bytes_per_token=kv_per_token // place.kv_shards,
            block_size=self.block_size,
            max_blocks_needed=self.max_seqs * max_blocks_per_seq,
            num_gpu_blocks_override=cc.num_gpu_blocks_override,
            kv_cache_memory_bytes=cc.kv_cache_memory_bytes,
            gpu_memory_utilization=cc.gpu_memory_utilization,
            device=place.device,
            profile=functools.partial(
                profile_forward, arch, params, self.kv_spec, self.block_size, budget,
                self.max_num_seqs, max_blocks_per_seq,
            ),
        )
        self.num_host_blocks = num_host_blocks(
            cc.swap_space,
            kv_per_token * self.block_size,
            self.max_seqs * max_blocks_per_seq,
            sc.preemption_mode,
        )
        self.policy = PagedPolicy(
            self.num_blocks, self.block_size, self.max_seqs, max_blocks_per_seq,
            watermark_frac=sc.watermark, enable_prefix_caching=cc.enable_prefix_caching,
            num_host_blocks=self.num_host_blocks,
        )  # fmt: skip
        self.enable_prefix_caching = cc.enable_prefix_caching
        self.sched_config = SchedulerConfig(
            max_seqs=self.max_seqs, max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            mode=sc.scheduling_mode, priority=sc.policy, preemption_mode=sc.preemption_mode,
        )  # fmt: skip
        log.info("%s", self.kv_spec.describe(self.num_blocks, self.block_size))
        kv = place.allocate_kv(self.kv_spec, self.num_blocks, self.block_size, kv_fill_value)
        device_state = DeviceState(self.policy, self.sched_config, kv,
                                   max_model_len=self.max_model_len,
                                   num_host_blocks=self.num_host_blocks)  # fmt: skip
        place.place_state(device_state)
        self.speculator = build_speculator(config.speculative, arch, self.block_size, attention,
                                           max_logprobs, self.policy, draft, place.size == 1)
        k = resolve_num_steps(sc.num_multi_steps, place.device.platform)  # multi_step.py
        num_steps = 1 if self.speculator else k  # K = 1: the one-step path (speculation)
        self.multi_step = MultiStepDecoder(self.runner, self.policy, self.sched_config, num_steps)
        eos = {i for i in (*arch.eos_token_ids, tokenizer.eos_token_id) if i is not None}
        self.core = EngineCore(
            params=params, runner=self.runner, device=device_state,
            book=RequestBook(self.max_seqs, eos), prefix_index=PrefixIndex(),
            block_size=self.block_size, max_seqs=self.max_seqs, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, kv_calibration=self.kv_spec.calibrator(),
            max_blocks_per_seq=max_blocks_per_seq, token_buckets=self.token_buckets,
            seq_buckets=self.seq_buckets, enable_prefix_caching=self.enable_prefix_caching,
        )  # fmt: skip
        self.reset_stats()
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
        _reject_unbuilt_features(config)  # before spending time on loading weights
        compile_cache.enable(config.compilation_cache)
        arch, params, tokenizer, _ = load_model(config.model)
        return cls(arch, params, tokenizer, config, **kwargs)

    # Views of the core's state (core.py): one copy of each, the old names kept.
    params = CoreView("params", "The model parameters (replaceable between steps).")
    book = CoreView("book", "Host bookkeeping: requests, queue, slot owners (RequestBook).")
    device = CoreView("device", "Device arrays and their jitted functions (DeviceState).")
    state = CoreView("device.state", "The scheduler state (pool, tables, lengths) on device.")
    kv = CoreView("device.kv", "(k, v) KV pool, each [layers, blocks, kv heads, block, dim].")
    tokens = CoreView("device.tokens", "int32[max_seqs, max_model_len] ids per slot.")
    host_kv = CoreView("device.host_kv", "The host swap pool (numpy, like kv).")
    prefix_index = CoreView("prefix_index", "The prefix cache's host hint (PrefixIndex).")
    num_steps = CoreView("num_steps", "Engine iterations run so far.")

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | dict,
        params: SamplingParams | None = None,
    ) -> None:
        """Queue a request. prompt: text, token ids, or {"prompt_token_ids": [...]} /
        {"prompt": "..."} (vLLM's TextPrompt / TokensPrompt). Raises (changing nothing)
        on a duplicate id, bad ids, a prompt over max_model_len (or the token budget in
        paper/static mode), a prompt the KV pool can never hold, or unsupported options.
        """
        params = SamplingParams() if params is None else params
        if isinstance(params, BeamSearchParams):
            raise TypeError("BeamSearchParams go to LLM.beam_search (or engine.beams.beam_search)")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        book = self.core.book
        if request_id in book.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self.check_request(ids, params)
        if params.seed is None and not params.greedy:
            # Drawn here, once, so the request's samples survive preemption unchanged.
            params = params.with_seed(int(self._rng.integers(0, MAX_SEED + 1)))
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        target = max(1, min(max_tokens, self.max_model_len - len(ids)))
        req = RequestState.new(
            request_id, text, ids, params, target, self.tokenizer, book.next_arrival
        )
        # n > 1: only sample 0 prefills; the others fork its blocks when its prompt is done.
        book.add(req)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop requests now: their blocks return to the pool at once. Unknown ids are
        ignored (as vLLM: the request may have finished in the meantime)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        mask = np.zeros(self.max_seqs, bool)
        book = self.core.book
        for rid in ids:
            req = book.drop(rid)
            if req is None:
                continue
            for seq in req.seqs:
                if seq.slot is not None:
                    mask[seq.slot] = True
                    book.release_slot(seq)
        if mask.any():
            self.core.device.abort(np.arange(self.max_seqs, dtype=np.int32), mask)

    abort = abort_request

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
            ids, params, sched_config=self.sched_config, max_model_len=self.max_model_len,
            num_blocks=self.num_blocks, block_size=self.block_size,
            watermark_blocks=self.policy.watermark_blocks, max_logprobs=self.max_logprobs,
            vocab_size=self.arch.vocab_size,
        )  # fmt: skip

    def request_counts(self) -> dict[str, int]:
        """Unfinished requests by where they are (``RequestBook.request_counts``)."""
        return self.core.book.request_counts()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One iteration; returns the requests that got a token or finished (cumulative)."""
        core, dev, book = self.core, self.core.device, self.core.book
        self.assign_slots()
        if not book.slot_owner:
            return []
        outputs = self.multi_step.step(core)  # None: a host event needs the one-step path
        if outputs is not None:
            return outputs
        batch = dev.schedule()
        host = jax.device_get(
            dict(
                num_tokens=batch.num_tokens, num_seqs=batch.num_seqs, seq_ids=batch.seq_ids,
                q_lens=batch.q_lens, start_pos=batch.start_pos, emits=batch.emits,
                rejected=batch.rejected, preempted=batch.preempted, released=batch.released,
                reason=dev.state.finish_reason,
                usage=dev.usage(),
                tables=dev.state.mem.tables.tables if self.enable_prefix_caching else None,
                num_out=batch.swap.num_out,
                num_in=batch.swap.num_in,
                swapped_out=batch.swap.swapped_out,
                swapped_in=batch.swap.swapped_in,
            )
        )  # fmt: skip
        host["used"], host["unshared"] = host.pop("usage")
        self.multi_step.note_step(core, host)
        self.num_preemptions += int(host["preempted"].sum())
        core.num_steps += 1
        self._apply_swaps(batch, host)
        core.sharing.record_usage(int(host["used"]), int(host["unshared"]))
        if self.enable_prefix_caching:
            book.relookup.difference_update(int(x) for x in host["seq_ids"][: host["num_seqs"]])
            # Preempted by recompute, or a waiting hit released: look the prefix up again.
            recomputed = (host["preempted"] & ~host["swapped_out"]) | host["released"]
            book.relookup.update(int(x) for x in np.flatnonzero(recomputed))
        touched: dict[str, RequestState] = {}
        recycle_mask = np.zeros(self.max_seqs, bool)
        for slot in np.flatnonzero(host["rejected"]):
            req, seq = book.owner(int(slot))
            why = {REASON_TOO_LONG: "too long", REASON_CAPACITY: "cannot fit the KV pool"}
            reason = why.get(int(host["reason"][slot]))
            log.warning("request %s rejected: %s", req.request_id, reason)
            seq.finish_reason = "length"  # vLLM's FINISHED_IGNORED reports "length"
            for child in req.pending:  # samples never forked share the parent's fate
                child.finish_reason = "length"
            req.pending = []
            recycle_mask[slot] = True
            touched[req.request_id] = req
        finished_mask = np.zeros(self.max_seqs, bool)
        if int(host["num_seqs"]) > 0:
            self._run(batch, host, touched, finished_mask, recycle_mask)
        dev.update(batch, finished_mask, recycle_mask)
        core.release_finished(recycle_mask)
        outputs = [req.output() for req in touched.values()]
        for o in outputs:
            if o.finished:
                book.retire(o.request_id)
        return outputs

    def _run(
        self,
        batch: Any,
        host: dict[str, np.ndarray],
        touched: dict[str, RequestState],
        finished_mask: np.ndarray,
        recycle_mask: np.ndarray,
    ) -> None:
        """The device step for the batch's bucket, then the sampled tokens on the host:
        fills touched, finished_mask (batch rows) and recycle_mask (slots) in place."""
        core, dev = self.core, self.core.device
        spec = self.speculator
        if spec is not None and spec.run(self, batch, host, touched, finished_mask, recycle_mask):
            return
        num_seqs = int(host["num_seqs"])
        seq_ids, emits = host["seq_ids"], host["emits"]
        owners = [core.book.owner(int(seq_ids[r])) for r in range(num_seqs)]
        # A row holding prompt tokens of a request that wants prompt logprobs.
        all_logits = any(
            req.prompt_logprobs is not None and host["start_pos"][r] < len(req.prompt_token_ids)
            for r, (req, _) in enumerate(owners)
        )
        sampling = dev.sampling()
        padded_tokens = pick(self.token_buckets, int(host["num_tokens"]))  # S from T
        padded_seqs = seqs_for_tokens(self.seq_buckets, padded_tokens)
        dev.kv, dev.tokens, out, plp = self.runner.run(
            core.params, dev.kv, dev.tokens, dev.state.mem,
            batch._replace(swap=None),  # applied by _apply_swaps; one pytree with warmup
            sampling, dev.state.prompt_len, dev.state.output_len,
            num_tokens=padded_tokens, num_seqs=padded_seqs, all_logits=all_logits,
        )  # fmt: skip
        rows = [r for r in range(num_seqs) if emits[r]]
        want_top = any(owners[r][1].logprobs is not None for r in rows)
        fetch = [out.token_ids, out.logprobs]
        if want_top:  # [S, K] arrays: fetched only when a row asked for logprobs
            fetch += [out.ranks, out.top_ids, out.top_logprobs]
        got = jax.device_get(fetch)
        if plp is not None:
            record_prompt_logprobs(self.tokenizer.decode, host, owners, jax.device_get(plp))
        eos = core.book.eos
        for r in rows:
            req, seq = owners[r]
            top = (got[2][r], got[3][r], got[4][r]) if want_top else None
            if seq.record(int(got[0][r]), float(got[1][r]), top, eos):
                recycle_mask[seq.slot] = True
                finished_mask[r] = seq.finish_reason == "stop"
            touched[req.request_id] = req
        if self.enable_prefix_caching:
            admission.register_blocks(self.core, batch, host, owners)
        for r in rows:
            req, seq = owners[r]
            if req.pending and seq.index == 0 and len(seq.detok.ids) == 1:
                self.fork_samples(req, seq)

    def _apply_swaps(self, batch: ScheduledBatch, host: dict) -> None:
        """Copy this step's swapped blocks: out (device -> host) first, while the freed
        device blocks still hold the group's KV (this step's forward and copy-on-write may
        overwrite them), then in (host -> device) into the fresh blocks, before any forward
        reads them (a separate speculative draft's pool too, spec_draft_model.py)."""
        n_out, n_in = int(host["num_out"]), int(host["num_in"])
        out_slots = np.flatnonzero(host["swapped_out"])
        in_slots = np.flatnonzero(host["swapped_in"])
        self.num_preemptions_swap += len(out_slots)
        self.num_preemptions_recompute += int(host["preempted"].sum()) - len(out_slots)
        swapped = self.core.book.swapped_slots
        swapped.update(int(x) for x in out_slots)
        swapped.difference_update(int(x) for x in in_slots)
        sw = batch.swap
        if n_out:
            self.core.device.swap_out(sw, n_out, padding_bucket(n_out, sw.out_src.shape[0]))
            self.num_swapped_out_blocks += n_out
        if n_in:
            self.core.device.swap_in(sw, n_in, padding_bucket(n_in, sw.in_src.shape[0]))
            self.num_swapped_in_blocks += n_in
        if self.speculator is not None:
            self.speculator.apply_swaps(sw, host)

    def fork_samples(self, req: RequestState, parent: SequenceState) -> None:
        """Give samples 1..n-1 of ``req`` slots sharing sample 0's prompt blocks
        (``admission.fork_samples``); called when sample 0 sampled its first token."""
        self.num_forked += admission.fork_samples(self.core, req, parent)

    def assign_slots(self) -> None:
        """Give queued sequences free slots (FCFS) and attach cached prefixes
        (``admission.assign_slots``); ``step`` starts with it."""
        admission.assign_slots(self.core)

    def warmup(self, pairs: Iterable[tuple[int, int]] | None = None, *, mode: str = "decode",
               progress: bool = False) -> list[tuple[int, int]]:  # fmt: skip
        """Compile now, on no-op inputs (``warmup.py``): ``mode`` "decode" (decode pairs,
        the largest prefill pair, decode loops, state functions), "all" (every reachable
        (T, S) pair too) or "none"; ``pairs``: just those runner pairs. Returns them."""
        done = warm_up(self.core, self.multi_step, mode, pairs, progress)
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

    def reset_stats(self) -> None:
        """Zero the counters ``stats()`` reports (the prefix cache's contents stay)."""
        self.core.sharing = type(self.core.sharing)()
        self.num_forked = 0
        self.multi_step.reset_stats()
        if self.speculator is not None:
            self.speculator.reset_stats()
        self.num_preemptions_recompute = 0
        self.num_preemptions_swap = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.prefix_index.queries = self.prefix_index.hit_blocks = 0
        self.prefix_index.query_blocks = 0

    def stats(self) -> dict[str, float | int]:
        """Sharing metrics since the last ``reset_stats`` (docs/engine.md):

        prefix_cache_queries: lookups (admissions and re-admissions after preemption).
        prefix_cache_query_tokens: tokens looked up (prompt, or prompt + output to redo).
        prefix_cache_hit_tokens: tokens whose KV was reused = prefill tokens saved.
        prefix_cache_hit_rate: hit tokens / query tokens.
        blocks_saved_by_sharing: 1 - blocks in use / blocks without sharing, averaged over
            steps holding blocks; the ratio of the sums: ``blocks_saved_by_sharing_total``.
        preemptions_recompute / preemptions_swap: sequences preempted by each kind.
        swapped_out_blocks / swapped_in_blocks: KV blocks copied device -> host and back
            (a block shared within a group counts once). spec_*: ``speculative.py``.
        compilations, xla_compilations, multi_step_*: see ``engine_stats.py``.
        """
        spec = self.speculator.stats() if self.speculator is not None else {}
        return spec | engine_stats(
            self.core, self.multi_step, forked_samples=self.num_forked,
            preemptions_recompute=self.num_preemptions_recompute,
            preemptions_swap=self.num_preemptions_swap,
            swapped_out_blocks=self.num_swapped_out_blocks,
            swapped_in_blocks=self.num_swapped_in_blocks,
        )  # fmt: skip


def _reject_unbuilt_features(config: EngineConfig) -> None:
    check_device_count(config.parallel.tensor_parallel_size)
    check_buildable(config.speculative, config.model.model)
    if config.speculative is not None and config.parallel.tensor_parallel_size > 1:
        raise ValueError("speculative_config with tensor_parallel_size > 1: not built yet")
    if config.parallel.data_parallel_size > 1:  # replicas are data_parallel.py's, above
        raise ValueError("LLMEngine is one replica; data_parallel_size > 1: DataParallelEngine")
