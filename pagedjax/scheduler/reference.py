"""The scheduling rules in their simplest, sequential form (plain Python; the spec).

The jitted ``schedule`` / ``update`` must agree with this decision by decision; the
differential tests step both on the same random traces. Memory is an oracle object with
``grow(slot, new_len, final_len, max_len, use_watermark) -> bool`` and ``release(slot)``;
``PolicyOracle`` adapts any MemoryPolicy by calling it on one sequence at a time;
``UnitPoolModel`` restates a fungible-unit pool (the paged pool's block counts, or
``CountingPolicy``) in a few lines of Python, independent of the array code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.scheduler.config import SchedulerConfig
from pagedjax.scheduler.state import (
    FINISHED,
    REASON_ABORTED,
    REASON_CAPACITY,
    REASON_LENGTH,
    REASON_STOP,
    REASON_TOO_LONG,
    RUNNING,
    WAITING,
)


class PolicyOracle:
    """A MemoryPolicy driven one sequence per call (eagerly, with jitted B = 1 calls)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.state = policy.init_state()
        self._grow = jax.jit(policy.grow)
        self._release = jax.jit(policy.release)

    def grow(self, slot: int, new_len: int, final_len: int, max_len: int, wm: bool) -> bool:
        i = lambda v: jnp.asarray([v], jnp.int32)
        b = lambda v: jnp.asarray([v], bool)
        state, ok = self._grow(
            self.state, i(slot), i(new_len), i(final_len), i(max_len), b(True), b(wm)
        )
        if bool(ok[0]):
            self.state = state
        return bool(ok[0])

    def release(self, slot: int) -> None:
        self.state = self._release(self.state, jnp.asarray([slot], jnp.int32), jnp.asarray([True]))


class UnitPoolModel:
    """A pool of ``num_units`` units of ``unit`` tokens; a length L holds ceil(L / unit).

    Admissions (watermark) must leave ``watermark_units`` free; ``max_units`` (optional)
    caps one sequence (the paged pool's block-table row).
    """

    def __init__(
        self, unit: int, num_units: int, watermark_units: int = 0, max_units: int | None = None
    ) -> None:
        self.unit, self.free, self.total = unit, num_units, num_units
        self.watermark_units, self.max_units = watermark_units, max_units
        self.held: dict[int, int] = {}  # slot -> units

    @classmethod
    def of(cls, policy: Any) -> UnitPoolModel:
        """The model of a CountingPolicy or a PagedPolicy (no sharing, no prefix cache)."""
        if hasattr(policy, "block_size"):
            return cls(
                policy.block_size,
                policy.num_blocks - 1,
                policy.watermark_blocks,
                policy.max_blocks_per_seq,
            )
        return cls(policy.unit, policy.num_units, policy.watermark_units)

    def grow(self, slot: int, new_len: int, final_len: int, max_len: int, wm: bool) -> bool:
        units = -(-new_len // self.unit)
        need = max(units - self.held.get(slot, 0), 0)
        if self.max_units is not None and units > self.max_units:
            return False
        if self.free - need < (self.watermark_units if wm else 0):
            return False
        self.free -= need
        self.held[slot] = self.held.get(slot, 0) + need
        return True

    def release(self, slot: int) -> None:
        self.free += self.held.pop(slot, 0)


@dataclass
class Req:
    arrival: int
    prompt_len: int
    max_tokens: int
    final_len: int
    status: int = WAITING
    finish_reason: int = 0
    output_len: int = 0
    num_computed: int = 0
    num_preemptions: int = 0

    @property
    def total(self) -> int:
        return self.prompt_len + self.output_len

    def target(self, max_model_len: int) -> int:
        t = min(self.max_tokens, self.final_len - self.prompt_len, max_model_len - self.prompt_len)
        return max(t, 1)


@dataclass
class RefBatch:
    """rows: (slot, q_len, start_pos, emits) in batch order; preempted/rejected: slots."""

    rows: list[tuple[int, int, int, bool]]
    preempted: set[int]
    rejected: set[int]


class ReferenceScheduler:
    def __init__(self, config: SchedulerConfig, memory: Any) -> None:
        if not isinstance(config.priority, str):
            raise ValueError("the reference scheduler knows only named priorities")
        self.config = config
        self.memory = memory
        self.reqs: dict[int, Req] = {}  # slot -> request (FREE slots are absent)

    # -- intake -------------------------------------------------------------------------
    def add(self, slot: int, prompt_len: int, max_tokens: int, final_len: int, arrival: int):
        if not 0 <= slot < self.config.max_seqs:
            raise ValueError(f"slot must be in [0, {self.config.max_seqs}), got {slot}")
        if slot in self.reqs and self.reqs[slot].status != FINISHED:
            raise ValueError(f"slot {slot} is busy")
        if prompt_len < 1 or max_tokens < 1 or final_len <= prompt_len:
            raise ValueError("need prompt_len >= 1, max_tokens >= 1, final_len > prompt_len")
        if any(r.arrival == arrival for r in self.reqs.values() if r.status != FINISHED):
            raise ValueError(f"arrival {arrival} is not unique")
        self.reqs[slot] = Req(arrival, prompt_len, max_tokens, final_len)

    def abort(self, slot: int) -> None:
        r = self.reqs[slot]
        if r.status in (WAITING, RUNNING):
            self.memory.release(slot)
            r.status, r.finish_reason = FINISHED, REASON_ABORTED

    def recycle(self, slot: int) -> None:
        if self.reqs[slot].status == FINISHED:
            del self.reqs[slot]

    # -- priority -----------------------------------------------------------------------
    def key(self, slot: int) -> tuple[int, ...]:
        r = self.reqs[slot]
        if self.config.priority == "fcfs":
            return (r.arrival, slot)
        remaining = r.prompt_len + r.target(self.config.max_model_len) - r.num_computed
        return (remaining, r.arrival, slot)

    def _with(self, status: int) -> list[int]:
        return sorted((s for s, r in self.reqs.items() if r.status == status), key=self.key)

    def _grow(self, slot: int, new_len: int, wm: bool) -> bool:
        r, cfg = self.reqs[slot], self.config
        cap = min(r.prompt_len + r.max_tokens, cfg.max_model_len)
        return self.memory.grow(slot, new_len, r.final_len, cap, wm)

    def _finish(self, slot: int, reason: int) -> None:
        r = self.reqs[slot]
        r.status, r.finish_reason = FINISHED, reason

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> RefBatch:
        cfg = self.config
        rows: list[tuple[int, int, int, bool]] = []
        preempted: set[int] = set()
        rejected: set[int] = set()

        # 1. Never schedulable: too long (without chunking, the whole recompute counts).
        for s in self._with(WAITING):
            r = self.reqs[s]
            length = r.prompt_len if cfg.chunked_prefill else r.total
            if length > cfg.prompt_limit:
                self._finish(s, REASON_TOO_LONG)
                rejected.add(s)

        # 2. Running sequences in priority order; victims from the back.
        budget = cfg.max_num_batched_tokens
        queue = self._with(RUNNING)
        i = 0
        while i < len(queue):
            s = queue[i]
            r = self.reqs[s]
            q = min(r.total - r.num_computed, budget)
            if q == 0:  # budget spent: stays running, holds its memory
                i += 1
                continue
            grown = self._grow(s, r.num_computed + q, False)
            while not grown and len(queue) - 1 > i:
                v = queue.pop()
                self._preempt(v)
                preempted.add(v)
                grown = self._grow(s, r.num_computed + q, False)
            if grown:
                rows.append((s, q, r.num_computed, r.num_computed + q == r.total))
                budget -= q
                i += 1
                continue
            queue.pop()
            if i == 0:  # failed with everything else preempted: it can never fit
                self.memory.release(s)
                r.num_computed = 0
                self._finish(s, REASON_CAPACITY)
                rejected.add(s)
            else:
                self._preempt(s)
                preempted.add(s)
            break

        # 3. Admissions, strictly in priority order.
        n_running = len(queue)
        admit = not preempted and (cfg.mode != "static" or n_running == 0)
        seq_cap = cfg.max_num_seqs
        if cfg.mode == "static":
            seq_cap = min(cfg.static_batch_size, cfg.max_num_seqs)
        for s in self._with(WAITING) if admit else []:
            r = self.reqs[s]
            if n_running >= seq_cap:
                break
            need = r.total - r.num_computed
            q = min(need, budget) if cfg.chunked_prefill else need
            if q == 0 or q > budget:
                break
            if not self._grow(s, r.num_computed + q, True):
                if n_running == 0:  # refused by an empty pool: it can never fit
                    self._finish(s, REASON_CAPACITY)
                    rejected.add(s)
                break
            r.status = RUNNING
            rows.append((s, q, r.num_computed, r.num_computed + q == r.total))
            budget -= q
            n_running += 1
        self.last = RefBatch(rows, preempted, rejected)
        return self.last

    def _preempt(self, slot: int) -> None:
        r = self.reqs[slot]
        self.memory.release(slot)
        r.status, r.num_computed = WAITING, 0
        r.num_preemptions += 1

    def update(self, batch: RefBatch, stopped: set[int]) -> list[int]:
        """Apply the step; ``stopped``: slots whose sampled token was EOS / a stop.

        Returns the slots finished this step.
        """
        done = []
        for s, q, _, emits in batch.rows:
            r = self.reqs[s]
            r.num_computed += q
            if not emits:
                continue
            r.output_len += 1
            if s in stopped or r.output_len >= r.target(self.config.max_model_len):
                self.memory.release(s)
                self._finish(s, REASON_STOP if s in stopped else REASON_LENGTH)
                done.append(s)
        return done
