"""The scheduling rules in their simplest, sequential form (plain Python; the spec).

The jitted ``schedule`` / ``update`` must agree with this decision by decision; the
differential tests step both on the same random traces. Memory is an oracle object with
``grow(slot, new_len, final_len, max_len, use_watermark) -> bool``, ``release(slot)``,
``snapshot()`` / ``restore(snap)`` (a group grows all or nothing), and for swap
preemption ``can_swap``, ``swap_out(slots) -> bool`` and ``swap_in(slots, reserve) -> bool``;
``PolicyOracle`` adapts any MemoryPolicy by calling it on one sequence (or one group)
at a time; ``UnitPoolModel`` restates a fungible-unit pool (the paged pool's block
counts, or ``CountingPolicy``) in a few lines of Python, independent of the array code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.scheduler.config import SchedulerLimits
from pagedjax.scheduler.state import (
    FINISHED,
    REASON_ABORTED,
    REASON_CAPACITY,
    REASON_LENGTH,
    REASON_STOP,
    REASON_TOO_LONG,
    RUNNING,
    SWAPPED,
    WAITING,
)


class PolicyOracle:
    """A MemoryPolicy driven one sequence per call (eagerly, with jitted B = 1 calls)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.state = policy.init_state()
        self._grow = jax.jit(policy.grow)
        self._release = jax.jit(policy.release)
        if hasattr(policy, "truncate"):
            self._truncate = jax.jit(policy.truncate)
        self.can_swap = bool(getattr(policy, "can_swap", False))
        if self.can_swap:
            self._swap_out = jax.jit(policy.swap_out)
            self._swap_in = jax.jit(policy.swap_in)

    def _mask(self, slots: list[int]) -> jax.Array:
        return jnp.zeros((self.policy.max_seqs,), bool).at[jnp.asarray(slots)].set(True)

    def snapshot(self) -> Any:
        return self.state

    def restore(self, snap: Any) -> None:
        self.state = snap

    def swap_out(self, slots: list[int]) -> bool:
        state, ok = self._swap_out(self.state, self._mask(slots))
        if bool(ok):
            self.state = state
        return bool(ok)

    def swap_in(self, slots: list[int], reserve: bool) -> bool:
        state, ok = self._swap_in(
            self.state, self._mask(slots), jnp.int32(len(slots)), jnp.asarray(reserve)
        )
        if bool(ok):
            self.state = state
        return bool(ok)

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

    def truncate(self, slot: int, new_len: int) -> None:
        i = lambda v: jnp.asarray([v], jnp.int32)
        self.state = self._truncate(self.state, i(slot), i(new_len), jnp.asarray([True]))


class UnitPoolModel:
    """A pool of ``num_units`` units of ``unit`` tokens; a length L holds ceil(L / unit).

    Admissions (watermark) must leave ``watermark_units`` free; ``max_units`` (optional)
    caps one sequence (the paged pool's block-table row). ``host_units``: a host pool for
    swapping (0: none); a swap moves a slot's units whole, and a swap-in with ``reserve`` must
    leave the watermark plus one unit per sequence free (vLLM's can_swap_in).
    """

    def __init__(
        self,
        unit: int,
        num_units: int,
        watermark_units: int = 0,
        max_units: int | None = None,
        host_units: int = 0,
    ) -> None:
        self.unit, self.free, self.total = unit, num_units, num_units
        self.watermark_units, self.max_units = watermark_units, max_units
        self.held: dict[int, int] = {}  # slot -> units
        self.host_free = self.host_total = host_units
        self.host_held: dict[int, int] = {}  # swapped slot -> units
        self.can_swap = host_units > 0

    @classmethod
    def of(cls, policy: Any) -> UnitPoolModel:
        """The model of a CountingPolicy or a PagedPolicy (no sharing, no prefix cache)."""
        if hasattr(policy, "block_size"):
            return cls(
                policy.block_size,
                policy.num_blocks - 1,
                policy.watermark_blocks,
                policy.max_blocks_per_seq,
                policy.num_host_blocks,
            )
        return cls(policy.unit, policy.num_units, policy.watermark_units, None, policy.host_units)

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
        self.host_free += self.host_held.pop(slot, 0)

    def truncate(self, slot: int, new_len: int) -> None:
        """Shorten a device-resident slot to new_len tokens: whole units past it free."""
        keep = -(-new_len // self.unit)
        drop = max(self.held.get(slot, 0) - keep, 0)
        self.held[slot] = self.held.get(slot, 0) - drop
        self.free += drop

    def snapshot(self) -> Any:
        return (self.free, dict(self.held))

    def restore(self, snap: Any) -> None:
        self.free, self.held = snap[0], dict(snap[1])

    def swap_out(self, slots: list[int]) -> bool:
        need = sum(self.held.get(s, 0) for s in slots)
        if need > self.host_free:
            return False
        for s in slots:
            self.host_held[s] = self.held.pop(s, 0)
        self.free += need
        self.host_free -= need
        return True

    def swap_in(self, slots: list[int], reserve: bool) -> bool:
        need = sum(self.host_held.get(s, 0) for s in slots)
        if self.free - need < (self.watermark_units + len(slots) if reserve else 0):
            return False
        for s in slots:
            self.held[s] = self.host_held.pop(s, 0)
        self.free -= need
        self.host_free += need
        return True


@dataclass
class Req:
    arrival: int
    prompt_len: int
    max_tokens: int
    final_len: int
    group: int = 0
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
    """rows: (slot, q_len, start_pos, emits) in batch order; the sets hold slots:
    preempted (recompute or swap), rejected, swapped_out (of the preempted, those
    swapped), swapped_in (back on device, RUNNING from the next step), released
    (WAITING slots whose attached hit was dropped: num_computed back to 0)."""

    rows: list[tuple[int, int, int, bool]]
    preempted: set[int]
    rejected: set[int]
    swapped_out: set[int]
    swapped_in: set[int]
    released: set[int]


class ReferenceScheduler:
    def __init__(self, config: SchedulerLimits, memory: Any) -> None:
        if not isinstance(config.priority, str):
            raise ValueError("the reference scheduler knows only named priorities")
        self.config = config
        self.memory = memory
        self.reqs: dict[int, Req] = {}  # slot -> request (FREE slots are absent)

    # -- intake -------------------------------------------------------------------------
    def add(
        self,
        slot: int,
        prompt_len: int,
        max_tokens: int,
        final_len: int,
        arrival: int,
        group: int | None = None,
    ):
        if not 0 <= slot < self.config.max_seqs:
            raise ValueError(f"slot must be in [0, {self.config.max_seqs}), got {slot}")
        if slot in self.reqs and self.reqs[slot].status != FINISHED:
            raise ValueError(f"slot {slot} is busy")
        if prompt_len < 1 or max_tokens < 1 or final_len <= prompt_len:
            raise ValueError("need prompt_len >= 1, max_tokens >= 1, final_len > prompt_len")
        if any(r.arrival == arrival for r in self.reqs.values() if r.status != FINISHED):
            raise ValueError(f"arrival {arrival} is not unique")
        self.reqs[slot] = Req(
            arrival, prompt_len, max_tokens, final_len, slot if group is None else group
        )

    def abort(self, slot: int) -> None:
        r = self.reqs[slot]
        if r.status in (WAITING, RUNNING, SWAPPED):
            self.memory.release(slot)
            r.status, r.finish_reason = FINISHED, REASON_ABORTED

    def attach(self, slot: int, tokens: int) -> bool:
        """A prefix-cache hit (the engine's ``attach_hits``, before ``schedule``): the
        WAITING slot ``slot`` (nothing computed) gets memory for ``tokens`` tokens,
        without the watermark, and that many computed tokens. False (and no change) if
        the memory refuses."""
        r = self.reqs[slot]
        if r.status != WAITING or r.num_computed or not 0 < tokens < r.total:
            raise ValueError(f"slot {slot} cannot take a hit of {tokens} tokens")
        if not self._grow(slot, tokens, False):
            return False
        r.num_computed = tokens
        return True

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

    def _groups(self, status: int) -> list[list[int]]:
        """Groups of the slots with ``status``: each group's members in priority order,
        groups ordered by their best member."""
        groups: dict[int, list[int]] = {}
        for s in self._with(status):
            groups.setdefault(self.reqs[s].group, []).append(s)
        return sorted(groups.values(), key=lambda g: self.key(g[0]))

    def _grow(self, slot: int, new_len: int, wm: bool) -> bool:
        r, cfg = self.reqs[slot], self.config
        cap = min(r.prompt_len + r.max_tokens, cfg.max_model_len)
        return self.memory.grow(slot, new_len, r.final_len, cap, wm)

    def _finish(self, slot: int, reason: int) -> None:
        r = self.reqs[slot]
        r.status, r.finish_reason = FINISHED, reason

    # -- one step -----------------------------------------------------------------------
    def schedule(self, lookahead: dict[int, int] | None = None) -> RefBatch:
        """lookahead: speculative slots by slot: a RUNNING sequence with one token to
        compute asks for 1 + lookahead[slot] (``schedule.schedule``'s rule 2)."""
        cfg = self.config
        lookahead = lookahead or {}
        rows: list[tuple[int, int, int, bool]] = []
        preempted: set[int] = set()
        rejected: set[int] = set()

        released: set[int] = set()

        # 1. Never schedulable: too long (without chunking, the whole recompute counts).
        for s in self._with(WAITING):
            r = self.reqs[s]
            length = r.prompt_len if cfg.chunked_prefill else r.total
            if length > cfg.prompt_limit:
                self._drop_hold(s)
                self._finish(s, REASON_TOO_LONG)
                rejected.add(s)

        seq_cap = cfg.max_num_seqs
        if cfg.mode == "static":
            seq_cap = min(cfg.static_batch_size, cfg.max_num_seqs)
        # 5. Separate prompt steps: prompts only (the whole budget) when anyone is
        # admitted; otherwise a decode-only step below, with no admission.
        if cfg.separate_prompt_steps and not self._with(SWAPPED) and self._with(WAITING):
            n_running = len(self._with(RUNNING))
            self._admit(cfg.max_num_batched_tokens, n_running, seq_cap, rows, rejected, released)
            if rows or n_running == 0:
                self.last = RefBatch(rows, preempted, rejected, set(), set(), released)
                return self.last

        # 2. Running groups in priority order, each all or nothing; victims (whole
        # groups) from the back.
        budget = cfg.max_num_batched_tokens
        queue = self._groups(RUNNING)
        swapped_out: set[int] = set()
        i = 0
        while i < len(queue):
            group = queue[i]
            plan, left = [], budget
            for s in group:
                r = self.reqs[s]
                need = r.total - r.num_computed
                if need == 1:  # a decode verifies its drafts in the same step
                    need += lookahead.get(s, 0)
                q = min(need, left)
                left -= q
                if q > 0:  # q == 0: budget spent: stays running, holds its memory
                    plan.append((s, q, r.num_computed))
            grown = self._grow_group(plan)
            if not grown and self._release_holds(self._with(WAITING), released):
                grown = self._grow_group(plan)  # waiting requests hold nothing we need
            while not grown and len(queue) - 1 > i:
                victim = queue.pop()
                self._preempt(victim, preempted, swapped_out)
                grown = self._grow_group(plan)
            if grown:
                rows += [(s, q, start, start + q >= self.reqs[s].total) for s, q, start in plan]
                budget = left
                i += 1
                continue
            queue.pop()
            if i == 0:  # failed with everything else preempted: it can never fit
                for s in group:
                    self.memory.release(s)
                    self.reqs[s].num_computed = 0
                    self._finish(s, REASON_CAPACITY)
                    rejected.add(s)
            else:
                self._preempt(group, preempted, swapped_out)
            break

        # Swapped groups come back (not in a step that preempted), in priority order,
        # while they fit; they run from the next step.
        n_running = sum(len(g) for g in queue)
        swapped_in: set[int] = set()
        for group in self._groups(SWAPPED) if not preempted else []:
            # Spare blocks (watermark + one per sequence) only while something runs.
            if n_running + len(group) > seq_cap or not self.memory.swap_in(group, n_running > 0):
                break
            for s in group:
                self.reqs[s].status = RUNNING
            swapped_in.update(group)
            n_running += len(group)

        # 3. Admissions, strictly in priority order; none while a group is swapped out.
        admit = not preempted and not self._with(SWAPPED)
        admit = admit and (cfg.mode != "static" or n_running == 0)
        if admit and not cfg.separate_prompt_steps:
            self._admit(budget, n_running, seq_cap, rows, rejected, released)
        self.last = RefBatch(rows, preempted, rejected, swapped_out, swapped_in, released)
        return self.last

    def _admit(
        self,
        budget: int,
        n_running: int,
        seq_cap: int,
        rows: list[tuple[int, int, int, bool]],
        rejected: set[int],
        released: set[int],
    ) -> None:
        """Rule 3: admit WAITING slots strictly in priority order into ``rows``."""
        cfg = self.config
        waiting = self._with(WAITING)
        for k, s in enumerate(waiting):
            r = self.reqs[s]
            if n_running >= seq_cap or s in released:  # released: looked up again first
                break
            need = r.total - r.num_computed
            q = min(need, budget) if cfg.chunked_prefill else need
            if q == 0 or q > budget:
                break
            grown = self._grow(s, r.num_computed + q, True)
            # Refused: the holds behind it give way, and it alone is retried (admission
            # ends with it: the released slots wait for their new lookup).
            retried = not grown and self._release_holds(waiting[k + 1 :], released)
            if retried:
                grown = self._grow(s, r.num_computed + q, True)
            if not grown:
                if n_running == 0:  # refused by an empty pool: it can never fit
                    self._drop_hold(s)
                    self._finish(s, REASON_CAPACITY)
                    rejected.add(s)
                break
            r.status = RUNNING
            rows.append((s, q, r.num_computed, r.num_computed + q == r.total))
            budget -= q
            n_running += 1
            if retried:
                break

    def _drop_hold(self, slot: int) -> bool:
        """Release a WAITING slot's attached hit, if it holds one; True if it did."""
        r = self.reqs[slot]
        if r.status != WAITING or r.num_computed == 0:
            return False
        self.memory.release(slot)
        r.num_computed = 0
        return True

    def _release_holds(self, slots: list[int], released: set[int]) -> bool:
        """Release the holds of ``slots`` (in slot order, as the batched release); True
        if any was held."""
        dropped = [s for s in sorted(slots) if self._drop_hold(s)]
        released.update(dropped)
        return bool(dropped)

    def _grow_group(self, plan: list[tuple[int, int, int]]) -> bool:
        """Grow each (slot, q, start) of one group; all or nothing."""
        snap = self.memory.snapshot()
        for s, q, start in plan:
            if not self._grow(s, start + q, False):
                self.memory.restore(snap)
                return False
        return True

    def _preempt(self, group: list[int], preempted: set[int], swapped: set[int]) -> None:
        """Preempt a running group: swap (mode "swap", or None with several sequences)
        if the memory has a host pool that takes the whole group, else recompute."""
        mode = self.config.preemption_mode
        swap = self.memory.can_swap and (mode == "swap" or (mode is None and len(group) > 1))
        if swap and self.memory.swap_out(group):
            for s in group:
                self.reqs[s].status = SWAPPED
            swapped.update(group)
        else:
            for s in group:
                self.memory.release(s)
                self.reqs[s].status, self.reqs[s].num_computed = WAITING, 0
        for s in group:
            self.reqs[s].num_preemptions += 1
        preempted.update(group)

    def update(
        self, batch: RefBatch, stopped: set[int], accepted: dict[int, int] | None = None
    ) -> list[int]:
        """Apply the step; ``stopped``: slots whose sampled token was EOS / a stop;
        ``accepted``: drafts accepted by slot (of the row's q_len past its last token).
        A row keeps its last token and its accepted drafts: num_computed grows by those,
        the rejected drafts' memory is given back (``memory.truncate``), the output by
        1 + accepted.

        Returns the slots finished this step.
        """
        done = []
        accepted = accepted or {}
        for s, q, start, emits in batch.rows:
            r = self.reqs[s]
            spec = max(start + q - r.total, 0)
            a = min(accepted.get(s, 0), spec) if emits else 0
            r.num_computed += q - (spec - a)
            if spec > a:
                self.memory.truncate(s, r.num_computed)
            if not emits:
                continue
            r.output_len += 1 + a
            if s in stopped or r.output_len >= r.target(self.config.max_model_len):
                self.memory.release(s)
                self._finish(s, REASON_STOP if s in stopped else REASON_LENGTH)
                done.append(s)
        return done
