"""Padding buckets: the static sizes one engine step is compiled for.

A step with ``t`` scheduled tokens over ``s`` sequences runs padded to ``(T, S)`` =
(``token_bucket(t)``, ``seq_bucket(s)``). Both lists are powers of two capped by the
engine's limits (the cap itself is the last bucket), so the jitted step compiles at most
``len(token_buckets) * len(seq_buckets)`` times, and usually far fewer: S <= T always.
"""

from __future__ import annotations

import bisect


def pow2_buckets(cap: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``cap``, then ``cap``: e.g. (8, 16, 32, 48)."""
    if cap < 1 or smallest < 1:
        raise ValueError(f"cap and smallest must be >= 1, got {cap}, {smallest}")
    out = []
    b = smallest
    while b < cap:
        out.append(b)
        b *= 2
    out.append(cap)
    return tuple(out)


def pick(buckets: tuple[int, ...], n: int) -> int:
    """Smallest bucket >= n; ValueError if n exceeds the largest (a scheduler bug)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
