"""The host tier, engine side: offload evicted prefix blocks, reload them on a hit.

``memory/host_tier.py`` holds the parts (the bounded index, the allocator exchange, the
cross-tier hit); this module drives them from the engine (docs/kv_tiers.md):

- Offload. An allocation that takes a cached free block from the device pool evicts it.
  The jitted ``schedule`` records such blocks (``PagedState.evicted``); ``LLMEngine``
  hands them to ``gather`` right after the schedule, before the step's swap-in copies
  and forward overwrite them, and to ``store`` after its swap copies (so the tier never
  takes a host block a swap-in still has to read). ``reload`` offloads the blocks its
  own allocation evicts the same way. A block goes to the host under the hash the prefix
  hint last recorded for it (``prefix_cache.PrefixIndex.hash_of``) with its device
  tokens; a hash already kept is only touched. The fused K-step decode loop has no host
  work between iterations, so an iteration that would evict is rolled back and rerun by
  the one-step path (``decode_loop``'s exit rule).
- Reload. ``admission.lookup_prefixes`` attaches the verified device prefix first, then
  calls ``reload``: the host run continuing it (tokens checked; ``plan``: with the
  device blocks still cached after it, re-linked), cut by
  ``host_tier.cross_tier_hit``, gets fresh device blocks (``sharing.attach_reloaded``:
  counted in the pool like any held block, so the scheduler's budget sees them) and
  their KV is copied in before ``schedule`` runs, i.e. before the prefill that reads
  them. The copy is synchronous (host -> device between steps), not overlapped.

Device blocks reloaded from the host stay on the host too (the tier is inclusive): a
second eviction of the same prefix costs no copy.

Disk (``kv_offloading_disk_path``; ``memory/disk_tier.py``): every gathered block is also
written to a file (write-through, so the files hold what the host tier ever held, bounded
by ``kv_offloading_disk_size``), and ``reload`` first promotes the blocks that continue a
looked-up prefix past the host tier from their files into the host tier (``store``, as an
offload), after which the host reload runs unchanged. The files are keyed by a
fingerprint of the weights (a digest of every parameter leaf), the block size and the KV
pool's leaf shapes and dtypes, computed at the first use, so a restarted engine with the
same model reads them and any other engine never does. LoRA is refused (the parameters
change with the bound adapters).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.memory.disk_tier import DiskTier
from pagedjax.memory.host_tier import HostTierIndex, cross_tier_hit


@dataclass
class TierCounters:
    """Host-tier counters since the last reset (``LLMEngine.stats``).

    device_hit_tokens / host_hit_tokens: prefix tokens reused from each tier;
    offloaded_blocks / reloaded_blocks: blocks copied device -> host / host -> device;
    offloaded_bytes / reloaded_bytes: their KV bytes; dropped_blocks: evicted cached
    blocks not kept (no hash recorded, or the host pool full of swapped blocks);
    relinked_blocks: device blocks attached after a host run (their parent re-linked);
    disk_written_blocks / disk_loaded_blocks: block files written, and read back into the
    host tier (the disk tier).
    """

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    offloaded_blocks: int = 0
    reloaded_blocks: int = 0
    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    dropped_blocks: int = 0
    relinked_blocks: int = 0
    disk_written_blocks: int = 0
    disk_loaded_blocks: int = 0


@dataclass
class Pending:
    """Evicted blocks read from the device, not yet written to the host."""

    hashes: list[int]
    tokens: np.ndarray  # int32[n, B]
    pages: Any  # numpy leaves [L, n, ...]


def build_host_tier(config: Any, bytes_per_block: int) -> HostTier | None:
    """The engine's host tier from an ``EngineConfig`` (None when kv_offloading_size
    holds no block). bytes_per_block: KV bytes of one block, all layers and TP ranks."""
    cc = config.cache
    if (
        cc.kv_offloading_size > 0
        and config.speculative is not None
        and (config.speculative.method != "ngram")
    ):  # a draft's KV (own pool or EAGLE's) would not travel with the tier's blocks
        raise ValueError("kv_offloading_size > 0 with a drafting speculative method: not"
                         " built yet (the host tier keeps the target's KV only)")  # fmt: skip
    if cc.kv_offloading_disk_path is not None and config.lora is not None:
        raise ValueError(
            "kv_offloading_disk_path with LoRA: not built yet (the disk tier's fingerprint"
            " is of the weights, which change with the adapters)"
        )
    capacity = int(cc.kv_offloading_size * (1 << 30)) // bytes_per_block
    if capacity <= 0:
        return None
    disk = None
    if cc.kv_offloading_disk_path is not None:
        disk = DiskOptions(cc.kv_offloading_disk_path, int(cc.kv_offloading_disk_size * (1 << 30)),
                           dict(cache_dtype=cc.cache_dtype, block_size=cc.block_size))  # fmt: skip
    return HostTier(capacity, cc.block_size, bytes_per_block, disk)


@dataclass(frozen=True)
class DiskOptions:
    """Where the disk tier lives and how large it may grow; ``describe``: settings that
    go into its fingerprint besides the weights and the pool's leaves."""

    path: str
    capacity_bytes: int
    describe: dict[str, Any]


def weights_digest(params: Any) -> str:
    """A digest of the parameters (every leaf's shape, dtype, sum and first 64 values):
    two engines with other weights (another checkpoint, another random seed) differ."""
    h = hashlib.blake2b(digest_size=16)
    for leaf in jax.tree.leaves(params):
        x = jnp.asarray(leaf)
        flat = jnp.ravel(x)[:64].astype(jnp.float32)
        total = jnp.sum(x.astype(jnp.float32))
        first, total = jax.device_get((flat, total))
        h.update(f"{x.shape}{x.dtype}".encode())
        h.update(np.asarray(first).tobytes() + struct.pack("<d", float(total)))
    return h.hexdigest()


class HostTier:
    """One engine's host tier. capacity: blocks (``kv_offloading_size`` / bytes per
    block); bytes_per_block: KV bytes of one block, all layers (the stats' unit); disk:
    the disk tier under it (None: off)."""

    def __init__(self, capacity: int, block_size: int, bytes_per_block: int,
                 disk: DiskOptions | None = None):  # fmt: skip
        self.index = HostTierIndex(capacity, block_size)
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.counters = TierCounters()
        self.disk_options = disk
        self._disk: DiskTier | None = None  # opened at the first use (needs the weights)

    def disk(self, core: Any) -> DiskTier | None:
        """The disk tier, opened at the first call: its fingerprint needs the engine's
        weights and host pool."""
        if self.disk_options is None or self._disk is not None:
            return self._disk
        leaves = jax.tree.leaves(core.device.host_kv)
        specs = [((x.shape[0], 1, *x.shape[2:]), x.dtype) for x in leaves]
        key = dict(self.disk_options.describe, weights=weights_digest(core.params),
                   leaves=[[list(s), str(d)] for s, d in specs])  # fmt: skip
        fingerprint = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(),
                                      digest_size=16).hexdigest()  # fmt: skip
        self._disk = DiskTier(self.disk_options.path, fingerprint, specs, self.block_size,
                              self.disk_options.capacity_bytes)  # fmt: skip
        return self._disk

    @property
    def capacity(self) -> int:
        return self.index.capacity

    # ------------------------------------------------------------------ offload

    def gather(self, core: Any, blocks: np.ndarray,
               tokens: np.ndarray | None = None) -> Pending | None:  # fmt: skip
        """Read evicted device ``blocks`` (their KV still intact) for ``store``; their
        tokens are the device prefix cache's unless given (int32[len(blocks), B]: the
        blocks were registered again since)."""
        if not len(blocks):
            return None
        keep, hashes = [], []
        seen: set[int] = set()
        for j, b in enumerate(blocks.tolist()):
            h = core.prefix_index.hash_of(b)
            if h is None:
                self.counters.dropped_blocks += 1
            elif h in self.index or h in seen:
                self.index.touch([h])
            else:
                seen.add(h)
                keep.append(j)
                hashes.append(h)
        if not keep:
            return None
        pages, toks = core.device.read_blocks(blocks[np.asarray(keep)].astype(np.int32))
        if tokens is not None:
            toks = tokens[np.asarray(keep)]
        return Pending(hashes, toks, pages)

    def store(self, core: Any, pending: Pending | None, to_disk: bool = True) -> int:
        """Write gathered blocks into host blocks of the shared pool, evicting the
        tier's least recently used entries past its capacity; and every one of them to
        the disk tier when it is on (``to_disk``: False for blocks read from it). Returns
        the number of blocks the host tier took."""
        if pending is None:
            return 0
        disk = self.disk(core) if to_disk else None
        if disk is not None:
            self.counters.disk_written_blocks += disk.write(
                pending.hashes, pending.tokens, jax.tree.leaves(pending.pages)
            )
        new = [i for i, h in enumerate(pending.hashes) if h not in self.index]
        new = new[len(new) - min(len(new), self.capacity) :]  # the most recent ones fit
        if not new:
            self.counters.dropped_blocks += len(pending.hashes)
            return 0
        victims, freed = self.index.plan_store(len(new))
        self.index.evict(victims)
        got = core.device.host_exchange(np.asarray(freed, np.int32), len(new))
        taken = new[: len(got)]
        self.counters.dropped_blocks += len(pending.hashes) - len(taken)
        if not taken:
            return 0
        idx = np.asarray(taken)
        core.device.write_host_blocks(got, _take(pending.pages, idx))
        self.index.commit([pending.hashes[i] for i in taken], pending.tokens[idx], got.tolist())
        if to_disk:  # a device -> host copy (else a disk -> host read)
            self.counters.offloaded_blocks += len(taken)
            self.counters.offloaded_bytes += len(taken) * self.bytes_per_block
        return len(taken)

    # ------------------------------------------------------------------ reload

    def plan(self, core: Any, hashes: list[int], ids: list[int], start: int) -> list[int]:
        """The cached prefix continuing a device hit of ``start`` blocks: per block, a
        host block id (> 0) or -device block id for a block still on the device after a
        host run (the prefix hint's block whose recorded hash is this prefix's: a block
        registered again since has another). Starts with a host block, or is empty."""
        b, out = self.block_size, []
        for p in range(start, len(hashes)):
            blk = self.index.get(hashes[p], ids[p * b : (p + 1) * b])
            if blk is not None:
                out.append(blk)
                continue
            cand = core.prefix_index.block_of(hashes[p])  # either hint keeps hash -> block
            if not out or cand is None or core.prefix_index.hash_of(cand) != hashes[p]:
                break
            out.append(-cand)
        return out

    def reload(self, core: Any, rows: list[tuple[int, list[int], list[int], int, int]],
               salts: list[bytes | None] | None = None) -> None:  # fmt: skip
        """Extend attached device hits with the rest of the cached prefix: host blocks
        (loaded into fresh device blocks) and device blocks after them.

        rows: (slot, chained hashes of the full blocks, token ids, verified device
        blocks, attached device blocks) per looked-up slot, after ``attach_hits``;
        salts: each row's cache salt (the radix hint records by salt; None: unsalted).
        """
        b, n, m = self.block_size, core.max_seqs, core.max_blocks_per_seq
        if self.disk_options is not None:
            self.promote(core, rows)
        slots = np.zeros(n, np.int32)
        kinds = np.zeros((n, m), np.int32)
        cands = np.zeros((n, m), np.int32)
        mask = np.zeros(n, bool)
        plans: list[list[int]] = []
        for k, (slot, hashes, ids, verified, used) in enumerate(rows):
            plan = self.plan(core, hashes, ids, used) if used == verified else []
            _, rest = cross_tier_hit(np.array([used]), np.array([len(plan)]),
                                     np.array([len(ids)]), b)  # fmt: skip
            plan = plan[: int(rest[0])]
            plans.append(plan)
            cols = slice(used, used + len(plan))
            kinds[k, cols] = [1 if x > 0 else 2 for x in plan]
            cands[k, cols] = [-x if x < 0 else 0 for x in plan]
            slots[k], mask[k] = slot, bool(plan)
        if not mask.any():
            return
        out = core.device.attach_reloaded(slots, kinds, cands, mask)
        new, got, total, was, old = jax.device_get(out)
        # Evicted by this allocation: read them before the reloaded KV overwrites them.
        ev_rows, ev_cols = np.nonzero(was)
        evicted = new[ev_rows, ev_cols]
        pending = self.gather(core, evicted, old[ev_rows, ev_cols])
        dst, src = [], []
        for k, (_slot, hashes, ids, _v, used) in enumerate(rows):
            g, tot = int(got[k]), int(total[k])
            if tot == 0:
                continue
            fresh = iter(new[k, :g].tolist())
            blocks = []
            for x in plans[k][:tot]:
                if x > 0:
                    blocks.append(next(fresh))
                    dst.append(blocks[-1])
                    src.append(x)
                else:
                    blocks.append(-x)
            core.prefix_index.record(
                hashes[used : used + tot], blocks, tokens=ids, start=used,
                salt=None if salts is None else salts[k],
                parent_hash=hashes[used - 1] if used else None)  # fmt: skip
            self.index.touch(hashes[used : used + tot])
            self.counters.host_hit_tokens += g * b
            self.counters.device_hit_tokens += (tot - g) * b
            self.counters.relinked_blocks += tot - g
            core.sharing.hit_tokens += tot * b
        if dst:
            pages = core.device.read_host_blocks(np.asarray(src, np.int32))
            core.device.write_blocks(np.asarray(dst, np.int32), pages)
            self.counters.reloaded_blocks += len(dst)
            self.counters.reloaded_bytes += len(dst) * self.bytes_per_block
        self.store(core, pending)

    def promote(self, core: Any, rows: list[tuple[int, list[int], list[int], int, int]]) -> None:
        """Read the blocks that continue each row's attached prefix past the host tier
        from the disk tier into the host tier (``store``, not written back), up to the
        first block in neither. All rows before any plan: a later ``store`` may evict
        host entries, so no plan may hold them yet."""
        disk, b = self.disk(core), self.block_size
        hashes_in: list[int] = []
        toks: list[np.ndarray] = []
        leaves: list[list[np.ndarray]] = []
        seen: set[int] = set()
        for _slot, hashes, ids, verified, used in rows:
            if used != verified:
                continue
            for p in range(used, len(hashes)):
                h = hashes[p]
                if h in self.index or h in seen:
                    continue
                got = disk.read(h, ids[p * b : (p + 1) * b])
                if got is None:
                    break
                seen.add(h)
                hashes_in.append(h)
                toks.append(np.asarray(ids[p * b : (p + 1) * b], np.int32))
                leaves.append(got)
        if not hashes_in:
            return
        cat = [np.concatenate(parts, axis=1) for parts in zip(*leaves, strict=True)]
        pages = jax.tree.unflatten(jax.tree.structure(core.device.host_kv), cat)
        taken = self.store(core, Pending(hashes_in, np.stack(toks), pages), to_disk=False)
        self.counters.disk_loaded_blocks += taken

    def stats(self) -> dict[str, int]:
        c = self.counters
        return dict(
            prefix_cache_device_hit_tokens=c.device_hit_tokens,
            prefix_cache_host_hit_tokens=c.host_hit_tokens,
            kv_offloaded_blocks=c.offloaded_blocks,
            kv_reloaded_blocks=c.reloaded_blocks,
            kv_offloaded_bytes=c.offloaded_bytes,
            kv_reloaded_bytes=c.reloaded_bytes,
            kv_offload_dropped_blocks=c.dropped_blocks,
            kv_relinked_blocks=c.relinked_blocks,
            kv_disk_written_blocks=c.disk_written_blocks,
            kv_disk_loaded_blocks=c.disk_loaded_blocks,
            kv_host_tier_blocks=len(self.index),
            kv_host_tier_capacity_blocks=self.capacity,
        )

    def reset_stats(self) -> None:
        self.counters = TierCounters()


def _take(pages: Any, idx: np.ndarray) -> Any:
    return jax.tree.map(lambda p: p[:, idx], pages)


__all__ = ["DiskOptions", "HostTier", "Pending", "TierCounters", "build_host_tier",
           "weights_digest"]
