"""Beam search (the paper's section 4.4) over the engine's slots, with block sharing.

Each prompt is one sequence group: its beams live in engine slots and share KV blocks by
reference count. The engine runs the beam slots as ordinary greedy sequences
(``ignore_eos``, ``logprobs = 2 * beam_width``) and returns, per beam and step, the top
2k log-probs. After each step the host picks the new beams from those candidates with
Hugging Face's rules (``BeamGroup.advance``), and one jitted device function,
``reassign_beams``, re-points every beam slot at its parent's block-table row (incref the
new rows, release the old ones), copies the parent's lengths and token-buffer row and
overwrites the last token with the chosen one. All beams then share every block; the
next append copies a shared, partly filled last block on write (the scheduler's grow).

Semantics are those of ``transformers`` ``generate(num_beams=k, do_sample=False,
length_penalty=..., early_stopping=...)`` (see ``BeamSearchParams``); the outputs use
vLLM's ``BeamSearchOutput`` / ``BeamSearchSequence`` names (``tokens`` hold prompt +
output, ``text`` decodes them, as vLLM). docs/engine.md gives the reasons.

Lockstep: every beam of a group must sample exactly once per step. The driver admits a
group only while the worst-case blocks of all admitted groups fit the pool, so the
scheduler never has to preempt a beam; if a beam still falls out of step (preempted for
another request's sake, or refused by the scheduler), the whole group is aborted and
``BeamSearchOutOfStep`` is raised: the scheduler preempts a group whole, but re-admits
its waiting members one at a time, so beams cannot be re-synced after a preemption.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.beam_group import BeamGroup, BeamSearchOutput, BeamSearchSequence
from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import Logprob
from pagedjax.engine.sequence import SequenceState
from pagedjax.memory import block_pool as bp
from pagedjax.memory.block_pool import NULL_BLOCK
from pagedjax.memory.block_table import BlockTables
from pagedjax.sampling import BeamSearchParams, SamplingParams
from pagedjax.scheduler import SchedulerState


class BeamSearchOutOfStep(RuntimeError):
    """A beam of a group did not sample in a step where its siblings did."""


# ---------------------------------------------------------------------- device side


def reassign_beams(
    state: SchedulerState,
    tokens: jax.Array,
    slots: jax.Array,
    parents: jax.Array,
    last_tokens: jax.Array,
    arrivals: jax.Array,
    groups: jax.Array,
    mask: jax.Array,
) -> tuple[SchedulerState, jax.Array]:
    """Point each masked beam slot at its parent's state and overwrite its last token.

    slots, parents, last_tokens, arrivals, groups: int32[K]; mask bool[K]. Everything is
    read before anything is written, so parents may themselves be re-pointed (a swap
    works). A slot whose parent is another slot gets the parent's block-table row (one
    more reference to each block; its old row's references are dropped afterwards, so a
    block in both keeps its count), its lengths, status and token-buffer row; then
    token ``prompt_len + output_len - 1`` of every masked slot (the id sampled in the
    last step, whose KV is not computed yet) becomes last_tokens. arrivals >= 0 replace
    the slot's FCFS key (new slots); groups set ``state.group``.
    """
    mem = state.mem
    t: BlockTables = mem.tables
    n, m = t.tables.shape
    nb = mem.pool.num_blocks
    src = jnp.where(mask, parents, 0)
    dst_safe = jnp.where(mask, slots, 0)
    moved = mask & (parents != slots)
    dst = jnp.where(moved, slots, n)  # out of range: dropped

    new_rows = t.tables[src]  # [K, M], read before any write
    old_rows = jnp.where(moved[:, None], t.tables[dst_safe], NULL_BLOCK)
    add = jnp.where(moved[:, None] & (new_rows != NULL_BLOCK), new_rows, nb).reshape(-1)
    pool = mem.pool._replace(refcount=mem.pool.refcount.at[add].add(1, mode="drop"))
    flat = old_rows.reshape(-1)
    real = flat != NULL_BLOCK
    order = jnp.nonzero(real, size=flat.shape[0], fill_value=0)[0]
    pool = bp.drop_refs(pool, flat[order], jnp.sum(real, dtype=jnp.int32))
    tables = BlockTables(
        t.tables.at[dst].set(new_rows, mode="drop"),
        t.lengths.at[dst].set(t.lengths[src], mode="drop"),
    )

    def copy(a: jax.Array) -> jax.Array:
        return a.at[dst].set(a[src], mode="drop")

    pos = state.prompt_len[src] + state.output_len[src] - 1
    tok = tokens.at[dst].set(tokens[src], mode="drop")
    tok = tok.at[jnp.where(mask, slots, n), pos].set(last_tokens, mode="drop")
    arrival = copy(state.arrival)
    new_arrival = jnp.where(mask & (arrivals >= 0), slots, n)
    arrival = arrival.at[new_arrival].set(arrivals, mode="drop")
    state = state._replace(
        status=copy(state.status),
        finish_reason=copy(state.finish_reason),
        arrival=arrival,
        prompt_len=copy(state.prompt_len),
        output_len=copy(state.output_len),
        max_tokens=copy(state.max_tokens),
        final_len=copy(state.final_len),
        num_computed=copy(state.num_computed),
        num_preemptions=copy(state.num_preemptions),
        group=state.group.at[jnp.where(mask, slots, n)].set(groups, mode="drop"),
        mem=mem._replace(pool=pool, tables=tables),
    )
    return state, tok


@functools.cache
def _jitted_reassign():
    return jax.jit(reassign_beams, donate_argnums=(0, 1))


# ---------------------------------------------------------------------- host side


def _candidates(seq: SequenceState, n: int) -> list[tuple[int, float, dict[int, Logprob]]]:
    """The slot's last step's top-n (token, logprob, {token: Logprob} of all n), best
    first; the dict is what a hypothesis keeps for that position (vLLM's logprobs)."""
    entry = seq.logprobs[-1]
    ranked = sorted(entry.items(), key=lambda kv: (-kv[1].logprob, kv[1].rank or 0))[:n]
    step = dict(ranked)
    return [(tok, lp.logprob, step) for tok, lp in ranked]


def group_block_bound(prompt_len: int, max_new: int, k: int, block_size: int) -> int:
    """Most KV blocks a group of k beams can hold: the full prompt blocks are shared by
    every beam (never written again), the rest may be private to each beam."""
    shared = prompt_len // block_size
    return shared + k * (math.ceil((prompt_len + max_new) / block_size) - shared)


def beam_search(
    engine: LLMEngine,
    prompts: Sequence[Any],
    params: BeamSearchParams | Sequence[BeamSearchParams],
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """Run beam search for every prompt through ``engine``; outputs in prompt order.

    params: one for all prompts (vLLM's API), or one per prompt. Groups are admitted
    while their beam_width free slots and the worst-case blocks of every admitted group
    (``group_block_bound``) fit, and at most concurrency_limit groups at once. Raises
    ValueError (before anything runs) on bad params or a prompt that cannot run, and
    BeamSearchOutOfStep (after aborting this call's requests) if a beam misses a step.
    """
    if engine.speculator is not None:  # vLLM refuses the pair too
        raise ValueError(
            "beam search with speculative decoding (speculative_config) is not supported:"
            " build the engine without speculative_config for beam search"
        )
    if engine.core.rope_deltas is not None:  # beams take slots outside take_slot (mrope.py)
        raise ValueError("beam search with an M-RoPE model (Qwen2-VL) is not built yet")
    if isinstance(params, BeamSearchParams):
        params = [params] * len(prompts)
    if not isinstance(params, Sequence):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} BeamSearchParams for {len(prompts)} prompts")
    for p in params:
        if not isinstance(p, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(p).__name__}")
    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
    usable = engine.num_blocks - 1 - engine.policy.watermark_blocks
    groups: list[BeamGroup] = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        k = p.beam_width
        eos = set() if p.ignore_eos else set(engine.book.eos)
        n_cand = max(2, 1 + len(eos)) * k
        if n_cand > min(engine.max_logprobs, engine.arch.vocab_size):
            raise ValueError(
                f"beam_width={k} needs the top {n_cand} log-probs per step, over the"
                f" engine's max_logprobs={engine.max_logprobs} (or the vocabulary)"
            )
        if k > engine.max_seqs:
            raise ValueError(f"beam_width={k} exceeds max_num_seqs={engine.max_seqs} (slots)")
        _, ids = engine.tokenize_prompt(prompt)
        max_new = min(p.max_tokens, engine.max_model_len - len(ids))
        if max_new < 1:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens: no room to generate within"
                f" max_model_len={engine.max_model_len}"
            )
        engine.check_request(ids, _slot_params(n_cand, max_new))
        g = BeamGroup(f"beam-{next(_ids)}", ids, max_new, p, eos)
        g.block_bound = group_block_bound(len(ids), max_new, k, engine.block_size)
        if g.block_bound > usable:
            raise ValueError(
                f"prompt {i}: {k} beams of up to {len(ids) + max_new} tokens may need"
                f" {g.block_bound} KV blocks, more than the pool's {usable}"
            )
        groups.append(g)
    return _Driver(engine, groups, concurrency_limit).run(use_tqdm)


_ids = itertools.count()


def _slot_params(num_candidates: int, max_new: int) -> SamplingParams:
    """Beam slots run greedy (the sampled id is replaced anyway), never stop on EOS (the
    search decides), and report the top num_candidates log-probs."""
    return SamplingParams(
        temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=num_candidates
    )


class _Driver:
    def __init__(self, engine: LLMEngine, groups: list[BeamGroup], limit: int | None):
        self.engine, self.groups = engine, groups
        self.limit = limit or len(groups)
        self.usable = engine.num_blocks - 1 - engine.policy.watermark_blocks

    def run(self, use_tqdm: bool) -> list[BeamSearchOutput]:
        engine = self.engine
        pending = deque(self.groups)
        active: list[BeamGroup] = []
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self.groups), desc="Beam search", dynamic_ncols=True)
        try:
            while pending or active:
                while pending and self._fits(pending[0], active):
                    g = pending.popleft()
                    self._admit(g)
                    active.append(g)
                if not active:
                    raise RuntimeError(
                        "beam search cannot admit a group: the engine's slots or blocks are"
                        " held by other requests"
                    )
                engine.step()
                moves = []
                for g in active:
                    moves += self._advance(g)
                if moves:
                    self._apply(moves)
                for g in [g for g in active if g.done]:
                    active.remove(g)
                    if g.request_id in engine.book.requests:
                        engine.abort_request(g.request_id)  # stopped before max_tokens
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            engine.abort_request([g.request_id for g in active])
            raise
        finally:
            if bar is not None:
                bar.close()
        decode = engine.tokenizer.decode
        return [g.results(decode) for g in self.groups]

    def _fits(self, g: BeamGroup, active: list[BeamGroup]) -> bool:
        if len(active) >= self.limit:
            return False
        engine = self.engine
        reserved = sum(a.k - len(a.slots) for a in active) + len(engine.book.queue)
        if len(engine.book.free_slots) - reserved < g.k:
            return False
        return sum(a.block_bound for a in active) + g.block_bound <= self.usable

    def _admit(self, g: BeamGroup) -> None:
        """Add the group's first beam as a request and give it a slot now, so its
        sampling row carries the logprob temperature before its first step."""
        engine = self.engine
        engine.add_request(g.request_id, {"prompt_token_ids": g.prompt_ids},
                           _slot_params(g.num_candidates, g.max_new))  # fmt: skip
        engine.assign_slots()
        g.req = engine.book.requests[g.request_id]
        g.req.host_driven = True  # keeps the multi-step decode loop out (multi_step.py)
        seq = g.req.seqs[0]
        if seq.slot is None:  # _fits checked free slots; the engine must agree
            raise RuntimeError(f"beam search group {g.request_id} got no slot")
        seq.detok = IncrementalDetokenizer.holding(engine.tokenizer, [])
        g.slots = [seq.slot]
        engine.core.device.set_sampling_value("logprob_temperature", seq.slot, g.temperature)

    def _advance(self, g: BeamGroup) -> list[tuple[int, int, int, int, int]]:
        """Check the group's beams sampled this step; pick the next beams. Returns
        device moves (slot, parent slot, token, arrival or -1, group id)."""
        engine = self.engine
        seqs = g.req.seqs  # seqs[i] is the SequenceState of slot g.slots[i], for good
        lens = [len(s.detok.ids) for s in seqs]
        emitted = [n == g.steps + 1 for n in lens]
        if not any(emitted):
            early = [s.finish_reason for s in seqs if s.finish_reason is not None]
            if early:  # rejected by the scheduler (too long / cannot fit the pool)
                raise BeamSearchOutOfStep(
                    f"beam search group {g.request_id} was finished by the engine"
                    f" ({early[0]}) before its search ended"
                )
            return []  # prompt still prefilling
        if not all(emitted) or any(n > g.steps + 1 for n in lens):
            raise BeamSearchOutOfStep(
                f"beam search group {g.request_id}: beams out of step (generated {lens},"
                f" expected {g.steps + 1} each); a beam was preempted or not scheduled."
                " A group preempted by recompute is re-admitted one beam at a time; keep"
                " preemption_mode='swap' (the default for groups), or give the engine"
                " more KV blocks or run fewer requests beside beam search."
            )
        cands = [_candidates(s, g.num_candidates) for s in seqs]
        for s in seqs:
            s.logprobs = []
        choice = g.advance(cands)
        if not choice:
            return []
        # Expansion (1 -> k beams): claim free slots for the new beams.
        new_slots = []
        while len(g.slots) < len(choice):
            slot = self._claim_slot(g)
            g.slots.append(slot)
            new_slots.append(slot)
        # The engine's group id for a request: its first sequence's arrival number
        # (unique among live groups; a slot id could collide with another request's).
        group_id = g.req.seqs[0].arrival
        moves = []
        hashes = [list(s.hashes) for s in seqs]
        for i, (b, tok) in enumerate(choice):
            slot = g.slots[i]
            _, seq = engine.book.owner(slot)
            seq.detok = IncrementalDetokenizer.holding(engine.tokenizer, g.running[i].tokens)
            seq.cumulative_logprob = float(g.running[i].score)
            seq.hashes = list(hashes[b])
            arrival = seq.arrival if slot in new_slots else -1
            moves.append((slot, g.slots[b], tok, arrival, group_id))
        return moves

    def _claim_slot(self, g: BeamGroup) -> int:
        engine = self.engine
        parent = g.slots[0]
        seq = SequenceState(
            index=len(g.req.seqs),
            params=g.req.seqs[0].params,
            detok=IncrementalDetokenizer.holding(engine.tokenizer, []),
            target=g.req.seqs[0].target,
            arrival=engine.book.next_arrival(),
            logprobs=[],
        )
        g.req.seqs.append(seq)
        slot = engine.book.bind_slot(g.req, seq)
        engine.core.device.copy_sampling_row(slot, parent)
        return slot

    def _apply(self, moves: list[tuple[int, int, int, int, int]]) -> None:
        engine = self.engine
        n = engine.max_seqs
        a = np.zeros((5, n), np.int32)
        mask = np.zeros(n, bool)
        for i, mv in enumerate(moves):
            a[:, i] = mv
            mask[i] = True
        engine.core.device.reassign(_jitted_reassign(), a[0], a[1], a[2], a[3], a[4], mask)


__all__ = [
    "BeamSearchOutOfStep",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "beam_search",
    "group_block_bound",
    "reassign_beams",
]
