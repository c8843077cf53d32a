"""Padding buckets: the static sizes one engine step is compiled for.

A step with ``t`` scheduled tokens over ``s`` sequences runs padded to ``(T, S)`` =
(``token_bucket(t)``, ``seq_bucket(s)``). Both lists are ``step_buckets``: powers of two
up to 32, then also 1.5 x each power of two (48, 96, 192, ...), capped by the engine's
limits (the cap itself is the last bucket), so the jitted step compiles at most
``len(token_buckets) * len(seq_buckets)`` times, and usually far fewer: S <= T always.

Why the 1.5x steps: on a CPU a decode step's matmuls cost about in proportion to its
padded rows, so pure powers of two waste up to half of them (82 sequences ran 128 rows).
With 1.5x steps the padding is at most a third, for about twice as many buckets above 32,
each compiled once. Below 32 a step is bound by reading the weights, not by its rows.
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


FINE_FROM = 32  # buckets below this are powers of two only


def step_buckets(cap: int, smallest: int = 1) -> tuple[int, ...]:
    """``pow2_buckets`` plus 1.5 x each power of two from FINE_FROM on, all below ``cap``,
    then ``cap``: e.g. step_buckets(256) = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)."""
    out = set(pow2_buckets(cap, smallest))
    b = FINE_FROM
    while b * 3 // 2 < cap:
        if b * 3 // 2 >= smallest:
            out.add(b * 3 // 2)
        b *= 2
    return tuple(sorted(out))


def pick(buckets: tuple[int, ...], n: int) -> int:
    """Smallest bucket >= n; ValueError if n exceeds the largest (a scheduler bug)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
