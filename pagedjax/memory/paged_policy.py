"""The paged (vLLM) memory policy: the block pool and block tables behind MemoryPolicy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.memory import block_stats as bst
from pagedjax.memory import block_table as btm
from pagedjax.memory.block_pool import BlockPool, create_block_pool, drop_refs
from pagedjax.memory.block_stats import BlockStats
from pagedjax.memory.block_table import BlockTables, CopyOnWrite, blocks_for
from pagedjax.memory.eviction import POLICIES
from pagedjax.memory.policy import MemoryUsage
from pagedjax.memory.prefix_cache import PrefixCacheState, create_prefix_cache, invalidate
from pagedjax.memory.rollback import truncate_batched
from pagedjax.memory.swap import SwapMap, append_pairs, empty_map, move_rows


class PagedState(NamedTuple):
    pool: BlockPool
    tables: BlockTables
    # KV block copies requested by the grows of the current step, indexed by sequence
    # slot (a sequence copies at most its last block, once, per step). The engine applies
    # them before the step's KV writes; ``begin_step`` clears them.
    last_cow: CopyOnWrite
    # Prefix-cache truth (see prefix_cache.py); None when prefix caching is off.
    prefix: PrefixCacheState | None = None
    # Swap preemption (None when the policy has no host pool): the host block pool, which
    # slots' table rows hold host block ids (SWAPPED), and the step's pending block copies
    # device -> host (swap_out) and host -> device (swap_in), cleared by ``begin_step``.
    host_pool: BlockPool | None = None
    on_host: jax.Array | None = None
    swap_out: SwapMap | None = None
    swap_in: SwapMap | None = None
    # Host tier (``track_evictions``): bool[num_blocks], the cached blocks this step's
    # allocations took (their KV is intact until the step's forward), which the engine
    # copies to the host tier before it; cleared by ``begin_step``. None when off.
    evicted: jax.Array | None = None
    # Eviction statistics (block_stats.py) for a policy other than the free list's LRU;
    # None under "lru" (the default) or without prefix caching.
    stats: BlockStats | None = None


@dataclass(frozen=True)
class PagedPolicy:
    """Blocks allocated on demand; a sequence of length L holds ceil(L / block_size) blocks.

    num_blocks counts the null block, so ``num_blocks - 1`` blocks are usable.
    watermark_frac: admissions (use_watermark) must leave int(watermark_frac * num_blocks)
    blocks free, as vLLM's block manager does (paper_notes section 6).
    num_host_blocks: the host (CPU) swap pool's usable blocks; 0 = no swapping (the
    scheduler then preempts by recompute only). See ``swap_out`` / ``swap_in``.
    track_evictions: (prefix caching) record in ``PagedState.evicted`` which cached
    blocks each step's allocations evict, for the host tier (docs/kv_tiers.md).
    eviction_policy: which free cached block an allocation takes (``eviction.POLICIES``):
    "lru" (default) is the free list's order (least recently freed first, O(blocks
    taken)); "lfu" / "cost" keep ``PagedState.stats`` and choose by a sort over the pool
    (``block_stats.pop_victims``, free uncached blocks first). Only with prefix caching
    does it matter (without it no free block holds anything worth keeping).
    """

    num_blocks: int
    block_size: int
    max_seqs: int
    max_blocks_per_seq: int
    watermark_frac: float = 0.0
    enable_prefix_caching: bool = False
    num_host_blocks: int = 0
    track_evictions: bool = False
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_seqs < 1 or self.max_blocks_per_seq < 1:
            raise ValueError("max_seqs and max_blocks_per_seq must be >= 1")
        if not 0.0 <= self.watermark_frac < 1.0:
            raise ValueError(f"watermark_frac must be in [0, 1), got {self.watermark_frac}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.track_evictions and not self.enable_prefix_caching:
            raise ValueError("track_evictions needs enable_prefix_caching")
        if self.eviction_policy not in POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {sorted(POLICIES)}, got {self.eviction_policy!r}"
            )

    @property
    def keeps_stats(self) -> bool:
        """Whether the state carries ``BlockStats`` (a policy other than the free list's)."""
        return self.enable_prefix_caching and self.eviction_policy != "lru"

    @property
    def can_swap(self) -> bool:
        return self.num_host_blocks > 0

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def max_model_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark_frac * self.num_blocks)

    def init_state(self) -> PagedState:
        # Called outside jit: numpy and device_put, not one XLA program per jnp op
        # (may_alias=False: on a CPU device_put may share a numpy buffer; these are donated)
        z, no = jax.device_put((np.zeros((self.max_seqs,), np.int32),
                                np.zeros((self.max_seqs,), bool)), may_alias=False)  # fmt: skip
        state = PagedState(
            create_block_pool(self.num_blocks),
            btm.create_block_tables(self.max_seqs, self.max_blocks_per_seq),
            CopyOnWrite(z, z, no),
            create_prefix_cache(self.num_blocks, self.block_size)
            if self.enable_prefix_caching
            else None,
            *(
                (
                    create_block_pool(self.num_host_blocks + 1),
                    jax.device_put(np.zeros((self.max_seqs,), bool), may_alias=False),
                    _host_empty_map(self.num_blocks),
                    _host_empty_map(self.num_blocks),
                )
                if self.can_swap
                else ()
            ),
        )
        if self.track_evictions:
            state = state._replace(
                evicted=jax.device_put(np.zeros((self.num_blocks,), bool), may_alias=False)
            )
        if self.keeps_stats:
            state = state._replace(
                stats=bst.create_block_stats(self.num_blocks, self.eviction_policy)
            )
        return state

    def begin_step(self, state: PagedState) -> PagedState:
        """Forget the previous step's (already applied) copies."""
        z = jnp.zeros((self.max_seqs,), jnp.int32)
        state = state._replace(last_cow=CopyOnWrite(z, z, jnp.zeros((self.max_seqs,), bool)))
        if self.can_swap:
            state = state._replace(
                swap_out=empty_map(self.num_blocks), swap_in=empty_map(self.num_blocks)
            )
        if self.track_evictions:
            state = state._replace(evicted=jnp.zeros((self.num_blocks,), bool))
        if state.stats is not None:
            state = state._replace(stats=bst.tick(state.stats))
        return state

    def _pop(self, state: PagedState) -> bst.PopFn:
        """The device pool's allocator under this policy (block_stats.pop_fn)."""
        return bst.pop_fn(state.stats, None if state.prefix is None else state.prefix.cached)

    def _touch_rows(self, state: PagedState, mask: jax.Array) -> PagedState:
        """Eviction statistics: the masked slots' blocks are freed (or left) now."""
        if state.stats is None:
            return state
        rows = state.tables.tables
        stats = bst.touch(state.stats, rows.reshape(-1), jnp.repeat(mask, rows.shape[1]))
        return state._replace(stats=stats)

    def _forget(self, state: PagedState, blocks: jax.Array, mask: jax.Array) -> PagedState:
        """The pool handed out ``blocks`` (where ``mask``) for new contents: they are no
        longer cached (``prefix_cache.invalidate``); with ``track_evictions`` the cached
        ones among them are recorded as evicted this step."""
        prefix = invalidate(state.prefix, blocks, mask)
        if state.evicted is not None:
            state = state._replace(evicted=state.evicted | (state.prefix.cached & ~prefix.cached))
        return state._replace(prefix=prefix)

    # -- swap preemption ------------------------------------------------------------------
    # A step moves each device block out at most once (a block freed by a swap-out may be
    # reallocated to a growing sequence in the same step, but that sequence is never a
    # victim later in the step) and swaps in only in steps without preemption, so both
    # maps fit num_blocks pairs and a step's swap-out and swap-in blocks are disjoint.

    def swap_out(self, state: PagedState, mask: jax.Array) -> tuple[PagedState, jax.Array]:
        """Move the masked slots' blocks (bool[max_seqs], on device) to the host pool,
        all or nothing; shared blocks are copied once. ok False: the host pool is full."""
        # (statistics: touching held blocks on a refused call is harmless, a held block's
        # last access is set again when it is freed)
        state = self._touch_rows(state, mask)
        pool, host, tables, src, dst, count, ok = move_rows(
            state.pool, state.host_pool, state.tables, mask
        )
        # The freed device blocks keep their contents, so their prefix-cache entries stay.
        return state._replace(
            pool=pool,
            host_pool=host,
            tables=tables,
            on_host=state.on_host | (mask & ok),
            swap_out=append_pairs(state.swap_out, src, dst, count),
        ), ok

    def swap_in(
        self, state: PagedState, mask: jax.Array, num_seqs: jax.Array, reserve: jax.Array
    ) -> tuple[PagedState, jax.Array]:
        """Move the masked slots' blocks (on host) back to device, all or nothing. With
        ``reserve`` the device must keep ``watermark + num_seqs`` blocks free afterwards
        (vLLM's can_swap_in: one spare block per sequence for its next token)."""
        extra = self.watermark_blocks + jnp.asarray(num_seqs, jnp.int32)
        reserve = jnp.where(reserve, extra, 0)
        host, pool, tables, src, dst, count, ok = move_rows(
            state.host_pool, state.pool, state.tables, mask, reserve, self._pop(state)
        )
        if state.prefix is not None:  # the blocks get the swapped-in contents
            state = self._forget(state, dst, jnp.arange(dst.shape[0]) < count)
        return state._replace(
            pool=pool,
            host_pool=host,
            tables=tables,
            on_host=state.on_host & ~(mask & ok),
            swap_in=append_pairs(state.swap_in, src, dst, count),
        ), ok

    def grow(self, state, seq_ids, new_lens, final_lens, max_lens, mask, use_watermark):
        del final_lens, max_lens  # paged allocation needs only the current length
        seq_ids = jnp.asarray(seq_ids, jnp.int32)
        safe = jnp.clip(seq_ids, 0, self.max_seqs - 1)
        ns = jnp.maximum(jnp.asarray(new_lens, jnp.int32) - state.tables.lengths[safe], 0)
        reserve = jnp.where(use_watermark, self.watermark_blocks, 0)
        pool, tables, cow, ok = btm.append_tokens_batched(
            state.pool,
            state.tables,
            seq_ids,
            ns,
            mask,
            self.block_size,
            self.max_model_len,
            reserve,
            self._pop(state),
        )
        # Merge this call's copies into the step's pending copies, by sequence slot.
        slot = jnp.where(cow.valid, seq_ids, self.max_seqs)  # out of range: dropped
        pending = CopyOnWrite(
            state.last_cow.src.at[slot].set(cow.src, mode="drop"),
            state.last_cow.dst.at[slot].set(cow.dst, mode="drop"),
            state.last_cow.valid.at[slot].set(True, mode="drop"),
        )
        if state.prefix is not None:
            # Blocks the pool just handed out get new contents: they are no longer cached.
            rows = jnp.clip(seq_ids, 0, self.max_seqs - 1)
            before, after = state.tables.tables[rows], tables.tables[rows]
            state = self._forget(state, after.reshape(-1), (after != before).reshape(-1))
        return state._replace(pool=pool, tables=tables, last_cow=pending), ok

    def release(self, state, seq_ids, mask):
        if state.stats is not None:  # the rows' blocks are freed now (held ones: harmless)
            ids = jnp.where(jnp.asarray(mask, bool), jnp.asarray(seq_ids, jnp.int32), self.max_seqs)
            on = jnp.zeros((self.max_seqs,), bool).at[ids].set(True, mode="drop")
            if self.can_swap:
                on = on & ~state.on_host  # host block ids: not device blocks
            state = self._touch_rows(state, on)
        if not self.can_swap:
            pool, tables = btm.release_batched(state.pool, state.tables, seq_ids, mask)
            return state._replace(pool=pool, tables=tables)
        # Swapped rows hold host block ids: their references go back to the host pool.
        seq_ids = jnp.asarray(seq_ids, jnp.int32)
        mask = jnp.asarray(mask, bool)
        host = state.on_host[jnp.clip(seq_ids, 0, self.max_seqs - 1)]
        pool, tables = btm.release_batched(state.pool, state.tables, seq_ids, mask & ~host)
        hpool, tables = btm.release_batched(state.host_pool, tables, seq_ids, mask & host)
        gone = jnp.where(mask, seq_ids, self.max_seqs)
        on_host = state.on_host.at[gone].set(False, mode="drop")
        return state._replace(pool=pool, tables=tables, host_pool=hpool, on_host=on_host)

    def truncate(self, state, seq_ids, new_lens, mask):
        """Roll the masked device-resident rows back to ``new_lens`` tokens (speculative
        drafts rejected): blocks wholly past it return to the pool (rollback.py)."""
        pool, tables = truncate_batched(
            state.pool, state.tables, seq_ids, new_lens, mask, self.block_size
        )
        return state._replace(pool=pool, tables=tables)

    # -- blocks lent outside the block tables (LoRA adapters paged in the pool) ----------

    def lend_blocks(self, state: PagedState, n: jax.Array, max_n: int
                    ) -> tuple[PagedState, jax.Array, jax.Array]:  # fmt: skip
        """Take ``n`` free blocks (int32 scalar, <= max_n) out of the pool for contents
        that are not KV (engine/lora_paging.py: an adapter's weights), all or nothing:
        (state', blocks int32[max_n] (NULL_BLOCK past n), ok). Refused (state unchanged)
        when fewer than n are free. Taken by this policy's allocator, so a cached free
        block is evicted as a sequence's allocation would evict it, and forgotten by the
        prefix cache (its contents are about to change; not recorded as evicted for a
        host tier, which would copy the new contents as KV). O(max_n)."""
        n = jnp.asarray(n, jnp.int32)
        ok = (n >= 0) & (n <= max_n) & (n <= state.pool.num_free)
        count = jnp.where(ok, n, 0)
        pool, blocks = self._pop(state)(state.pool, count, max_n)
        if state.prefix is not None:
            state = state._replace(prefix=invalidate(state.prefix, blocks,
                                                     jnp.arange(max_n) < count))  # fmt: skip
        return state._replace(pool=pool), blocks, ok

    def return_blocks(self, state: PagedState, blocks: jax.Array, count: jax.Array
                      ) -> PagedState:  # fmt: skip
        """Give ``blocks[:count]`` (each lent by ``lend_blocks``, refcount 1) back to the
        free list, uncached. Unchecked (the lender's bookkeeping holds exactly these)."""
        return state._replace(pool=drop_refs(state.pool, blocks, count))

    def free_slots(self, state: PagedState) -> jax.Array:
        """float32[]: slots in free blocks (held by no sequence), the "free" part of
        Fig. 2's last category; a paged pool has no external fragmentation besides it."""
        return (state.pool.num_free * self.block_size).astype(jnp.float32)

    def usage(self, state, lens, final_lens, live) -> MemoryUsage:
        return paged_usage(
            state.tables.lengths, lens, final_lens, live, self.block_size, self.capacity_tokens
        )


def paged_usage(held_lens, lens, final_lens, live, block_size: int, capacity: int) -> MemoryUsage:
    """Fig. 2 categories for paged allocation (each input ``[max_seqs]``).

    A live sequence holds ceil(held_len / B) blocks: ``lens`` slots carry tokens; slots
    in [len, final_len) of those blocks will be written later (reserved); the rest of
    the last block is never used (internal fragmentation). Blocks shared by several
    sequences are counted once per sequence here (sharing is measured separately).
    """
    held = (blocks_for(held_lens, block_size) * block_size).astype(jnp.float32)
    lens = jnp.asarray(lens, jnp.float32)
    final = jnp.maximum(jnp.asarray(final_lens, jnp.float32), lens)
    f = live.astype(jnp.float32)
    tokens = jnp.sum(f * jnp.minimum(lens, held))
    reserved = jnp.sum(f * jnp.clip(jnp.minimum(final, held) - lens, 0))
    internal = jnp.sum(f * jnp.clip(held - final, 0))
    cap = jnp.asarray(capacity, jnp.float32)
    return MemoryUsage(tokens, reserved, internal, cap - tokens - reserved - internal, cap)


def _host_empty_map(k: int) -> SwapMap:
    """``empty_map(k)`` built with numpy (init_state runs outside jit; ``empty_map`` also
    runs traced, in ``begin_step``, so it keeps its jnp)."""
    z, count = jax.device_put((np.zeros((k,), np.int32), np.int32(0)), may_alias=False)
    return SwapMap(z, z, count)
