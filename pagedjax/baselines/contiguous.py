"""A contiguous-KV serving baseline: one max_model_len KV region reserved per slot.

What it is (the Orca (Max) / FasterTransformer style of KV management, with continuous
batching on top):

- The KV memory is cut into ``num_slots = kv_tokens // max_model_len`` regions, one per
  slot; a running sequence owns its slot's whole region from admission to finish, however
  short it turns out to be. The region is a *contiguous* run of pages of the same pool
  layout the paged model uses (``[num_blocks, kv_heads, block_size, head_dim]``): slot i
  holds pages ``1 + i*P .. (i+1)*P`` with ``P = ceil(max_model_len / block_size)``, and its
  block table is that identity range. So the model code (``pagedjax.model.forward``) is
  reused unchanged, and admission/reservation is by max_model_len per sequence.
- Continuous (iteration-level) batching: every step, free slots take waiting requests in
  arrival order (FCFS); the step runs one decode token for every running sequence plus
  the whole prompt of the newly admitted ones (up to ``max_num_batched_tokens``).
  Concurrency is limited only by the number of slots that fit in the KV memory.
- Greedy decoding (argmax) and a fixed output length per request (as ``ignore_eos`` with
  ``max_tokens`` = the request's output length), so the work matches the paged run.

Steps are jitted per (T, S) padding bucket (powers of two), with the KV pool donated.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.attention import PAD_SLOT, select_attention_backend
from pagedjax.model import ModelArch, ModelInput, allocate_kv_cache, forward


def _bucket(n: int, lo: int) -> int:
    """Smallest power of two >= max(n, lo): a handful of compiled shapes."""
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


@dataclasses.dataclass
class ContiguousRun:
    """What one ``ContiguousEngine.generate`` call measured."""

    outputs: list[list[int]]  # generated ids per request, in input order
    seconds: float
    steps: int
    max_running: int  # largest number of sequences holding a slot at once
    compiles: int  # jit traces during this call (0 once warm)


@dataclasses.dataclass
class _Seq:
    idx: int
    prompt: list[int]
    out_len: int
    generated: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the slot's region


class ContiguousEngine:
    """Serves requests with a max_model_len reservation per running sequence.

    arch, params: the same model the paged engine runs (``llm.llm_engine.arch/.params``).
    num_blocks: the paged engine's KV pool size in blocks (block 0 included, as a null
        block here too), so both get equal KV memory; ``num_slots`` follows from it.
    """

    def __init__(
        self,
        arch: ModelArch,
        params: Any,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_batched_tokens: int = 2048,
        kv_dtype: Any = jnp.float32,
    ):
        self.arch = arch
        self.params = params
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pages_per_slot = math.ceil(max_model_len / block_size)
        # The reservation rule: a slot is a whole max_model_len region.
        self.num_slots = (num_blocks - 1) // self.pages_per_slot
        if self.num_slots < 1:
            raise ValueError(
                f"{num_blocks} blocks of {block_size} cannot hold one {max_model_len}-token slot"
            )
        self.kv = allocate_kv_cache(
            arch, 1 + self.num_slots * self.pages_per_slot, block_size, kv_dtype
        )
        # Identity (contiguous) block table of every slot.
        self.tables = 1 + np.arange(self.num_slots * self.pages_per_slot, dtype=np.int32).reshape(
            self.num_slots, self.pages_per_slot
        )
        self.trace_count: collections.Counter[tuple[int, int]] = collections.Counter()
        # The paged engine's default attention (the native kernel on a CPU), so that only
        # the memory layout differs between the two engines.
        self.attention_fn = select_attention_backend("auto").ragged_paged_attention
        self._step = jax.jit(self._step_fn, donate_argnums=(1,))

    def _step_fn(self, params: Any, kv: Any, inp: ModelInput) -> tuple[Any, jax.Array]:
        # Runs only while tracing: counts compilations per bucket.
        self.trace_count[(inp.tokens.shape[0], inp.kv_lens.shape[0])] += 1
        kv, logits = forward(params, kv, inp, arch=self.arch, attention_fn=self.attention_fn)
        return kv, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def _input(self, rows: list[tuple[int, list[int], int]]) -> ModelInput:
        """Ragged batch of (slot, new token ids, start position) rows, padded to buckets."""
        n_tok = sum(len(t) for _, t, _ in rows)
        big_t, big_s = _bucket(n_tok, 16), _bucket(len(rows), 1)
        tokens = np.zeros(big_t, np.int32)
        positions = np.zeros(big_t, np.int32)
        slots = np.full(big_t, PAD_SLOT, np.int32)
        tables = np.zeros((big_s, self.pages_per_slot), np.int32)
        kv_lens = np.zeros(big_s, np.int32)
        cu = np.zeros(big_s + 1, np.int32)
        at = 0
        for r, (slot, ids, start) in enumerate(rows):
            n = len(ids)
            pos = np.arange(start, start + n, dtype=np.int32)
            tokens[at : at + n] = ids
            positions[at : at + n] = pos
            pages = self.tables[slot]
            slots[at : at + n] = pages[pos // self.block_size] * self.block_size + (
                pos % self.block_size
            )
            tables[r] = pages
            kv_lens[r] = start + n
            at += n
            cu[r + 1] = at
        cu[len(rows) + 1 :] = at  # padding rows: empty
        logits_idx = np.maximum(cu[1:] - 1, 0)
        return ModelInput(*map(jnp.asarray, (tokens, positions, slots, tables, kv_lens, cu,
                                             logits_idx)))  # fmt: skip

    def generate(
        self, prompts: Sequence[Sequence[int]], output_lens: Sequence[int]
    ) -> ContiguousRun:
        """Runs every request to its output length (greedy); all arrive at t = 0."""
        waiting = collections.deque(
            _Seq(i, list(p), int(n))
            for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True))
        )
        for s in waiting:
            if len(s.prompt) + s.out_len > self.max_model_len:
                raise ValueError(f"request {s.idx} is longer than max_model_len")
        free = list(range(self.num_slots - 1, -1, -1))
        running: dict[int, _Seq] = {}
        outputs: list[list[int]] = [[] for _ in prompts]
        traces0 = sum(self.trace_count.values())
        steps = max_running = 0
        t0 = time.perf_counter()
        while waiting or running:
            rows = [(slot, [s.generated[-1]], s.computed) for slot, s in running.items()]
            budget = self.max_num_batched_tokens - len(rows)
            # Admission: a free slot (a whole max_model_len region) and token budget.
            while waiting and free and len(waiting[0].prompt) <= budget:
                s = waiting.popleft()
                slot = free.pop()
                running[slot] = s
                rows.append((slot, s.prompt, 0))
                budget -= len(s.prompt)
            max_running = max(max_running, len(running))
            self.kv, next_ids = self._step(self.params, self.kv, self._input(rows))
            next_ids = np.asarray(next_ids)
            steps += 1
            for r, (slot, ids, start) in enumerate(rows):
                s = running[slot]
                s.computed = start + len(ids)
                s.generated.append(int(next_ids[r]))
                if len(s.generated) >= s.out_len:
                    outputs[s.idx] = s.generated
                    del running[slot]
                    free.append(slot)
        dt = time.perf_counter() - t0
        compiles = sum(self.trace_count.values()) - traces0
        return ContiguousRun(outputs, dt, steps, max_running, compiles)
