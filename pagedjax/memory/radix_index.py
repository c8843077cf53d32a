"""A radix tree over block-aligned edges (SGLang's RadixAttention), as a ``PrefixIndex``.

Each edge holds a run of k >= 1 full blocks: their token tuples (k x ``block_size``
ints) and their block ids. Children are keyed by the tokens of their edge's first
block, so a lookup costs one dict probe per edge plus one tuple compare per block, and
memory is proportional to the cached blocks, not to the distinct prefixes' lengths.

Why block-aligned edges: KV lives in blocks, so a prefix is reusable only in whole
blocks; splitting an edge mid-block would name half a block. Edges therefore split only
at block boundaries (``insert``), and ``match`` returns exactly the blocks of the
longest cached block-aligned prefix, like the hash chain (``prefix_index.HashChainIndex``),
which tests/test_prefix_index.py checks on random workloads.

Shape invariant (``validate``): every non-root node has a non-empty edge and either no
child or at least two (a single child is merged into its parent on ``remove``; ``insert``
extends a childless edge instead of adding a child), so the tree stays compressed.
Eviction unit is the block: only the last block of a childless edge (a leaf) is
``evictable``; removing it may turn its parent into a leaf. Whether a block is referenced
by a running sequence is the block pool's refcount, not the tree's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pagedjax.memory.block_pool import NULL_BLOCK
from pagedjax.memory.prefix_index import check_block_tokens, check_insert


@dataclass(eq=False)
class _Node:
    keys: list[tuple[int, ...]] = field(default_factory=list)  # one token tuple per block
    blocks: list[int] = field(default_factory=list)
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    parent: _Node | None = None


class RadixIndex:
    """Radix-tree prefix index; see the module docstring for the contract."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._root = _Node()
        self._node: dict[int, _Node] = {}  # block id -> the node whose edge holds it
        self._depth: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._node)

    def __contains__(self, block: object) -> bool:
        return block in self._node

    def match(self, tokens: Sequence[int]) -> list[int]:
        b = self.block_size
        toks = [int(x) for x in tokens]
        out: list[int] = []
        node, pos = self._root, 0
        while pos + b <= len(toks):
            child = node.children.get(tuple(toks[pos : pos + b]))
            if child is None:
                return out
            for key, block in zip(child.keys, child.blocks, strict=True):
                if pos + b > len(toks) or tuple(toks[pos : pos + b]) != key:
                    return out  # the match ends inside this edge
                out.append(block)
                pos += b
            node = child
        return out

    def insert(self, parent: int, tokens: Sequence[int], block: int) -> int:
        t = check_block_tokens(tokens, self.block_size)
        check_insert(parent, block, self._node)
        if parent == NULL_BLOCK:
            node = self._root
        else:
            node = self._node[parent]
            i = node.blocks.index(parent)
            if i + 1 < len(node.blocks):
                if node.keys[i + 1] == t:
                    return node.blocks[i + 1]  # already cached: keep it
                self._split(node, i + 1)
        if t in node.children:
            return node.children[t].blocks[0]
        if node is not self._root and not node.children:
            node.keys.append(t)  # extend a leaf edge: stays compressed
            node.blocks.append(block)
            self._node[block] = node
        else:
            child = _Node(keys=[t], blocks=[block], parent=node)
            node.children[t] = child
            self._node[block] = child
        self._depth[block] = 0 if parent == NULL_BLOCK else self._depth[parent] + 1
        return block

    def _split(self, node: _Node, at: int) -> None:
        """Cut ``node``'s edge before block ``at`` (0 < at < len); the tail becomes its
        only child, taking over its children."""
        tail = _Node(node.keys[at:], node.blocks[at:], node.children, node)
        for c in tail.children.values():
            c.parent = tail
        for b in tail.blocks:
            self._node[b] = tail
        node.keys, node.blocks = node.keys[:at], node.blocks[:at]
        node.children = {tail.keys[0]: tail}

    def remove(self, block: int) -> None:
        node = self._node.get(block)
        if node is None:
            raise ValueError(f"block {block} is not cached")
        if node.children or node.blocks[-1] != block:
            raise ValueError(f"block {block} has a cached child")
        node.blocks.pop()
        key = node.keys.pop()
        del self._node[block], self._depth[block]
        if node.blocks:
            return
        parent = node.parent
        assert parent is not None
        del parent.children[key]
        if parent is not self._root and len(parent.children) == 1:
            (only,) = parent.children.values()  # merge to keep the tree compressed
            parent.keys += only.keys
            parent.blocks += only.blocks
            parent.children = only.children
            for c in parent.children.values():
                c.parent = parent
            for b in only.blocks:
                self._node[b] = parent

    def child(self, parent: int, tokens: Sequence[int]) -> int | None:
        """The cached block holding ``tokens`` right after ``parent`` (``NULL_BLOCK``: a
        first block), or None. Refused (``ValueError``) when ``parent`` is not cached."""
        t = tuple(int(x) for x in tokens)
        if parent == NULL_BLOCK:
            node = self._root
        else:
            node = self._node.get(parent)
            if node is None:
                raise ValueError(f"parent block {parent} is not cached")
            i = node.blocks.index(parent)
            if i + 1 < len(node.blocks):
                return node.blocks[i + 1] if node.keys[i + 1] == t else None
        c = node.children.get(t)
        return None if c is None else c.blocks[0]

    def subtree(self, block: int) -> list[int]:
        """``block`` and every cached block after it in its prefixes, in pre-order (a
        block before the blocks below it): removing them in reverse order never removes
        a block that still has a cached child. Refused (``ValueError``) when ``block``
        is not cached."""
        node = self._node.get(block)
        if node is None:
            raise ValueError(f"block {block} is not cached")
        out = node.blocks[node.blocks.index(block) :]
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            out += n.blocks
            stack.extend(n.children.values())
        return out

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evictable(self) -> set[int]:
        return {n.blocks[-1] for n in self._nodes() if not n.children}

    def depth(self, block: int) -> int:
        return self._depth[block]

    def num_nodes(self) -> int:
        """Edges in the tree (excluding the root); <= cached blocks."""
        return sum(1 for _ in self._nodes())

    def validate(self) -> None:
        """Raise ``AssertionError`` if the shape invariant or the block map is broken."""
        seen = 0
        for n in self._nodes():
            assert n.blocks and len(n.keys) == len(n.blocks)
            assert len(n.children) != 1, "a single child should have been merged"
            assert n.parent is not None and n.parent.children[n.keys[0]] is n
            for b in n.blocks:
                assert self._node[b] is n
            seen += len(n.blocks)
        assert seen == len(self._node) == len(self._depth)
