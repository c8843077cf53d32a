"""Admission: queued sequences into slots, prefix-cache lookups, forks of n > 1 samples.

Host-driven changes of the engine core between model steps (``core.EngineCore``): each
function reads the host bookkeeping (``RequestBook``), makes one jitted call on the
device state (``DeviceState``) for all the slots it changes, and updates the prefix
cache's host hint. docs/engine.md ("Block sharing") gives the reasons.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pagedjax.engine.block_hashes import extend_hashes
from pagedjax.engine.core import EngineCore
from pagedjax.engine.lora_manager import live_lora_ids
from pagedjax.engine.sequence import RequestState, SequenceState
from pagedjax.memory.block_pool import NULL_BLOCK


def assign_slots(core: EngineCore) -> None:
    """Give queued sequences free slots (FCFS), register them with the scheduler, write
    the slots' dynamic masks (``logit_controls``: such slots keep the one-step path), then
    (prefix caching) attach cached prefixes to them and to re-waiting preempted slots."""
    book = core.book
    new: list[int] = []
    if core.kv_calibration is not None and book.queue:  # before any KV is written
        core.kv_calibration(core, [req.prompt_token_ids for req, _ in book.queue])
        core.kv_calibration = None
    if core.lora is not None and core.lora.retired:  # unloaded adapters no request uses
        core.lora.release_retired(live_lora_ids(book.requests.values()))
    kv_max = 0  # unified paging: the largest full-length KV of a slotted request
    if core.lora is not None and core.lora.pages is not None:
        kv_max = max((_full_blocks(core, r, q) for r, q in book.slot_owner.values()), default=0)
        core.lora.relieve(_loras_in_use(core), max(1, kv_max))  # idle adapters' blocks to KV
    if book.queue and book.free_slots:
        n = core.max_seqs
        slot_ids = np.zeros(n, np.int32)
        prompt_lens = np.ones(n, np.int32)
        max_tokens = np.ones(n, np.int32)
        arrivals = np.zeros(n, np.int32)
        groups = np.zeros(n, np.int32)
        mask = np.zeros(n, bool)
        k = 0
        # LoRA: requests whose adapter finds no device slot yet (lora_manager); images:
        # requests whose images are still being encoded under the encoder budget.
        waiting = []
        in_use = _loras_in_use(core) if core.lora is not None else set()
        gate = core.admit_gate
        if gate is not None:
            gate.begin_pass()
        while book.queue and book.free_slots:
            req, seq = book.queue.popleft()
            if gate is not None and not gate.admit(req):
                waiting.append((req, seq))
                continue
            if core.lora is not None:
                kv = max(kv_max, _full_blocks(core, req, seq))
                if not core.lora.admit(req.lora_request, in_use, kv):
                    waiting.append((req, seq))
                    continue
                kv_max = kv
                if req.lora_request is not None:
                    in_use.add(req.lora_request.lora_int_id)
            slot = core.take_slot(req, seq)
            slot_ids[k], prompt_lens[k], max_tokens[k] = (
                slot,
                len(req.prompt_token_ids),
                seq.target,
            )
            arrivals[k], mask[k] = seq.arrival, True
            groups[k] = req.seqs[0].arrival  # unique among live groups
            new.append(slot)
            k += 1
        book.queue.extendleft(reversed(waiting))  # back at the head, in their order
        final = prompt_lens + max_tokens
        core.device.add_requests(
            slot_ids, prompt_lens, max_tokens, final, arrivals, mask, groups
        )
    if core.controls is not None:
        core.controls.write_rows(core)
    if core.enable_prefix_caching:
        if book.swapped_slots:
            # No admission while a group is swapped out: a lookup now would hold
            # cached blocks for a sequence that cannot run. Look up later.
            book.relookup.update(new)
            return
        lookup = new + sorted(s for s in book.relookup if s in book.slot_owner)
        book.relookup.clear()
        # A request that wants prompt logprobs must compute every prompt position: a cache
        # hit would skip them and leave its entries empty (vLLM skips the lookup for such
        # requests too). Its blocks are still registered for others.
        lookup = [s for s in lookup if book.slot_owner[s][0].prompt_logprobs is None]
        if lookup:
            lookup_prefixes(core, lookup)


def _full_blocks(core: EngineCore, req: RequestState, seq: SequenceState) -> int:
    """KV blocks ``seq`` holds at its full length (prompt + its most output tokens)."""
    return -(-(len(req.prompt_token_ids) + seq.target) // core.block_size)


def _loras_in_use(core: EngineCore) -> set[int]:
    """Adapter ids of the requests holding scheduler slots (their adapters stay put)."""
    return {req.lora_request.lora_int_id for req, _ in core.book.slot_owner.values()
            if req.lora_request is not None}  # fmt: skip


def lookup_prefixes(core: EngineCore, slots: list[int]) -> None:
    """Prefix-cache lookup for WAITING slots with empty tables (docs/engine.md):
    the host proposes hinted blocks, the device verifies, acquires and attaches them,
    and sets num_computed to the hit, before ``schedule`` sees the slots. With a host
    tier, the part of the prefix kept on the host is loaded back after the device hit
    (``kv_offload.HostTier.reload``)."""
    n, m, b = core.max_seqs, core.max_blocks_per_seq, core.block_size
    slot_arr = np.zeros(n, np.int32)
    cand = np.full((n, m), NULL_BLOCK, np.int32)
    mask = np.zeros(n, bool)
    props = []
    for k, slot in enumerate(slots):
        req, seq = core.book.owner(slot)
        ids = req.prompt_token_ids + seq.detok.ids
        extend_hashes(seq.hashes, ids, b, len(ids) // b, req.cache_salt)
        hashes = seq.hashes[: len(ids) // b]
        prop = core.prefix_index.propose(hashes, tokens=ids, salt=req.cache_salt)
        slot_arr[k], mask[k] = slot, True
        cand[k, : len(prop)] = prop
        props.append((hashes, len(prop), ids, req.cache_salt))
    verified, used = core.device.attach_hits(slot_arr, cand, mask)
    verified, used = jax.device_get((verified, used))
    counters, tier = core.sharing, core.host_tier
    for k, (hashes, proposed, ids, salt) in enumerate(props):
        hit = int(verified[k])
        if hit < proposed:  # with a host tier only the failed hint: later blocks may
            # still be cached on device after a host run (kv_offload.HostTier.plan)
            core.prefix_index.forget(hashes[hit : hit + 1 if tier is not None else proposed],
                                     tokens=ids, start=hit, salt=salt)  # fmt: skip
        core.prefix_index.count(proposed, hit)
        counters.lookup_tokens += len(ids)
        counters.hit_tokens += int(used[k]) * b
    if tier is not None:
        tier.counters.device_hit_tokens += int(used[: len(slots)].sum()) * b
        rows = [
            (slot, hashes, ids, int(verified[k]), int(used[k]))
            for k, (slot, (hashes, _, ids, _)) in enumerate(zip(slots, props, strict=True))
        ]
        tier.reload(core, rows, [salt for _, _, _, salt in props])


def fork_samples(core: EngineCore, req: RequestState, parent: SequenceState) -> int:
    """Sample 0's prompt is computed (it just sampled its first token): give samples
    1..n-1 slots sharing its prompt blocks. Samples that find no free slot now wait in
    the host queue (front) as independent sequences (prefix caching may still share).
    Returns the number of samples forked."""
    n = core.max_seqs
    children = np.zeros(n, np.int32)
    mask = np.zeros(n, bool)
    max_tokens = np.ones(n, np.int32)
    arrivals = np.zeros(n, np.int32)
    k = 0
    leftover = []
    for seq in req.pending:
        if not core.book.free_slots:
            leftover.append(seq)
            continue
        slot = core.take_slot(req, seq)
        children[k], mask[k], max_tokens[k], arrivals[k] = slot, True, seq.target, seq.arrival
        seq.hashes = list(parent.hashes)  # the shared prompt blocks' hashes
        k += 1
    req.pending = []
    core.book.requeue_front(req, leftover)
    if k:
        core.device.fork(np.int32(parent.slot), children, mask, max_tokens, arrivals)
    return k


def register_blocks(core: EngineCore, batch: Any, host: dict, owners: list) -> None:
    """The step wrote the KV of its rows' tokens: mark the blocks it filled cached on
    device, and record their hashes -> block ids in the host hint."""
    core.device.register_step(batch.seq_ids, batch.start_pos, batch.q_lens)
    b = core.block_size
    for r, (req, seq) in enumerate(owners):
        start, q = int(host["start_pos"][r]), int(host["q_lens"][r])
        lo, hi = start // b, (start + q) // b
        if hi <= lo:
            continue
        ids = req.prompt_token_ids + seq.detok.ids
        extend_hashes(seq.hashes, ids, b, hi, req.cache_salt)
        blocks = host["tables"][int(host["seq_ids"][r])]
        core.prefix_index.record(seq.hashes[lo:hi], [int(x) for x in blocks[lo:hi]],
                                 tokens=ids, start=lo, salt=req.cache_salt,
                                 parent_hash=seq.hashes[lo - 1] if lo else None)  # fmt: skip


__all__ = ["assign_slots", "fork_samples", "lookup_prefixes", "register_blocks"]
