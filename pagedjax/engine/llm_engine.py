"""LLMEngine: requests in, streamed RequestOutputs out, one iteration per ``step()``.

One step (docs/engine.md gives the reasons):

1. host: give queued sequences free slots; one jitted ``add_requests`` for all of them.
2. device: ``schedule`` (jitted) picks rows and grows their blocks.
3. host: read back the batch's sizes and rows (a few [max_seqs] int arrays, one sync) to
   pick the padding bucket (T, S).
3b. swap copies the schedule decided (``_apply_swaps``): device -> host blocks of groups
   swapped out, then host -> device blocks of groups swapped in.
4. device: the ModelRunner step for (T, S): build the ragged input from the device token
   buffer, copy-on-write copies, forward (KV donated), sample, append the ids.
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

Sequence groups and swap (docs/engine.md): the samples of one request form a sequence
group (group id: sample 0's arrival number), which the scheduler preempts all or
nothing. A group preempted by swap has its blocks copied to a host KV pool (numpy,
``swap_space`` GiB) in step 3b, before the step's forward overwrites the freed device
blocks, and copied back into fresh device blocks when it is swapped in.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import EngineConfig
from pagedjax.engine import sharing
from pagedjax.engine.block_hashes import extend_hashes
from pagedjax.engine.buckets import pick, step_buckets
from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.engine.kv_budget import num_kv_blocks
from pagedjax.engine.loading import load_model
from pagedjax.engine.model_runner import (
    ModelRunner,
    gather_blocks,
    jitted_update,
    scatter_blocks,
)
from pagedjax.engine.multi_step import MultiStepDecoder
from pagedjax.engine.outputs import Logprob, RequestOutput
from pagedjax.engine.sequence import RequestState, SequenceState
from pagedjax.engine.warmup import backend_compilations, engine_compilations, warm_up
from pagedjax.memory.block_pool import NULL_BLOCK
from pagedjax.memory.block_table import blocks_for
from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.memory.prefix_cache import PrefixIndex
from pagedjax.model import ModelArch, allocate_kv_cache
from pagedjax.model.forward import dummy_input, make_forward
from pagedjax.sampling import BeamSearchParams, SamplingParams, SamplingTensors
from pagedjax.sampling.params import MAX_SEED
from pagedjax.scheduler import (
    REASON_CAPACITY,
    REASON_TOO_LONG,
    ScheduledBatch,
    SchedulerConfig,
    abort,
    add_requests,
    init_state,
    recycle,
    schedule,
)
from pagedjax.tokenizer import Tokenizer
from pallas_kernels.dispatch import select_attention_backend

log = logging.getLogger(__name__)

DEFAULT_MAX_LOGPROBS = 20  # vLLM's max_logprobs default


class LLMEngine:
    """The serving engine over one model (see the module docstring for one step).

    arch, params: the model (params in their compute dtype). tokenizer: for text prompts,
    detokenization and EOS. config: EngineConfig (cache / scheduler / model sections).
    kv_dtype: the KV pool's dtype (default: the params' dtype).
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
    ):
        _reject_unbuilt_features(config)
        cc, sc = config.cache, config.scheduler
        self.arch, self.params, self.tokenizer, self.config = arch, params, tokenizer, config
        dtype = jax.tree.leaves(params)[0].dtype
        self.kv_dtype = kv_dtype if kv_dtype is not None else dtype
        self.max_model_len = config.model.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's"
                f" max_position_embeddings={arch.max_position_embeddings}"
            )
        self.block_size = cc.block_size
        self.max_num_seqs = sc.max_num_seqs
        self.max_seqs = sc.max_num_seqs  # slots; queued requests wait on the host
        max_blocks_per_seq = -(-self.max_model_len // self.block_size)

        backend = select_attention_backend(config.attention_backend)
        log.info("attention backend: %s (%s)", backend.name, backend.reason)
        self.attention_backend = backend.name  # "native_cpu", "reference" or "pallas"
        self.runner = ModelRunner(
            arch, self.block_size, backend.ragged_paged_attention, max_logprobs
        )
        self.max_logprobs = max_logprobs
        budget = sc.max_num_batched_tokens
        self.token_buckets = step_buckets(budget, smallest=min(16, budget))
        self.seq_buckets = step_buckets(self.max_num_seqs)

        device = jax.devices()[0]
        self.num_blocks = num_kv_blocks(
            kv_bytes_per_token=arch.kv_bytes_per_token(self.kv_dtype),
            block_size=self.block_size,
            max_blocks_needed=self.max_seqs * max_blocks_per_seq,
            num_gpu_blocks_override=cc.num_gpu_blocks_override,
            kv_cache_memory_bytes=cc.kv_cache_memory_bytes,
            gpu_memory_utilization=cc.gpu_memory_utilization,
            device=device,
            profile=functools.partial(self._profile, budget, max_blocks_per_seq),
        )
        self.num_host_blocks = num_host_blocks(
            cc.swap_space,
            arch.kv_bytes_per_token(self.kv_dtype) * self.block_size,
            self.max_seqs * max_blocks_per_seq,
            sc.preemption_mode,
        )
        self.policy = PagedPolicy(
            self.num_blocks,
            self.block_size,
            self.max_seqs,
            max_blocks_per_seq,
            watermark_frac=sc.watermark,
            enable_prefix_caching=cc.enable_prefix_caching,
            num_host_blocks=self.num_host_blocks,
        )
        self.enable_prefix_caching = cc.enable_prefix_caching
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sched_config = SchedulerConfig(
            max_seqs=self.max_seqs,
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            mode=sc.scheduling_mode,
            priority=sc.policy,
            preemption_mode=sc.preemption_mode,
        )
        self.state = init_state(self.policy, self.max_seqs)
        self.kv = allocate_kv_cache(
            arch, self.num_blocks, self.block_size, self.kv_dtype, fill_value=kv_fill_value
        )
        self.tokens = jnp.zeros((self.max_seqs, self.max_model_len), jnp.int32)
        # Host swap pool, page shape as the device pool's; row 0 is the host null block.
        self.host_kv = tuple(
            tuple(np.zeros((self.num_host_blocks + 1, *p.shape[1:]), p.dtype) for p in layer)
            for layer in self.kv
        )
        self._swapped_slots: set[int] = set()

        policy, scfg = self.policy, self.sched_config
        self._schedule = jax.jit(functools.partial(schedule, policy, scfg))
        # A partial of its own: jit shares one cache between wrappers of the same function,
        # and stats()["compilations"] counts this engine's entries only.
        self._add = jax.jit(functools.partial(add_requests))
        self._post = jitted_update(policy, scfg)
        self._abort = jax.jit(
            lambda s, ids, m: recycle(abort(policy, s, ids, m), ids, m), donate_argnums=(0,)
        )
        self._set_row = jax.jit(lambda buf, slot, row: buf.at[slot].set(row), donate_argnums=(0,))
        bs = self.block_size
        self._attach = jax.jit(functools.partial(sharing.attach_hits, bs), donate_argnums=(0,))
        self._register = jax.jit(functools.partial(sharing.register_step, bs), donate_argnums=(0,))
        self._fork = jax.jit(functools.partial(sharing.fork_children, bs), donate_argnums=(0,))
        self._usage = jax.jit(functools.partial(sharing.sharing_usage, bs))
        # K-step on-device decode loop (multi_step.py); K = 1 keeps the one-step path.
        self.multi_step = MultiStepDecoder(self.runner, policy, scfg, sc.num_multi_steps)
        self.prefix_index = PrefixIndex()
        self._relookup: set[int] = set()  # slots preempted by recompute: look up again
        self.reset_stats()

        # Per-slot sampling rows (host mirror, uploaded when a slot changes).
        self._slot_sampling = {
            k: np.array(v)
            for k, v in SamplingTensors.from_params([], self.max_seqs)._asdict().items()
        }
        self._slot_sampling_dev: SamplingTensors | None = None
        self._eos = {i for i in (*arch.eos_token_ids, tokenizer.eos_token_id) if i is not None}
        self._rng = np.random.default_rng(config.model.seed)
        self._requests: dict[str, RequestState] = {}
        self._queue: deque[tuple[RequestState, SequenceState]] = deque()  # sequences without a slot
        self._slot_owner: dict[int, tuple[RequestState, SequenceState]] = {}
        self._free_slots = list(range(self.max_seqs - 1, -1, -1))  # pop() gives slot 0 first
        self._arrival = 0
        self.num_preemptions = 0
        self.num_steps = 0
        if config.warmup != "none":  # "auto": decode on an accelerator, none on CPU
            self.warmup(mode=config.warmup, progress=True)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> LLMEngine:
        """Load config.model (directory or preset) and build the engine."""
        _reject_unbuilt_features(config)  # before spending time on loading weights
        arch, params, tokenizer, _ = load_model(config.model)
        return cls(arch, params, tokenizer, config, **kwargs)

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
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        self._validate(ids, params)
        if params.seed is None and not params.greedy:
            # Drawn here, once, so the request's samples survive preemption unchanged.
            params = params.with_seed(int(self._rng.integers(0, MAX_SEED + 1)))
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        target = max(1, min(max_tokens, self.max_model_len - len(ids)))
        req = RequestState(request_id, text, ids)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
            req.num_prompt_logprobs = params.prompt_logprobs
        for i in range(params.n):
            seq = SequenceState(
                index=i,
                params=params,
                detok=IncrementalDetokenizer(self.tokenizer, params.stop),
                target=target,
                arrival=self._arrival,
                logprobs=[] if params.logprobs is not None else None,
            )
            self._arrival += 1
            req.seqs.append(seq)
        # n > 1: only sample 0 prefills; the others fork its blocks when its prompt is done.
        self._queue.append((req, req.seqs[0]))
        req.pending = req.seqs[1:]
        self._requests[request_id] = req

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop requests now: their blocks return to the pool at once. Unknown ids are
        ignored (as vLLM: the request may have finished in the meantime)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        mask = np.zeros(self.max_seqs, bool)
        for rid in ids:
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if seq.slot is not None:
                    mask[seq.slot] = True
                    self._release_slot(seq)
            self._queue = deque(x for x in self._queue if x[0] is not req)
        if mask.any():
            self.state = self._abort(self.state, np.arange(self.max_seqs, dtype=np.int32), mask)

    abort = abort_request

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One iteration; returns the requests that got a token or finished (cumulative)."""
        self._assign_slots()
        if not self._slot_owner:
            return []
        outputs = self.multi_step.step(self)  # None: a host event needs the one-step path
        if outputs is not None:
            return outputs
        self.state, batch = self._schedule(self.state)
        host = jax.device_get(
            dict(
                num_tokens=batch.num_tokens,
                num_seqs=batch.num_seqs,
                seq_ids=batch.seq_ids,
                q_lens=batch.q_lens,
                start_pos=batch.start_pos,
                emits=batch.emits,
                rejected=batch.rejected,
                preempted=batch.preempted,
                reason=self.state.finish_reason,
                usage=self._usage(self.state),
                tables=self.state.mem.tables.tables if self.enable_prefix_caching else None,
                num_out=batch.swap.num_out,
                num_in=batch.swap.num_in,
                swapped_out=batch.swap.swapped_out,
                swapped_in=batch.swap.swapped_in,
            )
        )
        host["used"], host["unshared"] = host.pop("usage")
        self.multi_step.note_step(self, host)
        self.num_preemptions += int(host["preempted"].sum())
        self.num_steps += 1
        self._apply_swaps(batch, host)
        used, unshared = int(host["used"]), int(host["unshared"])
        if unshared > 0:
            self._sharing_steps += 1
            self._saved_frac_sum += 1.0 - used / unshared
            self._used_sum += used
            self._unshared_sum += unshared
        if self.enable_prefix_caching:
            self._relookup.difference_update(int(x) for x in host["seq_ids"][: host["num_seqs"]])
            recomputed = host["preempted"] & ~host["swapped_out"]
            self._relookup.update(int(x) for x in np.flatnonzero(recomputed))
        touched: dict[str, RequestState] = {}
        recycle_mask = np.zeros(self.max_seqs, bool)
        for slot in np.flatnonzero(host["rejected"]):
            req, seq = self._slot_owner[int(slot)]
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
        self.state = self._post(self.state, batch, finished_mask, recycle_mask)
        self._free_recycled(recycle_mask)
        outputs = [req.output() for req in touched.values()]
        for o in outputs:
            if o.finished:
                del self._requests[o.request_id]
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
        num_seqs = int(host["num_seqs"])
        seq_ids, emits = host["seq_ids"], host["emits"]
        owners = [self._slot_owner[int(seq_ids[r])] for r in range(num_seqs)]
        # A row holding prompt tokens of a request that wants prompt logprobs.
        all_logits = any(
            req.prompt_logprobs is not None and host["start_pos"][r] < len(req.prompt_token_ids)
            for r, (req, _) in enumerate(owners)
        )
        self._upload_sampling()
        self.kv, self.tokens, out, plp = self.runner.step(
            self.params,
            self.kv,
            self.tokens,
            self.state.mem,
            batch._replace(swap=None),  # applied by _apply_swaps; one pytree with warmup
            self._slot_sampling_dev,
            self.state.prompt_len,
            self.state.output_len,
            num_tokens=pick(self.token_buckets, int(host["num_tokens"])),
            num_seqs=pick(self.seq_buckets, num_seqs),
            all_logits=all_logits,
        )
        rows = [r for r in range(num_seqs) if emits[r]]
        want_top = any(owners[r][1].logprobs is not None for r in rows)
        fetch = [out.token_ids, out.logprobs]
        if want_top:  # [S, K] arrays: fetched only when a row asked for logprobs
            fetch += [out.ranks, out.top_ids, out.top_logprobs]
        got = jax.device_get(fetch)
        if plp is not None:
            self._record_prompt_logprobs(host, owners, jax.device_get(plp))
        for r in rows:
            req, seq = owners[r]
            top = (got[2][r], got[3][r], got[4][r]) if want_top else None
            if seq.record(int(got[0][r]), float(got[1][r]), top, self._eos):
                recycle_mask[seq.slot] = True
                finished_mask[r] = seq.finish_reason == "stop"
            touched[req.request_id] = req
        if self.enable_prefix_caching:
            self._register_blocks(batch, host, owners)
        for r in rows:
            req, seq = owners[r]
            if req.pending and seq.index == 0 and len(seq.detok.ids) == 1:
                self._fork_samples(req, seq)

    def _apply_swaps(self, batch: ScheduledBatch, host: dict) -> None:
        """Copy this step's swapped blocks: out (device -> host) first, while the freed
        device blocks still hold the group's KV (the forward and its copy-on-write copies
        may overwrite them this step), then in (host -> device) into the fresh blocks,
        before any forward reads them. One gather + device_get, one upload + scatter."""
        n_out, n_in = int(host["num_out"]), int(host["num_in"])
        out_slots = np.flatnonzero(host["swapped_out"])
        in_slots = np.flatnonzero(host["swapped_in"])
        self.num_preemptions_swap += len(out_slots)
        self.num_preemptions_recompute += int(host["preempted"].sum()) - len(out_slots)
        self._swapped_slots.update(int(x) for x in out_slots)
        self._swapped_slots.difference_update(int(x) for x in in_slots)
        sw = batch.swap
        if n_out:
            k = _bucket(n_out, sw.out_src.shape[0])
            pages, dst = jax.device_get((gather_blocks(self.kv, sw.out_src, k=k), sw.out_dst))
            dst = dst[:n_out]
            for host_layer, got_layer in zip(self.host_kv, pages, strict=True):
                for h, g in zip(host_layer, got_layer, strict=True):
                    h[dst] = g[:n_out]
            self.num_swapped_out_blocks += n_out
        if n_in:
            k = _bucket(n_in, sw.in_src.shape[0])
            src = np.zeros(k, np.int32)  # padding rows read the host null block
            src[:n_in] = jax.device_get(sw.in_src)[:n_in]
            pages = tuple(tuple(h[src] for h in layer) for layer in self.host_kv)
            self.kv = scatter_blocks(self.kv, sw.in_dst, sw.num_in, jax.device_put(pages))
            self.num_swapped_in_blocks += n_in

    def _register_blocks(self, batch: Any, host: dict, owners: list) -> None:
        """The step wrote the KV of its rows' tokens: mark the blocks it filled cached on
        device, and record their hashes -> block ids in the host hint."""
        self.state = self._register(
            self.state, self.tokens, batch.seq_ids, batch.start_pos, batch.q_lens
        )
        b = self.block_size
        for r, (req, seq) in enumerate(owners):
            start, q = int(host["start_pos"][r]), int(host["q_lens"][r])
            lo, hi = start // b, (start + q) // b
            if hi <= lo:
                continue
            extend_hashes(seq.hashes, req.prompt_token_ids + seq.detok.ids, b, hi)
            blocks = host["tables"][int(host["seq_ids"][r])]
            self.prefix_index.record(seq.hashes[lo:hi], [int(x) for x in blocks[lo:hi]])

    def _fork_samples(self, req: RequestState, parent: SequenceState) -> None:
        """Sample 0's prompt is computed (it just sampled its first token): give samples
        1..n-1 slots sharing its prompt blocks. Samples that find no free slot now wait in
        the host queue (front) as independent sequences (prefix caching may still share)."""
        n = self.max_seqs
        children = np.zeros(n, np.int32)
        mask = np.zeros(n, bool)
        max_tokens = np.ones(n, np.int32)
        arrivals = np.zeros(n, np.int32)
        k = 0
        leftover = []
        for seq in req.pending:
            if not self._free_slots:
                leftover.append(seq)
                continue
            slot = self._take_slot(req, seq)
            children[k], mask[k], max_tokens[k], arrivals[k] = slot, True, seq.target, seq.arrival
            seq.hashes = list(parent.hashes)  # the shared prompt blocks' hashes
            k += 1
        req.pending = []
        self._queue.extendleft((req, s) for s in reversed(leftover))
        if k:
            self._slot_sampling_dev = None
            self.state = self._fork(
                self.state, np.int32(parent.slot), children, mask, max_tokens, arrivals
            )
            self.num_forked += k

    def _record_prompt_logprobs(self, host: dict, owners: list, plp: Any) -> None:
        """Entry p + 1 of a request's prompt_logprobs scores prompt token p + 1 given the
        tokens before it (entry 0 stays None, as vLLM). A recompute after preemption or a
        second sample writes the same values again."""
        cu = np.concatenate([[0], np.cumsum(host["q_lens"][: len(owners)])])
        for r, (req, _) in enumerate(owners):
            if req.prompt_logprobs is None:
                continue
            k = req.num_prompt_logprobs
            for t in range(int(cu[r]), int(cu[r + 1])):
                p = int(host["start_pos"][r]) + t - int(cu[r])
                if p + 1 >= len(req.prompt_token_ids):
                    break
                tok = req.prompt_token_ids[p + 1]
                decode = self.tokenizer.decode
                entry = {tok: Logprob(float(plp.logprobs[t]), int(plp.ranks[t]), decode([tok]))}
                for j in range(k):
                    tid = int(plp.top_ids[t, j])
                    if tid not in entry:
                        entry[tid] = Logprob(float(plp.top_logprobs[t, j]), j + 1, decode([tid]))
                req.prompt_logprobs[p + 1] = entry

    # ------------------------------------------------------------------ helpers

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence | np.ndarray):
            return None, self._check_ids(prompt)
        raise TypeError(f"prompt must be a str, token ids or a prompt dict, got {prompt!r}")

    def _check_ids(self, ids: Any) -> list[int]:
        out = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int | np.integer):
                raise ValueError(f"prompt token ids must be ints, got {i!r}")
            if not 0 <= i < self.arch.vocab_size:
                raise ValueError(
                    f"prompt token id {i} outside the vocabulary [0, {self.arch.vocab_size})"
                )
            out.append(int(i))
        return out

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        limit = self.sched_config.prompt_limit
        if len(ids) > limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens, longer than the limit {limit}"
                f" (max_model_len={self.max_model_len}"
                + (
                    ""
                    if self.sched_config.chunked_prefill
                    else f", or max_num_batched_tokens={self.sched_config.max_num_batched_tokens}:"
                    f" {self.sched_config.mode} mode does not chunk prompts"
                )
                + ")"
            )
        usable = self.num_blocks - 1 - self.policy.watermark_blocks
        need = int(blocks_for(len(ids), self.block_size))
        if need > usable:
            raise ValueError(
                f"prompt of {len(ids)} tokens needs {need} KV blocks but the pool can never"
                f" give more than {usable} ({self.num_blocks} blocks of {self.block_size},"
                " minus the null block and the watermark)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name}={k} exceeds max_logprobs={self.max_logprobs}")
        for t in params.stop_token_ids:
            if t >= self.arch.vocab_size:
                raise ValueError(f"stop_token_ids has {t}, outside the vocabulary")

    def _assign_slots(self) -> None:
        """Give queued sequences free slots (FCFS), register them with the scheduler, then
        (prefix caching) attach cached prefixes to them and to re-waiting preempted slots."""
        new: list[int] = []
        if self._queue and self._free_slots:
            n = self.max_seqs
            slot_ids = np.zeros(n, np.int32)
            prompt_lens = np.ones(n, np.int32)
            max_tokens = np.ones(n, np.int32)
            arrivals = np.zeros(n, np.int32)
            groups = np.zeros(n, np.int32)
            mask = np.zeros(n, bool)
            k = 0
            while self._queue and self._free_slots:
                req, seq = self._queue.popleft()
                slot = self._take_slot(req, seq)
                slot_ids[k], prompt_lens[k], max_tokens[k] = (
                    slot,
                    len(req.prompt_token_ids),
                    seq.target,
                )
                arrivals[k], mask[k] = seq.arrival, True
                groups[k] = req.seqs[0].arrival  # unique among live groups
                new.append(slot)
                k += 1
            self._slot_sampling_dev = None
            final = prompt_lens + max_tokens
            self.state = self._add(
                self.state, slot_ids, prompt_lens, max_tokens, final, arrivals, mask, groups
            )
        if self.enable_prefix_caching:
            if self._swapped_slots:
                # No admission while a group is swapped out: a lookup now would hold
                # cached blocks for a sequence that cannot run. Look up later.
                self._relookup.update(new)
                return
            lookup = new + sorted(s for s in self._relookup if s in self._slot_owner)
            self._relookup.clear()
            # A request that wants prompt logprobs must compute every prompt position:
            # a cache hit would skip them and leave its entries empty (vLLM skips the
            # lookup for such requests too). Its blocks are still registered for others.
            lookup = [s for s in lookup if self._slot_owner[s][0].prompt_logprobs is None]
            if lookup:
                self._lookup(lookup)

    def _take_slot(self, req: RequestState, seq: SequenceState) -> int:
        """Bind a free slot to seq: owner map, token buffer row (prompt + any output kept
        for a recompute) and sampling row."""
        slot = self._free_slots.pop()
        seq.slot = slot
        self._slot_owner[slot] = (req, seq)
        ids = req.prompt_token_ids + seq.detok.ids
        row = np.zeros(self.max_model_len, np.int32)
        row[: len(ids)] = ids
        self.tokens = self._set_row(self.tokens, np.int32(slot), row)
        t = SamplingTensors.from_params([(seq.params, seq.index, len(seq.detok.ids))], 1)
        for name, v in t._asdict().items():
            self._slot_sampling[name][slot] = v[0]
        return slot

    def _lookup(self, slots: list[int]) -> None:
        """Prefix-cache lookup for WAITING slots with empty tables (docs/engine.md):
        the host proposes hinted blocks, the device verifies, acquires and attaches them,
        and sets num_computed to the hit, before ``schedule`` sees the slots."""
        n, m, b = self.max_seqs, self.max_blocks_per_seq, self.block_size
        slot_arr = np.zeros(n, np.int32)
        cand = np.full((n, m), NULL_BLOCK, np.int32)
        mask = np.zeros(n, bool)
        props = []
        for k, slot in enumerate(slots):
            req, seq = self._slot_owner[slot]
            ids = req.prompt_token_ids + seq.detok.ids
            extend_hashes(seq.hashes, ids, b, len(ids) // b)
            hashes = seq.hashes[: len(ids) // b]
            prop = self.prefix_index.propose(hashes)
            slot_arr[k], mask[k] = slot, True
            cand[k, : len(prop)] = prop
            props.append((hashes, len(prop), len(ids)))
        self.state, verified, used = self._attach(self.state, self.tokens, slot_arr, cand, mask)
        verified, used = jax.device_get((verified, used))
        for k, (hashes, proposed, total) in enumerate(props):
            hit = int(verified[k])
            if hit < proposed:
                self.prefix_index.forget(hashes[hit:proposed])
            self.prefix_index.count(proposed, hit)
            self._lookup_tokens += total
            self._hit_tokens += int(used[k]) * b

    def _free_recycled(self, recycle_mask: np.ndarray) -> None:
        for slot in np.flatnonzero(recycle_mask):
            self._release_slot(self._slot_owner[int(slot)][1])

    def _upload_sampling(self) -> None:
        if self._slot_sampling_dev is None:
            self._slot_sampling_dev = SamplingTensors(
                **{k: jnp.asarray(v) for k, v in self._slot_sampling.items()}
            )

    def _release_slot(self, seq: SequenceState) -> None:
        assert seq.slot is not None
        del self._slot_owner[seq.slot]
        self._swapped_slots.discard(seq.slot)
        self._free_slots.append(seq.slot)
        seq.slot = None

    def _profile(self, budget: int, max_blocks: int) -> None:
        """One forward at the largest bucket over a 2-block cache (GPU sizing only)."""
        s = self.max_num_seqs
        kv = allocate_kv_cache(self.arch, 2, self.block_size, self.kv_dtype)
        batch = dummy_input(budget, s, max_blocks)._replace(
            logits_indices=jnp.zeros((s,), jnp.int32)
        )
        _, logits = make_forward(self.arch, donate=False)(self.params, kv, batch)
        # The sampler holds a few [S, V] float32 arrays on top of the forward's peak.
        scratch = jnp.zeros((4, s, self.arch.vocab_size), jnp.float32)
        jax.block_until_ready((logits, scratch))

    def warmup(
        self,
        pairs: Iterable[tuple[int, int]] | None = None,
        *,
        mode: str = "decode",
        progress: bool = False,
    ) -> list[tuple[int, int]]:
        """Compile now, by running on no-op inputs (``warmup.py``): ``mode`` "decode"
        (decode pairs, the largest prefill pair, decode loops, state functions), "all"
        (every reachable (T, S) pair too) or "none"; ``pairs`` runs just those runner
        pairs. Returns the runner pairs run. Costs one compilation per new program."""
        return warm_up(self, mode, pairs, progress)

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
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._sharing_steps = 0
        self._saved_frac_sum = 0.0
        self._used_sum = 0
        self._unshared_sum = 0
        self.num_forked = 0
        self.multi_step.reset_stats()
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
        blocks_saved_by_sharing: 1 - blocks in use / blocks without sharing, averaged
            over steps (a step counts when some sequence holds blocks); the ratio of the
            sums is ``blocks_saved_by_sharing_total``.
        preemptions_recompute / preemptions_swap: sequences preempted by each kind.
        swapped_out_blocks / swapped_in_blocks: KV blocks copied device -> host and
            host -> device (a block shared within a group counts once).
        """
        q = self._lookup_tokens
        steps = self._sharing_steps
        return dict(
            prefix_cache_queries=self.prefix_index.queries,
            prefix_cache_query_tokens=q,
            prefix_cache_hit_tokens=self._hit_tokens,
            prefill_tokens_saved=self._hit_tokens,
            prefix_cache_hit_rate=self._hit_tokens / q if q else 0.0,
            blocks_saved_by_sharing=self._saved_frac_sum / steps if steps else 0.0,
            blocks_saved_by_sharing_total=(
                1.0 - self._used_sum / self._unshared_sum if self._unshared_sum else 0.0
            ),
            sharing_steps=steps,
            forked_samples=self.num_forked,
            preemptions_recompute=self.num_preemptions_recompute,
            preemptions_swap=self.num_preemptions_swap,
            swapped_out_blocks=self.num_swapped_out_blocks,
            swapped_in_blocks=self.num_swapped_in_blocks,
            **self._compile_and_loop_stats(),
        )

    def _compile_and_loop_stats(self) -> dict[str, int]:
        """compilations: executables compiled for this engine's jitted functions (never
        reset); xla_compilations: backend compilations in the whole process (never reset);
        multi_step_*: decode-loop dispatches and the engine iterations they ran."""
        ms = self.multi_step.stats
        return dict(
            compilations=engine_compilations(self),
            xla_compilations=backend_compilations()[0],
            multi_step_loops=ms.loops,
            multi_step_iterations=ms.iterations,
            multi_step_rolled_back=ms.rolled_back,
            multi_step_pipelined=ms.pipelined,
        )


def num_host_blocks(
    swap_space_gib: float, bytes_per_block: int, max_useful: int, preemption_mode: str | None
) -> int:
    """Blocks of the host swap pool: ``swap_space`` GiB / bytes per block (all layers),
    capped at ``max_useful`` (every slot's whole block table: more can never be used),
    and 0 when preemption is by recompute only."""
    if preemption_mode == "recompute":
        return 0
    return min(int(swap_space_gib * (1 << 30)) // bytes_per_block, max_useful)


def _bucket(n: int, limit: int) -> int:
    """The power of two >= n, at most limit (the swap copies' padding bucket)."""
    return min(1 << max(n - 1, 0).bit_length(), limit)


def _reject_unbuilt_features(config: EngineConfig) -> None:
    if config.parallel.tensor_parallel_size > 1 or config.parallel.data_parallel_size > 1:
        raise NotImplementedError(
            "tensor_parallel_size / data_parallel_size > 1: multi-device execution is not"
            " implemented yet"
        )
