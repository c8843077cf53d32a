"""The prefix cache's host hint as a radix tree (``RadixIndex``) instead of a hash dict.

Same role and calls as ``prefix_cache.PrefixIndex`` (the engine picks one with
``CacheConfig.prefix_index``): ``propose`` hinted block ids for a prompt's full blocks,
``record`` blocks whose KV a step wrote, ``forget`` hints the device refused, ``count``
the lookup counters (``queries``, ``query_blocks``, ``hit_blocks``). Never trusted: the
jitted ``prefix_cache.match`` verifies every proposed block (tokens, parent link), so a
stale proposal only shortens a hit.

Keys: the hash hint keys a block by its chained hash; this one walks the tree by the
block's token tuple (``tokens``: the sequence's token ids from position 0, ``start``:
the index of the first block of the call), one tree per cache salt (LoRA adapters salt
their blocks, engine/block_hashes.py), so two salts never share a proposal. Lookups
use only the length of ``hashes``; ``record`` keeps each hinted block's chained hash so
the caller's ``parent_hash`` finds the block before ``start`` in O(1) (checked against
the tree's depth; else a walk from the root): a decode records one block per call.

Why a tree: it is prefix-closed, so what the hash dict leaves dangling (a block hinted
under a prefix whose earlier block was forgotten or re-hinted elsewhere) is pruned here:
``forget`` and every re-hint drop the block and whatever hangs below it. Those dangling
entries are the hash hint's only extra proposals, and the device refuses them (a block
below a replaced or evicted one has another parent), so the verified hits are the same;
tests/test_radix_hint.py checks that the radix proposal is always a prefix of the hash
one, exactly equal on lookup-then-record workloads, and equal hit counters in the engine.

The host tier (``kv_offload.HostTier``) looks device blocks up by chained hash in the
middle of a chain (``block_of``, ``hash_of``), which a tree walked from the root does not
answer: so the hint also keeps a ``prefix_cache.PrefixIndex`` fed with the same
``record`` / ``forget`` calls (``chain``), and answers those two from it, exactly as the
hash hint would. Its entries are not pruned with the tree (a block cached below an
evicted one is what the host tier re-links), and its proposals are verified on device
like any other. Memory: one more dict entry pair per hinted block.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedjax.memory.block_pool import NULL_BLOCK
from pagedjax.memory.prefix_cache import HintCounters, PrefixIndex
from pagedjax.memory.radix_index import RadixIndex


def prefix_hint(kind: str, block_size: int) -> PrefixIndex | RadixHint:
    """The engine's host hint for ``CacheConfig.prefix_index`` (``"hash"`` or
    ``"radix"``; anything else ``ValueError``, though the config refuses it first)."""
    if kind == "hash":
        return PrefixIndex()
    if kind == "radix":
        return RadixHint(block_size)
    raise ValueError(f"prefix_index must be 'hash' or 'radix', got {kind!r}")


class RadixHint(HintCounters):
    """Radix-tree prefix hint with ``prefix_cache.PrefixIndex``'s calls (module docstring).

    State: one ``RadixIndex`` per salt, and each hinted block's salt (a physical block
    holds one content, so a block id is in at most one tree)."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._trees: dict[bytes | None, RadixIndex] = {}
        self._salt_of: dict[int, bytes | None] = {}
        # Each hinted block's chained hash and back: ``record`` finds the parent of block
        # ``start`` by the caller's ``parent_hash`` in O(1) instead of walking the tree
        # from the root (O(prefix blocks) per call, paid by every decode block).
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        # The hash hint's maps, kept by the same calls, for the host tier (module docstring)
        self.chain = PrefixIndex()

    def __len__(self) -> int:
        return len(self._salt_of)

    def propose(
        self, hashes: Sequence[int], *, tokens: Sequence[int], salt: bytes | None = None
    ) -> list[int]:
        """Hinted block ids for the leading cached run of the ``len(hashes)`` full blocks
        of ``tokens``."""
        tree = self._trees.get(salt)
        if tree is None or not hashes:
            return []
        return tree.match(tokens[: len(hashes) * self.block_size])

    def record(
        self, hashes: Sequence[int], blocks: Sequence[int], *, tokens: Sequence[int],
        start: int = 0, salt: bytes | None = None, parent_hash: int | None = None,
    ) -> None:  # fmt: skip
        """Hint ``blocks`` as holding full blocks ``start``, ``start + 1``, ... of
        ``tokens`` (as many as ``hashes`` and ``blocks`` both have; ``hashes``: their
        chained hashes). The latest record of a prefix wins (the hash hint's rule); a
        block hinted elsewhere before is dropped with what hangs below it. Stops where
        the chain breaks: the block before ``start`` is not hinted (nothing could verify
        below it), or a null block; the blocks past the break still lose their earlier
        hints (their content changed). ``parent_hash``: the chained hash of block
        ``start - 1``, if the caller has it (found in O(1), else by a walk from the
        root); the tree is checked to hold it at that prefix's depth."""
        self.chain.record(hashes, blocks)
        b = self.block_size
        tree = self._trees.setdefault(salt, RadixIndex(b))
        pairs = list(zip(hashes, blocks, strict=False))
        parent = NULL_BLOCK
        if start > 0:
            found = None if parent_hash is None else self._block_of.get(parent_hash)
            if found is not None and found in tree and tree.depth(found) == start - 1:
                parent = found
            else:
                path = tree.match(tokens[: start * b])
                if len(path) < start:
                    return self._unhint([blk for _, blk in pairs])
                parent = path[-1]
        for i, (h, blk) in enumerate(pairs, start):
            key = tokens[i * b : (i + 1) * b]
            if blk == NULL_BLOCK or len(key) < b:
                return self._unhint([x for _, x in pairs[i - start :]])
            cur = tree.child(parent, key)
            if cur == blk:  # recorded again with the same content: keep it
                parent = blk
                continue
            if blk in self._salt_of:  # the block's earlier content is gone
                self._prune(blk)
                if parent != NULL_BLOCK and parent not in tree:  # the chain was below it
                    return self._unhint([x for _, x in pairs[i - start :]])
                cur = tree.child(parent, key)
            if cur is not None:  # latest wins: its subtree had the old block as parent
                self._prune(cur)
            tree.insert(parent, key, blk)
            self._salt_of[blk] = salt
            self._hash_of[blk] = h
            self._block_of[h] = blk
            parent = blk

    def forget(
        self, hashes: Sequence[int], *, tokens: Sequence[int], start: int = 0,
        salt: bytes | None = None,
    ) -> None:  # fmt: skip
        """Drop the hinted block ``start`` of ``tokens`` (it failed verification) and
        everything below it (``hashes``: the blocks from ``start`` the caller saw fail;
        the subtree covers them; ``chain`` forgets exactly those hashes)."""
        self.chain.forget(hashes)
        tree = self._trees.get(salt)
        if tree is None or not hashes:
            return
        path = tree.match(tokens[: (start + 1) * self.block_size])
        if len(path) == start + 1:
            self._prune(path[start])

    def hash_of(self, block: int) -> int | None:
        """The chained hash ``block`` was last recorded under (``PrefixIndex.hash_of``)."""
        return self.chain.hash_of(block)

    def block_of(self, chained_hash: int) -> int | None:
        """The block last recorded under ``chained_hash`` (``PrefixIndex.block_of``)."""
        return self.chain.block_of(chained_hash)

    def _unhint(self, blocks: list[int]) -> None:
        """Drop the hints of ``blocks`` (refilled past a break in the chain) and below."""
        for x in blocks:
            if x in self._salt_of:
                self._prune(x)

    def _prune(self, block: int) -> None:
        """Drop ``block`` and every hinted block below it (leaves first)."""
        tree = self._trees[self._salt_of[block]]
        for x in reversed(tree.subtree(block)):
            tree.remove(x)
            del self._salt_of[x]
            h = self._hash_of.pop(x)
            if self._block_of.get(h) == x:
                del self._block_of[h]
