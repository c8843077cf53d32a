"""The n-gram (prompt lookup) proposer on device, for the fused K-step program.

The same rule as ``ngram.NgramProposer`` (host, numpy), over the engine's token buffer,
so the K-step decode loop can draft without returning to the host: for a row whose ids
``tokens[r, :L]`` end in the n-gram g (n from max_n down to min_n, n <= L - 1), the
drafts are the up to k tokens that followed the latest earlier occurrence of g (window
starts 0 .. L - 1 - n), cut at L; none when no n recurs. ``tests/test_ngram_device.py``
checks it equals the host proposer on random sequences.

Cost: per n tried, one [N, W - n + 1] comparison per n-gram position (W = the buffer's
width, max_model_len): O(N * W * max_n^2) compares, all n at once, no data-dependent
shapes, so it compiles once per (N, W).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def propose_ngram(
    tokens: jax.Array, lengths: jax.Array, want: jax.Array, *, min_n: int, max_n: int, k: int
) -> tuple[jax.Array, jax.Array]:
    """Drafts for each row (see the module docstring).

    tokens int32[N, W]: the ids (positions >= lengths[r] are ignored); lengths int32[N];
    want int32[N]: drafts asked for per row (<= k; 0: none). Returns (drafts int32[N, k],
    -1 past each row's count; counts int32[N] <= want).
    """
    n_rows, width = tokens.shape
    rows = jnp.arange(n_rows)
    found = jnp.zeros((n_rows,), bool)
    start = jnp.zeros((n_rows,), jnp.int32)
    for n in range(max_n, min_n - 1, -1):  # longest first: the first that recurs wins
        if n >= width:
            continue
        suffix_pos = lengths[:, None] - n + jnp.arange(n)[None, :]  # [N, n]
        suffix = tokens[rows[:, None], jnp.clip(suffix_pos, 0, width - 1)]
        span = width - n + 1  # window starts 0 .. width - n
        match = jnp.ones((n_rows, span), bool)
        for j in range(n):
            match = match & (tokens[:, j : j + span] == suffix[:, j : j + 1])
        p = jnp.arange(span)[None, :]
        match = match & (p <= (lengths - 1 - n)[:, None])  # windows inside ids[: L - 1]
        latest = jnp.max(jnp.where(match, p, -1), axis=1)
        ok = (latest >= 0) & (n <= lengths - 1) & ~found
        start = jnp.where(ok, latest + n, start)
        found = found | ok
    counts = jnp.where(found, jnp.clip(jnp.minimum(want, lengths - start), 0, k), 0)
    j = jnp.arange(k)[None, :]
    take = tokens[rows[:, None], jnp.clip(start[:, None] + j, 0, width - 1)]
    drafts = jnp.where(j < counts[:, None], take, -1).astype(jnp.int32)
    return drafts, counts.astype(jnp.int32)


__all__ = ["propose_ngram"]
