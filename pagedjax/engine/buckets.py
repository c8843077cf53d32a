"""Padding buckets: the static sizes one engine step is compiled for.

A step with ``t`` scheduled tokens runs padded to ``T = pick(token_buckets, t)`` tokens,
and its per-sequence metadata (block tables, lengths, sampling rows) to
``S = seqs_for_tokens(seq_buckets, T) = min(T, max_num_seqs)`` rows: the sequence count is
not a bucket dimension of its own, because a step's sequences never outnumber its tokens
(each scheduled sequence has at least one). So the jitted step compiles once per token
bucket: 14 programs for the default budget of 2,048 tokens, where a (T, S) grid compiled up
to 141 (issue 13). The price is padding rows of metadata and logits in prefill-heavy steps
(a 2,048-token step with two prompts samples 256 rows); their cost is a small share of a
step that computes 2,048 tokens through every layer. ``token_buckets`` are
``step_buckets``: powers of two up to 32, then also 1.5 x each power of two (48, 96, 192,
...), capped by the engine's budget (the cap itself is the last bucket).

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


def seq_buckets_for(token_buckets: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The sequence-row counts the step programs use: ``min(T, max_num_seqs)`` per T."""
    return tuple(sorted({min(t, max_num_seqs) for t in token_buckets}))


def seqs_for_tokens(seq_buckets: tuple[int, ...], num_tokens_bucket: int) -> int:
    """S of the program for token bucket T: the largest sequence bucket <= T (every step
    with T tokens has at most T sequences, and at most the largest bucket)."""
    i = bisect.bisect_right(seq_buckets, num_tokens_bucket)
    if i == 0:
        raise ValueError(f"no sequence bucket <= {num_tokens_bucket} in {seq_buckets}")
    return seq_buckets[i - 1]


def pick(buckets: tuple[int, ...], n: int) -> int:
    """Smallest bucket >= n; ValueError if n exceeds the largest (a scheduler bug)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
