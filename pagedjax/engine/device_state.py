"""The engine's device state: scheduler state, KV pool, token buffer, sampling rows.

Everything a step's device programs read and write, and the small jitted functions
that change it between model steps (admission, abort, update + recycle, prefix-cache
attach and register, fork of n > 1 samples, token-row writes). Each method runs one
jitted dispatch and keeps the result, so callers never hold a stale copy of a donated
buffer: read ``state``, ``kv`` and ``tokens`` after the call, never before it.

Arrays (shapes are the contract, docs/engine.md):

- ``state``: the scheduler's ``SchedulerState`` (block pool, block tables, lengths).
- ``kv``: (k, v), each [num_layers, num_blocks, num_kv_heads, block_size, head_dim]
  (an 8-bit pool: each a ``QuantizedPages`` pytree of values and scales; every leaf is
  indexed [layer, block, ...], so the block operations below are ``jax.tree`` maps).
- ``tokens``: int32[max_seqs, max_model_len], prompt + output ids per slot; the model
  reads its inputs here, so the host never uploads a batch.
- ``host_kv``: the swap pool, ``kv``'s pytree with numpy leaves of [num_layers,
  num_host_blocks + 1, ...] (block 0 is its null block; 8-bit values and scales alike).
- sampling rows: a host mirror (numpy, one row per slot) uploaded as one
  ``SamplingTensors``, each field only when one of its rows changed since the last
  upload (the [max_seqs, ceil(V / 32)] masks change every step for constrained rows;
  the other fields need not travel with them).

Argument types are passed through unchanged (numpy stays numpy): jit caches by them, and
warm-up (``warmup.py``) compiles exactly the signatures the engine later uses.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine import sharing
from pagedjax.engine.host_arrays import upload
from pagedjax.engine.model_runner import gather_blocks, jitted_update, scatter_blocks
from pagedjax.memory import host_tier
from pagedjax.sampling import SamplingParams, SamplingTensors
from pagedjax.sampling.tensors import SHARED_FIELDS
from pagedjax.scheduler import (
    ScheduledBatch,
    SwapPlan,
    abort,
    add_requests,
    init_state,
    recycle,
    schedule,
)


class DeviceState:
    """Device arrays of one engine and the jitted functions over them.

    policy, sched_limits: the memory policy and the jitted scheduler's ``SchedulerLimits``.
    kv: the allocated pool. max_model_len: the token buffer's width. num_host_blocks:
    swap pool size (0: none).
    """

    def __init__(
        self,
        policy: Any,
        sched_limits: Any,
        kv: Any,
        *,
        max_model_len: int,
        num_host_blocks: int,
        vocab_size: int = 0,
    ):
        n = sched_limits.max_seqs
        self.vocab_size = vocab_size  # the sampling rows' logit controls (0: none)
        self.max_seqs = n
        self.block_size = bs = policy.block_size
        self.state = init_state(policy, n)
        self.kv = kv
        self.tokens = upload(np.zeros((n, max_model_len), np.int32))  # host_arrays.py
        self.host_kv = jax.tree.map(
            lambda p: np.zeros((p.shape[0], num_host_blocks + 1, *p.shape[2:]), p.dtype), kv
        )
        # The scheduler: its jit, and the same function compiled or loaded from the program
        # store by the warm-up (``schedule_program``: no tracing at a warm start, the
        # scheduler being the largest trace after the steps). Observing each step's batch
        # is ``LLMEngine.add_step_observer``'s, not a wrapper around this function.
        self._policy = self.policy = policy  # public: lora_paging checks lend_blocks
        self.schedule_partial = functools.partial(schedule, policy, sched_limits)
        self._schedule_jit = jax.jit(self.schedule_partial)
        self.schedule_program: Any = None
        self._schedule_override: Any = None  # use_schedule_limits
        # A partial of its own: jit shares one cache between wrappers of the same function,
        # and stats()["compilations"] counts this engine's entries only.
        self._add = jax.jit(functools.partial(add_requests))
        self._post = jitted_update(policy, sched_limits)
        self._abort = jax.jit(
            lambda s, ids, m: recycle(abort(policy, s, ids, m), ids, m), donate_argnums=(0,)
        )
        ids = np.arange(n, dtype=np.int32)
        self._recycle = jax.jit(lambda s, m: recycle(s, ids, m), donate_argnums=(0,))
        self._set_row = jax.jit(lambda buf, slot, row: buf.at[slot].set(row), donate_argnums=(0,))
        self._append = jax.jit(_append_outputs, donate_argnums=(0, 1))
        self._attach = jax.jit(functools.partial(sharing.attach_hits, bs), donate_argnums=(0,))
        self._register = jax.jit(functools.partial(sharing.register_step, bs), donate_argnums=(0,))
        self._fork = jax.jit(functools.partial(sharing.fork_children, bs), donate_argnums=(0,))
        self._usage = jax.jit(functools.partial(sharing.sharing_usage, bs))
        self._reloaded = jax.jit(functools.partial(sharing.attach_reloaded, bs),
                                 donate_argnums=(0,))  # fmt: skip
        self._exchange = jax.jit(_host_exchange, donate_argnums=(0,), static_argnums=(4,))
        self._read = jax.jit(_read_blocks)
        # Blocks lent to LoRA adapters paged in the pool (engine/lora_paging.py). Not
        # donated: a fresh state shares one zeros buffer between fields (init_state), and
        # these run only when an adapter loads or leaves.
        self._lend = jax.jit(functools.partial(_lend_blocks, policy), static_argnums=(2,))
        self._return = jax.jit(functools.partial(_return_blocks, policy))
        neutral = SamplingTensors.from_params([], n, vocab_size)._asdict()
        self._rows = {k: np.array(v) for k, v in neutral.items() if k not in SHARED_FIELDS}
        # The device FSM's shared table and token classes (set_fsm_tables; empty: none).
        self._shared = {k: np.array(neutral[k]) for k in SHARED_FIELDS}
        self._rows_dev: SamplingTensors | None = None
        self._fields_dev: dict[str, Any] = {}  # uploaded fields, dropped when one changes
        self._no_lookahead = np.zeros(n, np.int32)

    def jits(self) -> dict[str, Any]:
        """The jitted functions by name (each has ``_cache_size()``: compile counting)."""
        return dict(
            schedule=self._schedule_jit,
            update=self._post,
            add_requests=self._add,
            abort=self._abort,
            recycle=self._recycle,
            set_row=self._set_row,
            append_outputs=self._append,
            attach_hits=self._attach,
            register_step=self._register,
            fork=self._fork,
            sharing_usage=self._usage,
            attach_reloaded=self._reloaded,
            host_exchange=self._exchange,
            read_blocks=self._read,
            lend_blocks=self._lend,
            return_blocks=self._return,
        )

    # ------------------------------------------------------------------ scheduler state

    def _scheduler(self) -> Any:
        if self._schedule_override is not None:
            return self._schedule_override
        if self.schedule_program is not None:
            return self.schedule_program
        return self._schedule_jit

    def use_schedule_limits(self, limits: Any | None) -> None:
        """Schedule with other ``SchedulerLimits`` of the same shapes (same ``max_seqs``),
        e.g. another preemption mode, the model programs kept (tests); None: the engine's
        own scheduler again (its jit and warm-started program were kept)."""
        if limits is None:
            self._schedule_override = None
            return
        if limits.max_seqs != self.max_seqs:
            raise ValueError(f"limits.max_seqs={limits.max_seqs} != max_seqs={self.max_seqs}")
        self._schedule_override = jax.jit(functools.partial(schedule, self._policy, limits))

    def schedule(self, lookahead: np.ndarray | None = None) -> ScheduledBatch:
        """One ``schedule``: the state advances, the step's batch is returned.
        lookahead: int32[max_seqs] speculative slots by slot (None: none)."""
        la = self._no_lookahead if lookahead is None else lookahead
        self.state, batch = self._scheduler()(self.state, la)
        return batch

    def preview_schedule(self) -> tuple[Any, ScheduledBatch]:
        """What ``schedule`` would return, the state left as it is (not donated)."""
        return self._scheduler()(self.state, self._no_lookahead)

    def usage(self) -> tuple[jax.Array, jax.Array]:
        """(blocks referenced, blocks without sharing) of the current state, on device."""
        return self._usage(self.state)

    def add_requests(self, *arrays: Any) -> None:
        """``scheduler.add_requests`` on the state: (slot_ids, prompt_lens, max_tokens,
        final_lens, arrivals, mask, groups), each [max_seqs]."""
        self.state = self._add(self.state, *arrays)

    def abort(self, ids: Any, mask: Any) -> None:
        """Abort and recycle the masked slots: their blocks return to the pool now."""
        self.state = self._abort(self.state, ids, mask)

    def update(self, batch: ScheduledBatch, finished: Any, recycle_mask: Any,
               accepted: Any = None) -> None:  # fmt: skip
        """``update`` (stop mask over the batch rows; drafts accepted per batch row, None:
        none) then ``recycle`` of the masked slots."""
        acc = self._no_lookahead if accepted is None else accepted
        self.state = self._post(self.state, batch, finished, recycle_mask, acc)

    def write_tokens(self, fn: Any, *args: Any) -> None:
        """tokens = fn(tokens, *args): a jitted write into the token buffer (drafts)."""
        self.tokens = fn(self.tokens, *args)

    # ------------------------------------------------------------------ device programs
    # The model programs take the pool and the token buffer donated and return new ones;
    # these methods keep the results, so no caller holds a donated (deleted) buffer.

    def run_program(self, fn: Any, params: Any, *args: Any, **kwargs: Any) -> tuple:
        """fn(params, kv, tokens, *args, **kwargs) -> (kv', tokens', *rest): a step,
        verification or drafting program over the pool; keeps kv', tokens', returns rest."""
        self.kv, self.tokens, *rest = fn(params, self.kv, self.tokens, *args, **kwargs)
        return tuple(rest)

    def run_step(self, runner: Any, params: Any, batch: Any,
                 before_sampling: Any = None, **kwargs: Any) -> tuple:  # fmt: skip
        """The plain step over ``batch``: ``runner.run`` (one program); returns its
        sampled rows and prompt logprobs. before_sampling(logits): a host callback run
        once the step's forward (``runner.run_forward``) has been dispatched and before
        its sampling (``runner.sample_step``); it writes sampling rows (grammar masks),
        uploaded after it. The pool the forward returns is kept before the callback runs,
        so a callback that raises leaves no donated (deleted) buffer behind."""
        st = self.state
        if before_sampling is None:
            return self.run_program(runner.run, params, st.mem, batch, self.sampling(),
                                    st.prompt_len, st.output_len, **kwargs)  # fmt: skip
        self.kv, logits, plp = runner.run_forward(params, self.kv, self.tokens, st.mem, batch,
                                                  st.prompt_len, **kwargs)  # fmt: skip
        before_sampling(logits)
        self.tokens, out = runner.sample_step(logits, self.tokens, batch, self.sampling(),
                                              st.prompt_len, st.output_len,
                                              num_seqs=kwargs["num_seqs"])  # fmt: skip
        return out, plp

    def run_loop(self, fn: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(params, state, kv, tokens, *args, **kwargs) -> (state', kv', tokens', out):
        the K-step decode loop; keeps the state, pool and buffer, returns out."""
        self.state, self.kv, self.tokens, out = fn(
            params, self.state, self.kv, self.tokens, *args, **kwargs
        )
        return out

    def with_tokens(self, fn: Any) -> Any:
        """fn(tokens) -> (tokens', result): a program that writes the token buffer (a
        draft model's proposals); keeps tokens', returns result."""
        self.tokens, result = fn(self.tokens)
        return result

    def reassign(self, fn: Any, *args: Any) -> None:
        """fn(state, tokens, *args) -> (state', tokens'): beam search's re-binding of
        slots to new beams (blocks and token rows together)."""
        self.state, self.tokens = fn(self.state, self.tokens, *args)

    def transform_pools(self, fn: Any) -> None:
        """fn(kv, host_kv) -> (kv', host_kv'): a change of both pools' representation
        (KV scale calibration re-quantizes them)."""
        self.kv, self.host_kv = fn(self.kv, self.host_kv)

    def recycle(self, mask: Any) -> None:
        """Mark the masked FINISHED slots FREE (their results were read)."""
        self.state = self._recycle(self.state, mask)

    def set_token_row(self, slot: Any, row: Any) -> None:
        """tokens[slot] = row (int32[max_model_len]); slot a numpy int32 scalar."""
        self.tokens = self._set_row(self.tokens, slot, row)

    def append_outputs(self, slots: np.ndarray, positions: np.ndarray, tokens: np.ndarray,
                       counts: np.ndarray) -> None:  # fmt: skip
        """Output tokens the host appended after a slot's last sampled one, their KV not
        computed (jump-forward decoding, engine/jump_forward.py): row i writes
        ``tokens[i, :counts[i]]`` at ``positions[i]`` .. of slot ``slots[i]``'s buffer row
        and adds counts[i] to its output_len (num_computed unchanged), so the next
        ``schedule`` gives the slot 1 + counts[i] tokens, a chunk like a prefill's, whose
        last position is sampled. slots, positions, counts: int32[max_seqs]; tokens:
        int32[max_seqs, K], K a padding bucket (a few compiled sizes); count-0 rows write
        nothing. One jitted dispatch, called only in steps that appended some."""
        self.state, self.tokens = self._append(self.state, self.tokens, slots, positions,
                                               tokens, counts)  # fmt: skip

    def attach_hits(self, slots: Any, candidates: Any, mask: Any) -> tuple[Any, Any]:
        """Prefix-cache attach (``sharing.attach_hits``); returns (verified, used) blocks
        per row, on device."""
        self.state, verified, used = self._attach(self.state, self.tokens, slots, candidates,
                                                  mask)  # fmt: skip
        return verified, used

    def register_step(self, seq_ids: Any, start_pos: Any, q_lens: Any) -> None:
        """Mark the blocks a step filled as cached (``sharing.register_step``)."""
        self.state = self._register(self.state, self.tokens, seq_ids, start_pos, q_lens)

    def fork(self, parent: Any, children: Any, mask: Any, max_tokens: Any, arrivals: Any) -> None:
        """Masked children share the parent slot's blocks (``sharing.fork_children``)."""
        self.state = self._fork(self.state, parent, children, mask, max_tokens, arrivals)

    # ------------------------------------------------------------------ swap

    def swap_out(self, plan: SwapPlan, count: int, bucket: int) -> None:
        """Copy ``count`` blocks device -> host (``plan.out_src`` -> ``plan.out_dst``); one
        gather of ``bucket`` >= count blocks (a padding bucket) and one transfer."""
        pages, dst = jax.device_get((gather_blocks(self.kv, plan.out_src, k=bucket),
                                     plan.out_dst))  # fmt: skip
        dst = dst[:count]
        for h, g in zip(jax.tree.leaves(self.host_kv), jax.tree.leaves(pages), strict=True):
            h[:, dst] = g[:, :count]

    def swap_in(self, plan: SwapPlan, count: int, bucket: int) -> None:
        """Copy ``count`` blocks host -> device (``plan.in_src`` -> ``plan.in_dst``): one
        upload of ``bucket`` pages (padding rows read the host null block), one scatter."""
        src = np.zeros(bucket, np.int32)
        src[:count] = jax.device_get(plan.in_src)[:count]
        pages = jax.tree.map(lambda h: h[:, src], self.host_kv)
        self.kv = scatter_blocks(self.kv, plan.in_dst, plan.num_in, jax.device_put(pages))

    # ------------------------------------------------------------------ host tier
    # (docs/kv_tiers.md; the engine side is kv_offload.py)

    def attach_reloaded(self, slots: Any, kinds: Any, cands: Any, mask: Any) -> tuple:
        """``sharing.attach_reloaded``: the rest of a cached prefix after the device hit;
        returns (new, got, total, was_cached, old_tokens) on device."""
        self.state, *out = self._reloaded(self.state, self.tokens, slots, kinds, cands, mask)
        return tuple(out)

    def host_exchange(self, release: np.ndarray, n: int) -> np.ndarray:
        """``host_tier.exchange`` on the host pool: drop the tier's references to
        ``release``, take up to ``n`` blocks; returns the blocks taken (numpy). Both
        arrays are padded to one power of two >= 16 (a few compiled sizes)."""
        k = _bucket(max(len(release), n))
        rel = np.zeros(k, np.int32)
        rel[: len(release)] = release
        self.state, blocks, count = self._exchange(self.state, rel, np.int32(len(release)),
                                                   np.int32(n), k)  # fmt: skip
        blocks, count = jax.device_get((blocks, count))
        return blocks[: int(count)]

    def read_blocks(self, ids: np.ndarray) -> tuple[Any, np.ndarray]:
        """(KV pages of device blocks ``ids`` as numpy leaves [L, len(ids), ...], their
        prefix-cache tokens int32[len(ids), B]): one gather of a padding bucket."""
        n = len(ids)
        src = np.zeros(_bucket(n), np.int32)
        src[:n] = ids
        pages, toks = jax.device_get(self._read(self.kv, self.state.mem.prefix.tokens, src))
        return jax.tree.map(lambda p: p[:, :n], pages), toks[:n]

    def write_host_blocks(self, dst: np.ndarray, pages: Any) -> None:
        """host_kv[:, dst] = pages (numpy leaves [L, len(dst), ...])."""
        for h, g in zip(jax.tree.leaves(self.host_kv), jax.tree.leaves(pages), strict=True):
            h[:, dst] = g[:, : len(dst)]

    def read_host_blocks(self, src: np.ndarray) -> Any:
        """A copy of host blocks ``src`` (numpy leaves [L, len(src), ...])."""
        return jax.tree.map(lambda h: h[:, src], self.host_kv)

    def write_blocks(self, dst: np.ndarray, pages: Any) -> None:
        """kv[:, dst] = pages (numpy leaves [L, len(dst), ...]): one upload of a padding
        bucket (padding rows write nothing), one scatter."""
        n = len(dst)
        k = _bucket(n)
        ids = np.zeros(k, np.int32)
        ids[:n] = dst
        padded = jax.tree.map(
            lambda p: np.concatenate([p, np.zeros((p.shape[0], k - n, *p.shape[2:]), p.dtype)],
                                     axis=1), pages)  # fmt: skip
        self.kv = scatter_blocks(self.kv, ids, np.int32(n), jax.device_put(padded))

    # ------------------------------------------------------------------ lent blocks
    # (LoRA adapters paged in the KV pool: engine/lora_paging.py)

    def num_free_blocks(self) -> int:
        """The device pool's free blocks now (one scalar read: a sync)."""
        return int(self.state.mem.pool.num_free)

    def lend_blocks(self, n: int, max_n: int) -> np.ndarray | None:
        """Take ``n`` <= max_n free blocks out of the pool for non-KV contents (the
        policy's ``lend_blocks``): their ids (numpy int32 [n]), or None when fewer are
        free (nothing taken). One dispatch (one program per max_n) and one read."""
        self.state, blocks, ok = self._lend(self.state, np.int32(n), max_n)
        blocks, ok = jax.device_get((blocks, ok))
        return np.asarray(blocks[:n], np.int32) if bool(ok) else None

    def return_blocks(self, blocks: np.ndarray, max_n: int) -> None:
        """Give lent ``blocks`` (len <= max_n) back to the free list (``return_blocks``)."""
        ids = np.zeros(max_n, np.int32)
        ids[: len(blocks)] = blocks
        self.state = self._return(self.state, ids, np.int32(len(blocks)))

    def write_lent_pages(self, blocks: np.ndarray, pages: Any) -> None:
        """kv[:, blocks[i]] = pages[:, i] (pages: (k, v) device arrays [L, max_n, ...],
        max_n >= len(blocks); rows past len(blocks) write nothing): one scatter."""
        max_n = jax.tree.leaves(pages)[0].shape[1]
        ids = np.zeros(max_n, np.int32)
        ids[: len(blocks)] = blocks
        self.kv = scatter_blocks(self.kv, ids, np.int32(len(blocks)), pages)

    # ------------------------------------------------------------------ sampling rows

    def sampling(self) -> SamplingTensors:
        """The per-slot sampling tensors on device (the changed fields uploaded)."""
        if self._rows_dev is None:
            for k, v in (*self._rows.items(), *self._shared.items()):
                if k not in self._fields_dev:
                    self._fields_dev[k] = upload(v)  # a copy: the mirror changes in place
            self._rows_dev = SamplingTensors(**self._fields_dev)
        return self._rows_dev

    def set_sampling_row(
        self, slot: int, params: SamplingParams, index: int, num_output: int
    ) -> None:
        """The slot's row for sample ``index`` of a request, ``num_output`` tokens in."""
        t = SamplingTensors.from_params([(params, index, num_output)], 1, self.vocab_size)
        for name, v in t._asdict().items():
            if name not in SHARED_FIELDS:
                self.set_sampling_value(name, slot, v[0])

    def set_fsm_tables(self, table: np.ndarray, class_of: np.ndarray) -> None:
        """The device FSM's shared fields (SamplingTensors.fsm_table, fsm_class); uploaded
        with the next ``sampling()`` when they changed."""
        for name, v in (("fsm_table", table), ("fsm_class", class_of)):
            cur = self._shared[name]
            if cur.shape != v.shape or not np.array_equal(cur, v):
                self._shared[name] = np.array(v, np.int32)
                self._rows_dev = None
                self._fields_dev.pop(name, None)

    def copy_sampling_row(self, dst: int, src: int) -> None:
        """Slot dst samples as slot src does (a new beam of the same group)."""
        for name, v in self._rows.items():
            self.set_sampling_value(name, dst, v[src].copy())

    def set_sampling_value(self, name: str, slot: int, value: Any) -> None:
        """One field of one row (a ``SamplingTensors`` field name); a value equal to the
        row's current one changes nothing (no upload)."""
        row = self._rows[name]
        if np.array_equal(row[slot], value):
            return
        row[slot] = value
        self._rows_dev = None
        self._fields_dev.pop(name, None)

    def sampling_value(self, name: str, slot: int) -> np.ndarray:
        """One field of one row, as the host mirror holds it (read-only use)."""
        return self._rows[name][slot]

    def mark_sampling_stale(self) -> None:
        """Upload the rows again before the next use (slots were re-bound)."""
        self._rows_dev = None
        self._fields_dev.clear()


def _host_exchange(state: Any, release: Any, num_release: Any, n: Any, max_n: int) -> tuple:
    """``host_tier.exchange`` on ``state.mem.host_pool``: (state', blocks, count)."""
    pool, blocks, count = host_tier.exchange(state.mem.host_pool, release, num_release, n, max_n)
    return state._replace(mem=state.mem._replace(host_pool=pool)), blocks, count


def _append_outputs(state: Any, tokens: Any, slots: Any, positions: Any, toks: Any,
                    counts: Any) -> tuple[Any, Any]:  # fmt: skip
    """(state', tokens') of ``DeviceState.append_outputs``."""
    n, k = toks.shape
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    row = jnp.where(j < counts[:, None], slots[:, None], tokens.shape[0])  # past: dropped
    tokens = tokens.at[row, positions[:, None] + j].set(toks, mode="drop")
    ids = jnp.where(counts > 0, slots, state.output_len.shape[0])
    return state._replace(output_len=state.output_len.at[ids].add(counts, mode="drop")), tokens


def _lend_blocks(policy: Any, state: Any, n: Any, max_n: int) -> tuple[Any, Any, Any]:
    """(state', blocks, ok): the memory policy's ``lend_blocks`` on ``state.mem``."""
    mem, blocks, ok = policy.lend_blocks(state.mem, n, max_n)
    return state._replace(mem=mem), blocks, ok


def _return_blocks(policy: Any, state: Any, blocks: Any, count: Any) -> Any:
    """state': the memory policy's ``return_blocks`` on ``state.mem``."""
    return state._replace(mem=policy.return_blocks(state.mem, blocks, count))


def _read_blocks(kv: Any, prefix_tokens: Any, src: Any) -> tuple[Any, Any]:
    """(KV pages of blocks ``src``, their prefix-cache tokens): one program."""
    return gather_blocks(kv, src, k=src.shape[0]), prefix_tokens[src]


def _bucket(n: int) -> int:
    """The host tier's copy padding: a power of two >= max(n, 16)."""
    return padding_bucket(max(n, 16), 1 << 30)


def padding_bucket(n: int, limit: int) -> int:
    """The power of two >= n, at most limit (the swap copies' padding bucket)."""
    return min(1 << max(n - 1, 0).bit_length(), limit)


def num_host_blocks(
    swap_space_gib: float, bytes_per_block: int, max_useful: int, preemption_mode: str | None
) -> int:
    """Blocks of the host swap pool: ``swap_space`` GiB / bytes per block (all layers),
    capped at ``max_useful`` (every slot's whole block table: more can never be used),
    and 0 when preemption is by recompute only."""
    if preemption_mode == "recompute":
        return 0
    return min(int(swap_space_gib * (1 << 30)) // bytes_per_block, max_useful)


__all__ = ["DeviceState", "num_host_blocks", "padding_bucket"]
