"""The device half of one engine step, as one jitted function per padding bucket.

``step(params, kv, tokens, mem, batch, slot_sampling, prompt_len, output_len)`` builds the
ragged ModelInput from the scheduler's batch and the token buffer (on device, no host
round trip), applies the pending copy-on-write block copies, runs the forward, samples
one token per emitting row and writes it into the token buffer. The KV pool and the token
buffer are donated, so both update in place.

Shapes (N = max_seqs slots, Lb = token-buffer width = max_model_len, T / S = the step's
token / sequence bucket, static; M = max blocks per sequence):
  tokens int32[N, Lb]: prompt then generated ids of each slot.
  mem: PagedState (block tables int32[N, M], last_cow CopyOnWrite of [N]).
  batch: ScheduledBatch (rows [N]; only the first S rows can be real, as num_seqs <= S).
  slot_sampling: SamplingTensors of [N], one row per slot (set at add_request).
  prompt_len, output_len: int32[N] from the scheduler state *before* update.
Returns (kv', tokens', SamplerOutput of [S] rows in batch order, PromptLogprobs of [T]
tokens or None). With ``all_logits`` (a step holding prompt tokens of a request that
asked for prompt_logprobs) the forward returns logits for all T tokens, each scored
against the next prompt token; a separate compilation of the bucket.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pagedjax.attention import copy_blocks
from pagedjax.engine.faults import hook_from_env
from pagedjax.engine.mrope import split_rope_deltas
from pagedjax.engine.program_store import describe_function
from pagedjax.lora.slots import split_seq_slots
from pagedjax.memory.block_table import slot_mapping
from pagedjax.model import ModelArch, ModelInput
from pagedjax.model.forward import forward, text_embeddings
from pagedjax.model.vision.llava import merge_cached_rows
from pagedjax.sampling import (
    PromptLogprobs,
    SamplingTensors,
    TokenHistory,
    prompt_logprobs,
    sample,
)
from pagedjax.sampling.tensors import take_rows
from pagedjax.scheduler import ScheduledBatch


def build_model_input(
    tokens: jax.Array,
    tables: jax.Array,
    batch: ScheduledBatch,
    num_tokens: int,
    num_seqs: int,
    block_size: int,
    seq_lora_slots: jax.Array | None = None,
    seq_rope_deltas: jax.Array | None = None,
) -> ModelInput:
    """ModelInput padded to (T=num_tokens, S=num_seqs) from the batch's first S rows.

    Token i belongs to the row r with cu[r] <= i < cu[r+1]; its position is
    start_pos[r] + i - cu[r]. Tokens past the batch's total are padding (PAD_SLOT writes,
    row S, which no kv_len covers). seq_lora_slots int32[max_seqs] (LoRA on: each
    scheduler slot's adapter slot, engine/lora_manager.py) gives each token its row's
    adapter slot as ``lora_slots`` (padding: 0, the base model); None: no LoRA input.
    seq_rope_deltas int32[max_seqs] (an M-RoPE model, engine/mrope.py): each token's
    ``rope_positions`` = its position + its row's slot delta; None: no rope_positions.
    """
    seq_ids = batch.seq_ids[:num_seqs]
    q_lens = batch.q_lens[:num_seqs]
    start = batch.start_pos[:num_seqs]
    row_ok = seq_ids >= 0
    safe = jnp.maximum(seq_ids, 0)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    valid = row < num_seqs
    r = jnp.minimum(row, num_seqs - 1)
    positions = jnp.where(valid, start[r] + t - cu[r], 0)
    seq = safe[r]
    ids = jnp.where(valid, tokens[seq, jnp.minimum(positions, tokens.shape[1] - 1)], 0)
    slots = slot_mapping(tables, seq, positions, valid, block_size)
    return ModelInput(
        tokens=ids,
        positions=positions,
        slot_mapping=slots,
        block_tables=jnp.where(row_ok[:, None], tables[safe], 0),
        kv_lens=jnp.where(row_ok, start + q_lens, 0),
        cu_q_lens=cu,
        logits_indices=jnp.maximum(cu[1:] - 1, 0),
        lora_slots=None if seq_lora_slots is None else jnp.where(valid, seq_lora_slots[seq], 0),
        rope_positions=None if seq_rope_deltas is None
        else jnp.where(valid, positions + seq_rope_deltas[seq], 0),
    )  # fmt: skip


def apply_cow(kv: Any, src: jax.Array, dst: jax.Array, valid: jax.Array) -> Any:
    """Copy blocks src -> dst (where valid) in every layer of K and V, before any write."""
    dst = jnp.where(valid, dst, -1)  # copy_blocks drops out-of-range destinations

    def copy(kv):
        return jax.tree.map(lambda p: copy_blocks(p, p, src, dst), kv)

    # Without sharing (n = 1) there is never a copy; skip the page gathers entirely.
    return lax.cond(jnp.any(valid), copy, lambda kv: kv, kv)


def token_history(
    tokens: jax.Array, safe_ids: jax.Array, prompt_len: jax.Array, total_len: jax.Array
) -> TokenHistory:
    """Penalty history of the rows' slots: prompt ids and generated ids, -1 elsewhere."""
    rows = tokens[safe_ids]  # [S, Lb]
    col = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    p, n = prompt_len[:, None], total_len[:, None]
    return TokenHistory(
        prompt_ids=jnp.where(col < p, rows, -1),
        output_ids=jnp.where((col >= p) & (col < n), rows, -1),
    )


class ModelRunner:
    """Holds the jitted step for one (arch, attention, block size) and counts its traces.

    ``trace_count[(T, S)]`` is incremented when the step is traced for that bucket: jit
    traces once per new static-argument combination, so a count above 1 means a
    recompilation (e.g. a changed dtype or shape that should have been static).
    """

    def __init__(
        self,
        arch: ModelArch,
        block_size: int,
        attention_fn: Callable[..., jax.Array],
        max_logprobs: int,
        native_matmul: bool = False,
        layer_stack: Any = None,
    ):
        self.arch = arch
        self.native_matmul = native_matmul  # model/native_matmul.py (one device, CPU)
        self.layer_stack = layer_stack  # pipeline parallelism (model/pipeline.py), or None
        self.block_size = block_size
        self.max_logprobs = max_logprobs
        self.trace_count: dict[tuple[int, int], int] = {}
        self._attention_fn = attention_fn
        self.step = jax.jit(
            self._step,
            static_argnames=("num_tokens", "num_seqs", "all_logits"),
            donate_argnames=("kv", "tokens"),
        )
        # The step as two programs (``DeviceState.run_step``): the forward, then the
        # sampling, so the host can fill grammar masks while the forward runs. Traced
        # once per (T, S) and per S (``split_trace_count``).
        self.split_trace_count: dict[tuple, int] = {}
        self.forward_step = jax.jit(
            self._forward_step,
            static_argnames=("num_tokens", "num_seqs", "all_logits"),
            donate_argnames=("kv",),
        )
        self.sample_step = jax.jit(
            self._sample_step, static_argnames=("num_seqs",), donate_argnames=("tokens",)
        )
        # Compiled steps by ``program_key``, called by ``run`` instead of ``step``: the
        # warm-up fills it (from the program store: no tracing).
        self.programs: dict[tuple, Any] = {}
        self.fault = hook_from_env()  # PAGEDJAX_FAULT_INJECT (faults.py): tests, drills

    def describe(self) -> str:
        """What the step's trace depends on beyond its arguments (program_store.py's key)."""
        parts = (self.arch, self.block_size, describe_function(self._attention_fn),
                 self.max_logprobs, self.native_matmul)  # fmt: skip
        # Without a pipeline the key is what it was (stored programs stay valid).
        return repr(parts if self.layer_stack is None else (*parts, self.layer_stack))

    @staticmethod
    def program_key(num_tokens: int, num_seqs: int, all_logits: bool, mm: Any = None) -> tuple:
        """``programs``' key of a step: its static arguments, and for a step with image
        inputs (``mm``) the encoder cache's capacity, the one shape of ``mm`` that is not
        fixed by the bucket (the cache grows when one step needs more images than fit)."""
        if mm is None:
            return (num_tokens, num_seqs, all_logits)
        return (num_tokens, num_seqs, all_logits, "mm", mm[0].shape[0])

    def run(self, *args: Any, num_tokens: int, num_seqs: int, all_logits: bool = False,
            mm: Any = None) -> Any:  # fmt: skip
        """``step(*args, ...)``, through a compiled program of ``programs`` when there is one
        for these static arguments (the same executable ``step`` would run). mm: a step
        that prefills image positions (``forward_sample``); its own specialization."""
        self.check_fault()
        program = self.programs.get(self.program_key(num_tokens, num_seqs, all_logits, mm))
        extra = {} if mm is None else {"mm": mm}
        # A device FSM table (structured outputs, device_fsm) is an argument shape the
        # warmed-up programs were not compiled for: jit compiles it once per table bucket.
        if program is not None and not has_fsm_table(args):
            return program(*args, **extra)
        return self.step(*args, num_tokens=num_tokens, num_seqs=num_seqs, all_logits=all_logits,
                         **extra)  # fmt: skip

    def _step(
        self,
        params: Any,
        kv: Any,
        tokens: jax.Array,
        mem: Any,
        batch: ScheduledBatch,
        slot_sampling: SamplingTensors,
        prompt_len: jax.Array,
        output_len: jax.Array,
        *,
        num_tokens: int,
        num_seqs: int,
        all_logits: bool = False,
        mm: Any = None,
    ) -> tuple[Any, jax.Array, Any, PromptLogprobs | None]:
        key = (num_tokens, num_seqs) if not all_logits else (num_tokens, num_seqs, "all_logits")
        if mm is not None:
            key = (*key, "mm")
        self.trace_count[key] = self.trace_count.get(key, 0) + 1  # runs at trace time only
        return self.forward_sample(
            params, kv, tokens, mem, batch, slot_sampling, prompt_len, output_len,
            num_tokens=num_tokens, num_seqs=num_seqs, all_logits=all_logits, mm=mm,
        )  # fmt: skip

    def run_forward(self, params: Any, kv: Any, tokens: jax.Array, mem: Any,
                    batch: ScheduledBatch, prompt_len: jax.Array, **statics: Any) -> tuple:
        """``forward_step(...)`` -> (kv', logits, prompt logprobs or None), after the
        fault hook (the step's first program, as ``run``)."""
        self.check_fault()
        return self.forward_step(params, kv, tokens, mem, batch, prompt_len, **statics)

    def check_fault(self) -> None:
        """Raise the injected fault due now (PAGEDJAX_FAULT_INJECT; faults.py), before a
        step's first program is dispatched."""
        if self.fault is not None:
            self.fault.check()

    def _forward_step(self, params: Any, kv: Any, tokens: jax.Array, mem: Any,
                      batch: ScheduledBatch, prompt_len: jax.Array, *, num_tokens: int,
                      num_seqs: int, all_logits: bool = False,
                      mm: Any = None) -> tuple:  # fmt: skip
        key = ("forward", num_tokens, num_seqs, all_logits, mm is not None)
        self.split_trace_count[key] = self.split_trace_count.get(key, 0) + 1
        return self.forward_logits(params, kv, tokens, mem, batch, prompt_len,
                                   num_tokens=num_tokens, num_seqs=num_seqs,
                                   all_logits=all_logits, mm=mm)  # fmt: skip

    def _sample_step(self, logits: jax.Array, tokens: jax.Array, batch: ScheduledBatch,
                     slot_sampling: SamplingTensors, prompt_len: jax.Array,
                     output_len: jax.Array, *, num_seqs: int) -> tuple:  # fmt: skip
        key = ("sample", num_seqs)
        self.split_trace_count[key] = self.split_trace_count.get(key, 0) + 1
        return self.sample_rows(logits, tokens, batch, slot_sampling, prompt_len, output_len,
                                num_seqs=num_seqs)  # fmt: skip

    def forward_sample(
        self,
        params: Any,
        kv: Any,
        tokens: jax.Array,
        mem: Any,
        batch: ScheduledBatch,
        slot_sampling: SamplingTensors,
        prompt_len: jax.Array,
        output_len: jax.Array,
        *,
        num_tokens: int,
        num_seqs: int,
        all_logits: bool = False,
        mm: Any = None,
    ) -> tuple[Any, jax.Array, Any, PromptLogprobs | None]:
        """The traced body of ``step`` (not jitted, not counted): also called inside the
        multi-step decode loop (``multi_step.py``), which counts its own traces.
        ``forward_logits`` then ``sample_rows``; ``forward_step`` and ``sample_step``
        are the same two halves as separate programs (vLLM splits its step the same way:
        ``execute_model``, then ``sample_tokens`` with the grammar bitmask)."""
        kv, logits, plp = self.forward_logits(
            params, kv, tokens, mem, batch, prompt_len,
            num_tokens=num_tokens, num_seqs=num_seqs, all_logits=all_logits, mm=mm,
        )  # fmt: skip
        tokens, out = self.sample_rows(logits, tokens, batch, slot_sampling, prompt_len,
                                       output_len, num_seqs=num_seqs)  # fmt: skip
        return kv, tokens, out, plp

    def forward_logits(
        self,
        params: Any,
        kv: Any,
        tokens: jax.Array,
        mem: Any,
        batch: ScheduledBatch,
        prompt_len: jax.Array,
        *,
        num_tokens: int,
        num_seqs: int,
        all_logits: bool = False,
        mm: Any = None,
    ) -> tuple[Any, jax.Array, PromptLogprobs | None]:
        """The step's first half (traced body): the pending copy-on-write copies, the
        forward. Returns (kv', logits float32[S, V] at each row's last token, prompt
        logprobs or None).

        mm: None, or (cache [C, N, H], image_slot int32[T], image_row int32[T]) for a step
        that prefills image placeholder positions (engine/multimodal.py): those tokens'
        inputs are the encoder cache's rows instead of their (negative identity) ids'
        embeddings; an M-RoPE model's adds rope_positions int32[3, T] (engine/mrope.py)."""
        tables = mem.tables.tables
        params, seq_lora = split_seq_slots(params)  # LoRA on: the rows' adapter slots
        params, deltas = split_rope_deltas(params)  # M-RoPE: the rows' rotary offsets
        inp = build_model_input(tokens, tables, batch, num_tokens, num_seqs, self.block_size,
                                seq_lora, deltas)  # fmt: skip
        cow = mem.last_cow
        kv = apply_cow(kv, cow.src, cow.dst, cow.valid)
        last = inp.logits_indices
        if all_logits:  # prompt logprobs: logits at every token, not only each row's last
            inp = inp._replace(logits_indices=jnp.arange(num_tokens, dtype=jnp.int32))
        embeds = None
        if mm is not None:
            cache, image_slot, image_row, *rope = mm
            if rope:  # M-RoPE: the host's 3-D positions of every token of the step
                inp = inp._replace(rope_positions=rope[0])
            text = text_embeddings(params, self.arch, jnp.maximum(inp.tokens, 0))
            embeds = merge_cached_rows(text, cache, image_slot, image_row)
        kv, logits = forward(params, kv, inp, arch=self.arch, attention_fn=self._attention_fn,
                             native_matmul=self.native_matmul, inputs_embeds=embeds,
                             layer_stack=self.layer_stack)  # fmt: skip
        plp = None
        if all_logits:
            plp = prompt_logprobs(
                logits, self._next_prompt_ids(tokens, batch, inp, prompt_len), self.max_logprobs
            )
            logits = logits[last]
        return kv, logits, plp

    def sample_rows(
        self,
        logits: jax.Array,
        tokens: jax.Array,
        batch: ScheduledBatch,
        slot_sampling: SamplingTensors,
        prompt_len: jax.Array,
        output_len: jax.Array,
        *,
        num_seqs: int,
    ) -> tuple[jax.Array, Any]:
        """The step's second half (traced body): sample one token per batch row from
        logits float32[S, V] under its slot's sampling row (masks included) and write each
        emitting row's token into the buffer. Returns (tokens', SamplerOutput of [S])."""
        seq_ids = batch.seq_ids[:num_seqs]
        safe = jnp.maximum(seq_ids, 0)
        t = take_rows(slot_sampling, safe)
        # The row's key depends on (seed, sample index, output position) only, so the
        # draw is the same whatever the batch, the slot or a preemption before it.
        # Padding rows read slot 0's row: they must not turn the top-k on.
        t = t._replace(output_position=output_len[safe], reports_top=t.reports_top & (seq_ids >= 0))
        total = prompt_len[safe] + output_len[safe]
        history = token_history(tokens, safe, prompt_len[safe], total)
        out = sample(logits, t, history, max_logprobs=self.max_logprobs)

        emit = batch.emits[:num_seqs] & (seq_ids >= 0)
        n = tokens.shape[0]
        # The new token sits at position prompt + output (= start + q for an emitting row).
        tokens = tokens.at[jnp.where(emit, seq_ids, n), total].set(out.token_ids, mode="drop")
        return tokens, out

    @staticmethod
    def _next_prompt_ids(
        tokens: jax.Array, batch: ScheduledBatch, inp: ModelInput, prompt_len: jax.Array
    ) -> jax.Array:
        """int32[T]: the prompt token after each token, -1 past the prompt or in padding."""
        num_seqs = inp.kv_lens.shape[0]
        t = jnp.arange(inp.tokens.shape[0], dtype=jnp.int32)
        row = jnp.searchsorted(inp.cu_q_lens[1:], t, side="right")
        valid = row < num_seqs
        seq = jnp.maximum(batch.seq_ids[:num_seqs], 0)[jnp.minimum(row, num_seqs - 1)]
        nxt = inp.positions + 1
        ok = valid & (nxt < prompt_len[seq])
        return jnp.where(ok, tokens[seq, jnp.minimum(nxt, tokens.shape[1] - 1)], -1)


def has_fsm_table(args: tuple) -> bool:
    """True when a SamplingTensors argument carries a device FSM table (not [0, 0])."""
    return any(isinstance(a, SamplingTensors) and a.fsm_table.shape[0] > 0 for a in args)


@functools.cache
def jitted_update(policy: Any, config: Any) -> Callable[..., Any]:
    """update then recycle in one dispatch: (state, batch, finished_mask, recycle_mask,
    accepted) (accepted: drafts accepted per batch row, zeros without speculation)."""
    from pagedjax.scheduler import recycle, update

    def fn(state, batch, finished_mask, recycle_mask, accepted):
        state = update(policy, config, state, batch, finished_mask, accepted)
        ids = jnp.arange(config.max_seqs, dtype=jnp.int32)
        return recycle(state, ids, recycle_mask)

    return jax.jit(fn, donate_argnums=(0,))


# ---------------------------------------------------------------------------- swapping
# Preemption by swap moves whole KV blocks between the device pool and a host pool of
# the same page shape (numpy arrays (k, v), each [L, blocks, H, B, D]). Each direction is one
# batched transfer per step: a gather of the step's blocks and one device_get (out), or
# one upload and one scatter into the donated pool (in). The pair count is padded to a
# power-of-two bucket ``k`` (static), so a few compilations cover all steps.


@functools.partial(jax.jit, static_argnames=("k",))
def gather_blocks(kv: Any, src: jax.Array, *, k: int) -> Any:
    """The blocks ``src[:k]`` in every layer of K and V: (k, v) of [L, k, H, B, D]."""
    idx = src[:k]
    return jax.tree.map(lambda p: p[:, idx], kv)


@functools.partial(jax.jit, donate_argnames=("kv",))
def scatter_blocks(kv: Any, dst: jax.Array, count: jax.Array, pages: Any) -> Any:
    """kv with block ``dst[i]`` := ``pages[:, i]`` in every layer for i < count (pages:
    (k, v) of [L, k, H, B, D], k <= len(dst)); padding pairs write nothing. kv is donated
    (in place)."""
    k = jax.tree.leaves(pages)[0].shape[1]
    i = jnp.arange(k, dtype=jnp.int32)

    def put(p: jax.Array, x: jax.Array) -> jax.Array:
        d = jnp.where(i < count, dst[:k], p.shape[1])  # out of range: dropped
        return p.at[:, d].set(x.astype(p.dtype), mode="drop")

    return jax.tree.map(put, kv, pages)
