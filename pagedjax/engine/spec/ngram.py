"""N-gram (prompt lookup) proposer: drafts copied from the sequence's own earlier text.

For a sequence whose ids (prompt + output) end in the n-gram ``g`` (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``), the proposal is the up to k
tokens that followed the most recent earlier occurrence of ``g``; no occurrence of any
n gives no proposal. It needs no model and no device work, and pays off where the
output copies its context (summaries, code edits, extraction), which is why vLLM ships
it as its first method. Host-side numpy; cost O(L * n) per sequence per n tried (L the
ids' length), a few microseconds per kilotoken.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Prompt lookup with vLLM's knobs: n in [min_n, max_n], longest first."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to ``k`` draft ids to follow ``ids`` ([] when no n-gram recurs or k <= 0)."""
        if k <= 0:
            return []
        a = np.asarray(ids, dtype=np.int64)
        length = a.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = a[length - n :]
            # Windows starting at 0 .. length - n - 1: every occurrence before the suffix
            # itself; the latest one wins (recent text predicts best).
            windows = sliding_window_view(a[: length - 1], n)
            hits = np.flatnonzero(np.all(windows == suffix, axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return a[start : start + k].tolist()
        return []


__all__ = ["NgramProposer"]
