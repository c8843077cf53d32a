"""Automatic prefix caching: full KV blocks reused across requests, verified on device.

Who owns what (DESIGN.md: one owner of the cache's state): the device owns the truth.
``PrefixCacheState`` records, per physical block, whether it holds a registered full
block, its tokens and its parent block. The host keeps only a *hint*, ``PrefixIndex``, a
dict from the chained 64-bit hash of a block's tokens (and its parent's hash) to the
block id it was last registered in. A lookup proposes the hinted blocks for a prompt;
the jitted ``match`` accepts the longest chain whose stored tokens and parent links
equal the prompt's, so a hash collision or a stale hint (a block since evicted and
reused) can never return wrong KV: it only shortens the hit.

Eviction is the block pool's: a cached block whose last reference is dropped goes to the
tail of the free list with its contents, is reused least recently freed first, and is
invalidated the moment the pool hands it out again (``invalidate``). ``acquire`` revives
a freed cached block in O(1) (``unlink_free``) or shares a live one (refcount + 1).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.memory import block_pool as bp
from pagedjax.memory.block_pool import NULL_BLOCK, BlockPool


class PrefixCacheState(NamedTuple):
    """tokens int32[N, B]: a cached block's token ids; parent int32[N]: the block before
    it in its prefix (NULL_BLOCK for a prompt's first block); cached bool[N]."""

    tokens: jax.Array
    parent: jax.Array
    cached: jax.Array


def create_prefix_cache(num_blocks: int, block_size: int) -> PrefixCacheState:
    # numpy, one device_put: no op-by-op XLA programs outside jit (create_block_pool)
    return PrefixCacheState(*jax.device_put((
        np.full((num_blocks, block_size), -1, np.int32),
        np.zeros((num_blocks,), np.int32),
        np.zeros((num_blocks,), bool),
    ), may_alias=False))  # fmt: skip


def register(
    state: PrefixCacheState,
    blocks: jax.Array,
    parents: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
) -> PrefixCacheState:
    """Mark full blocks (int32[K]) as cached with their tokens (int32[K, B]) and parents
    (int32[K]); only where ``mask`` (bool[K]). Call once their KV has been written."""
    n = state.cached.shape[0]
    idx = jnp.where(mask & (blocks != NULL_BLOCK), blocks, n)  # out of range: dropped
    return PrefixCacheState(
        tokens=state.tokens.at[idx].set(tokens, mode="drop"),
        parent=state.parent.at[idx].set(parents, mode="drop"),
        cached=state.cached.at[idx].set(True, mode="drop"),
    )


def invalidate(state: PrefixCacheState, blocks: jax.Array, mask: jax.Array) -> PrefixCacheState:
    """Forget blocks the pool has handed out for new contents (int32[K], bool[K])."""
    n = state.cached.shape[0]
    idx = jnp.where(mask, blocks, n)
    return state._replace(cached=state.cached.at[idx].set(False, mode="drop"))


def match(
    state: PrefixCacheState, candidates: jax.Array, tokens: jax.Array, num_full: jax.Array
) -> jax.Array:
    """Length (in blocks) of the longest verified cached prefix.

    Args:
      candidates: int32[K] hinted block ids for the prompt's full blocks 0..K-1.
      tokens: int32[K, B] the prompt's tokens, block by block.
      num_full: int32 scalar; how many of the K rows are real full blocks.
    Block i is accepted iff it is cached, holds exactly ``tokens[i]``, its parent is the
    accepted block i-1 (NULL_BLOCK for i = 0), and all blocks before it were accepted.
    """
    k = candidates.shape[0]
    c = jnp.clip(candidates, 0, state.cached.shape[0] - 1)
    prev = jnp.concatenate([jnp.full((1,), NULL_BLOCK, jnp.int32), candidates[:-1]])
    ok = (
        (candidates > NULL_BLOCK)
        & (candidates < state.cached.shape[0])
        & state.cached[c]
        & jnp.all(state.tokens[c] == tokens, axis=1)
        & (state.parent[c] == prev)
        & (jnp.arange(k) < num_full)
    )
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))


def acquire(pool: BlockPool, blocks: jax.Array, count: jax.Array) -> BlockPool:
    """Take a reference to ``blocks[:count]`` (int32[K], verified by ``match``): revive a
    freed one from the free list (O(1)), or share a live one."""

    def body(i, pool):
        return bp.acquire_ref(pool, jax.lax.dynamic_index_in_dim(blocks, i, keepdims=False))

    return jax.lax.fori_loop(0, count, body, pool)


def chain_hashes(token_ids: list[int] | np.ndarray, block_size: int) -> list[int]:
    """64-bit chained hashes of the full blocks of ``token_ids``: block i's hash covers
    its tokens and block i-1's hash, so equal hashes mean (up to collisions, which
    ``match`` rejects) equal prefixes."""
    toks = np.asarray(token_ids, dtype=np.int64)
    out, parent = [], b"\0" * 8
    for i in range(len(toks) // block_size):
        h = hashlib.blake2b(
            parent + toks[i * block_size : (i + 1) * block_size].tobytes(), digest_size=8
        ).digest()
        out.append(int.from_bytes(h, "little"))
        parent = h
    return out


class HintCounters:
    """How well a host hint's proposals held up on device, for stats and ``/metrics``:
    ``queries`` (admissions that asked), ``query_blocks`` (blocks proposed), ``hit_blocks``
    (blocks the device verified). Shared by every hint (``PrefixIndex``,
    ``radix_hint.RadixHint``) so the engine reads one set of names."""

    queries: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0

    def count(self, proposed_blocks: int, hit_blocks: int) -> None:
        self.queries += 1
        self.query_blocks += proposed_blocks
        self.hit_blocks += hit_blocks

    def reset_counters(self) -> None:
        self.queries = self.hit_blocks = self.query_blocks = 0


class PrefixIndex(HintCounters):
    """Host-side hint: chained block hash -> the block id it was registered in.

    Never trusted on its own: ``match`` verifies every proposed block on device.

    A block is hinted under the hash of its latest registration only: ``record`` drops
    the hint an earlier content of the same block left. ``match`` compares tokens and
    parents, not what the hash keyed beyond them (a cache salt: a LoRA adapter's id,
    engine/block_hashes.py), so a stale hint to a block since refilled with the same
    tokens under another salt would verify and share another adapter's KV.

    ``hash_of(block)``: the hash a block was last recorded under (the host tier keys
    an evicted block's KV by it, docs/kv_tiers.md).
    """

    def __init__(self) -> None:
        self._block_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}  # block -> the hash it is hinted under

    def __len__(self) -> int:
        return len(self._block_of)

    def propose(self, hashes: list[int], **_context: object) -> list[int]:
        """Hinted block ids for the leading run of known hashes. ``_context``: the
        keywords ``radix_hint.RadixHint`` needs (tokens, start, salt, parent_hash); the hashes
        already cover them."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def record(self, hashes: list[int], blocks: list[int], **_context: object) -> None:
        for h, b in zip(hashes, blocks, strict=False):
            if b == NULL_BLOCK:
                continue
            old = self._hash_of.get(b)
            if old is not None and old != h and self._block_of.get(old) == b:
                del self._block_of[old]  # the block's earlier content is gone
            prev = self._block_of.get(h)
            if prev is not None and prev != b and self._hash_of.get(prev) == h:
                del self._hash_of[prev]
            self._block_of[h] = b
            self._hash_of[b] = h

    def forget(self, hashes: list[int], **_context: object) -> None:
        """Drop hints that failed verification (stale: the block was reused)."""
        for h in hashes:
            b = self._block_of.pop(h, None)
            if b is not None and self._hash_of.get(b) == h:
                del self._hash_of[b]

    def hash_of(self, block: int) -> int | None:
        """The hash ``block`` was last recorded under (None: never, or forgotten)."""
        return self._hash_of.get(block)

    def block_of(self, chained_hash: int) -> int | None:
        """The block hinted under ``chained_hash`` (None: none); the host tier's lookup in
        the middle of a chain (kv_offload.HostTier.plan)."""
        return self._block_of.get(chained_hash)

def usable_hit(hit_blocks: int, prompt_len: int, block_size: int) -> int:
    """Blocks of a verified hit to reuse: when the whole prompt is cached up to a block
    boundary, drop the last block, so the last prompt token is computed (its logits are
    needed) without writing into a shared block."""
    if hit_blocks * block_size >= prompt_len:
        return max(0, (prompt_len - 1) // block_size)
    return hit_blocks
