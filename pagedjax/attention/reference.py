"""Ragged paged attention in plain XLA: the oracle for the Pallas kernels and the CPU path.

Work decomposition. Tokens of the flattened batch are grouped into work items: a tile of
``qb = ceil(T / S)`` consecutive queries of one sequence. Each item gathers its sequence's
pages once and attends its tile against them. A sequence of q_len tokens makes
ceil(q_len / qb) items, so there are at most S + ceil(T / qb) <= 2S items, and the total work is
at most 2 * T * (max_blocks * block_size) query-key pairs, whatever the mix of prefill and
decode. Items run as a ``lax.scan`` over vmapped batches (sized to bound memory); valid
items come first, so a batch holding none is skipped with ``lax.cond`` and the bound's slack
(up to half the items, e.g. in an all-decode or a single-prefill batch) costs little.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.reference import check_paged_inputs

# Upper bound on the bytes of scores + gathered pages held by one vmapped batch of items.
_ITEM_BATCH_BYTES = 1 << 26


def _check_shapes(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens) -> None:
    """The kernels' input contract (pallas_kernels.reference), plus S >= 1 and a cu_q_lens."""
    if cu_q_lens is None:
        raise ValueError("cu_q_lens is required (int32[S + 1])")
    check_paged_inputs(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens)
    if block_tables.shape[0] < 1:
        raise ValueError(f"block_tables must be int32[S>=1, max_blocks], got {block_tables.shape}")


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of a ragged batch of queries over a paged KV pool.

    Args:
      q: [T, num_q_heads, head_dim]; tokens of sequence s are q[cu_q_lens[s]:cu_q_lens[s+1]].
      k_pages, v_pages: [num_blocks, num_kv_heads, block_size, head_dim]; already hold this
        step's keys/values. num_q_heads must be a multiple of num_kv_heads (GQA/MQA).
      block_tables: int32[S, max_blocks_per_seq]; page ids of each sequence, in order.
      kv_lens: int32[S]; context length of each sequence INCLUDING this step's tokens.
      cu_q_lens: int32[S+1]; cumulative query lengths, cu_q_lens[0] = 0. Padding sequences
        have q_len 0 and kv_len 0; tokens at index >= cu_q_lens[S] are padding.
      sm_scale: score scale, usually head_dim ** -0.5.
      sliding_window: if set, a query at position p attends keys in (p - window, p].
      soft_cap: if set, scores become cap * tanh(scores / cap) (after sm_scale).

    Returns:
      [T, num_q_heads, head_dim] in q.dtype; padding tokens get exactly 0. Query i of
      sequence s sits at position kv_lens[s] - q_len_s + i. Scores and the value sum are in
      fp32; keys at or past kv_len (and unused pages, e.g. NaN-filled) never reach the output.
    """
    _check_shapes(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_pages.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    max_len = max_blocks * block_size
    qb = -(-num_tokens // num_seqs)
    num_items = num_seqs + -(-num_tokens // qb)

    block_tables = block_tables.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    n_chunks = (q_lens + qb - 1) // qb
    cu_chunks = jnp.cumsum(n_chunks)
    item = jnp.arange(num_items, dtype=jnp.int32)
    item_seq = jnp.searchsorted(cu_chunks, item, side="right").astype(jnp.int32)
    item_valid = item_seq < num_seqs
    item_seq = jnp.minimum(item_seq, num_seqs - 1)
    item_chunk = item - (cu_chunks[item_seq] - n_chunks[item_seq])
    item_start = cu_q_lens[item_seq] + item_chunk * qb

    kpos = jnp.arange(max_len, dtype=jnp.int32)
    highest = lax.Precision.HIGHEST

    def one_item(args):
        seq, start, valid = args
        rows = start + jnp.arange(qb, dtype=jnp.int32)
        row_valid = valid & (rows < cu_q_lens[seq + 1])
        qi = q[jnp.clip(rows, 0, num_tokens - 1)].astype(jnp.float32)  # [qb, Hq, D]
        qi = qi.reshape(qb, num_kv_heads, group, head_dim)
        kv_len = kv_lens[seq]
        qpos = kv_len - q_lens[seq] + (rows - cu_q_lens[seq])  # [qb]
        pages = block_tables[seq]
        key_valid = kpos < kv_len  # [L]

        # Pages stay in pool layout [M, Hkv, B, D]; key index = page * B + offset.
        k = k_pages[pages].astype(jnp.float32)
        # Zero values past kv_len: masked probabilities are 0, but 0 * NaN is NaN. Keys need
        # no zeroing: their scores are replaced by -inf below.
        v_valid = key_valid.reshape(max_blocks, 1, block_size, 1)
        v = jnp.where(v_valid, v_pages[pages].astype(jnp.float32), 0.0)
        s = jnp.einsum("qhgd,mhbd->hgqmb", qi, k, precision=highest) * sm_scale
        s = s.reshape(num_kv_heads, group, qb, max_len)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = key_valid[None, :] & (kpos[None, :] <= qpos[:, None]) & row_valid[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > qpos[:, None] - sliding_window
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(mask, jnp.exp(s - m), 0.0)
        denom = jnp.sum(p, axis=-1)  # [Hkv, G, qb]
        p = p.reshape(num_kv_heads, group, qb, max_blocks, block_size)
        o = jnp.einsum("hgqmb,mhbd->qhgd", p, v, precision=highest)
        denom = denom.transpose(2, 0, 1)[..., None]
        o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
        out_rows = jnp.where(row_valid, rows, num_tokens)  # num_tokens: dropped below
        return o.reshape(qb, num_q_heads, head_dim), out_rows

    per_item_bytes = 4 * (2 * num_q_heads * qb * max_len + 2 * num_kv_heads * max_len * head_dim)
    # At least ~8 batches, so that the all-invalid tail batches are actually skipped.
    batch = max(1, min(-(-num_items // 8), _ITEM_BATCH_BYTES // max(per_item_bytes, 1)))
    num_batches = -(-num_items // batch)
    pad = num_batches * batch - num_items
    xs = (
        jnp.pad(item_seq, (0, pad)).reshape(num_batches, batch),
        jnp.pad(item_start, (0, pad)).reshape(num_batches, batch),
        jnp.pad(item_valid, (0, pad)).reshape(num_batches, batch),
    )
    skipped = (
        jnp.zeros((batch, qb, num_q_heads, head_dim), jnp.float32),
        jnp.full((batch, qb), num_tokens, jnp.int32),
    )

    def one_batch(carry, x):
        return carry, lax.cond(x[2].any(), jax.vmap(one_item), lambda _: skipped, x)

    _, (o, out_rows) = lax.scan(one_batch, None, xs)
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), q.dtype)
    return out.at[out_rows.reshape(-1)].set(
        o.reshape(-1, num_q_heads, head_dim).astype(q.dtype), mode="drop"
    )
