"""N-gram tree proposer: several earlier continuations of the suffix, merged into a trie.

The chain proposer (``ngram.py``) copies what followed the latest earlier occurrence of
the sequence's last n tokens. Where the text repeats with variations (chat: a phrase
continued two ways), one occurrence is often the wrong one; this proposer takes up to
``top_k`` distinct continuations (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``, latest occurrence first within each n: the chain proposer's
choice is always the first) and merges them into a trie of at most ``budget`` nodes,
each continuation at most ``depth`` long. The verification (``tree.py``) accepts the
longest path the target agrees with, so the tree never accepts less than its first
branch, the chain proposal, would.

Returns (tokens, parents): node i's token and its parent (-1 = the sequence's last
token, else a node index < i), in insertion order, which is topological and puts the
first continuation's nodes first, so a scheduler that keeps only the first m nodes
keeps a valid tree and the best chain. Siblings have distinct tokens. Host-side numpy,
cost O(L * n) per n tried plus O(top_k * depth) for the trie.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramTreeProposer:
    """Prompt-lookup trees: n in [min_n, max_n], up to ``top_k`` continuations, ``budget``
    nodes."""

    def __init__(self, min_n: int, max_n: int, budget: int, top_k: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= max, got {min_n}, {max_n}")
        if budget < 1 or top_k < 1:
            raise ValueError(f"need tree budget >= 1 and top_k >= 1, got {budget}, {top_k}")
        self.min_n, self.max_n, self.budget, self.top_k = min_n, max_n, budget, top_k

    def continuations(self, a: np.ndarray, depth: int) -> list[tuple[int, ...]]:
        """Up to top_k distinct continuations (longest n first, latest occurrence first)."""
        length = a.shape[0]
        found: list[tuple[int, ...]] = []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = a[length - n :]
            windows = sliding_window_view(a[: length - 1], n)
            hits = np.flatnonzero(np.all(windows == suffix, axis=1))
            for h in hits[::-1]:
                cont = tuple(a[h + n : h + n + depth].tolist())
                if cont and not any(f[: len(cont)] == cont for f in found):
                    found.append(cont)
                    if len(found) == self.top_k:
                        return found
        return found

    def propose_tree(self, ids: Sequence[int] | np.ndarray, depth: int,
                     budget: int | None = None) -> tuple[list[int], list[int]]:  # fmt: skip
        """(tokens, parents) of a trie of at most min(budget, self.budget) nodes and the
        given depth ([] and [] when nothing recurs or depth <= 0)."""
        budget = self.budget if budget is None else min(budget, self.budget)
        if depth <= 0 or budget <= 0:
            return [], []
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for cont in self.continuations(np.asarray(ids, dtype=np.int64), depth):
            parent = -1
            for tok in cont:
                node = index.get((parent, tok))
                if node is None:
                    if len(tokens) == budget:
                        return tokens, parents
                    node = index[(parent, tok)] = len(tokens)
                    tokens.append(int(tok))
                    parents.append(parent)
                parent = node
        return tokens, parents


__all__ = ["NgramTreeProposer"]
