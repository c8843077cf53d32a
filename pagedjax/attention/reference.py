"""Ragged paged attention in plain XLA: the oracle for the Pallas and native CPU kernels.

The engine runs it where neither kernel applies (a GPU before the Pallas kernels' parity
run, non-fp32 inputs on a CPU, a CPU without a C++ compiler).

Work decomposition. Tokens of the flattened batch are grouped into work items: a tile of
``qb = ceil(T / S)`` consecutive queries of one sequence, so there are at most
S + ceil(T / qb) <= 2S items whatever the mix of prefill and decode. An item needs only the
pages up to its last query's position (causal), so items are sorted by that page count,
longest first, and run in batches of ``B`` (vmapped): each batch walks its pages in chunks of
``C`` pages with an online softmax (flash-attention style) and stops after its longest
item's last chunk (a ``while_loop`` with a data-dependent trip count); batches past the last
valid item do not run. The pages gathered per layer are then about the sum of the items'
own page counts instead of items x max_blocks, and each chunk's gathered K/V stays small
enough to sit in cache: on a 2-core CPU a 256-sequence decode with 160-500-token contexts
in a 512-token table runs 3.5-7.6x faster than gathering every item's whole table at once
(docs/attention.md). Off CPU the default is one wide pass (all items, whole table). A chunk
past an item's own length is fully masked and leaves its running max, sum and output
exactly unchanged, so an item's result does not depend on the batch it shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pagedjax.attention.kv_quant import (
    KVFormat,
    QuantizedPages,
    gather_dequantized,
    split_pages,
)
from pallas_kernels.reference import (
    check_paged_inputs,
    stacked_pool,
    tree_visible,
    window_visible,
)

# Default tiling on CPU (measured on the 2-core box: a 256-sequence decode was fastest with
# 64-key chunks and ~2 MiB per batch chunk; 32-256 keys and 0.5-8 MiB were within ~30 %).
CPU_CHUNK_KEYS = 64  # keys per chunk an item attends at once (rounded to whole pages)
CPU_CHUNK_BYTES = 1 << 21  # bytes per chunk for a whole batch: gathered K + V, or fp32 scores
# Elsewhere (a GPU without the Pallas kernels) many tiny sequential loop iterations would
# cost more than they save: one batch of all items over the whole table, i.e. one wide
# vectorized pass (not timed on a GPU yet).
WIDE_CHUNK_BYTES = 1 << 40


def default_tiling() -> tuple[int | None, int]:
    """(chunk_keys, chunk_bytes) for the default backend; None keys = the whole table."""
    if jax.default_backend() == "cpu":
        return CPU_CHUNK_KEYS, CPU_CHUNK_BYTES
    return None, WIDE_CHUNK_BYTES


def check_shapes(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, layer=None) -> None:
    """The kernels' input contract (pallas_kernels.reference), plus S >= 1 and a cu_q_lens."""
    if cu_q_lens is None:
        raise ValueError("cu_q_lens is required (int32[S + 1])")
    check_paged_inputs(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, layer)
    if block_tables.shape[0] < 1:
        raise ValueError(f"block_tables must be int32[S>=1, max_blocks], got {block_tables.shape}")


def check_options(sliding_window: jax.Array | int | None, soft_cap: float | None) -> None:
    """Static option checks shared by the backends (a traced window is not checked: <= 0
    means no window there)."""
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")


def split_quantized(
    k_pages: jax.Array | QuantizedPages, v_pages: jax.Array | QuantizedPages, layer: object
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, KVFormat | None]:
    """(k values, v values, k scale, v scale, format) of plain or 8-bit pages (``kv_quant``);
    scales and format are None for a plain pool. An 8-bit pool must come stacked with a
    layer index."""
    if isinstance(k_pages, QuantizedPages) != isinstance(v_pages, QuantizedPages):
        raise ValueError("k_pages and v_pages must both be quantized or both plain")
    if isinstance(k_pages, QuantizedPages) and (layer is None or k_pages.ndim != 5):
        raise ValueError("an 8-bit pool is read stacked ([L, NB, Hkv, bs, D]) with a layer index")
    (k, ks, fmt), (v, vs, _) = split_pages(k_pages), split_pages(v_pages)
    return k, v, ks, vs, fmt


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array | QuantizedPages,
    v_pages: jax.Array | QuantizedPages,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    tree_mask: jax.Array | None = None,
    chunk_keys: int | None = None,
    chunk_bytes: int | None = None,
) -> jax.Array:
    """Causal attention of a ragged batch of queries over a paged KV pool.

    Args:
      q: [T, num_q_heads, head_dim]; tokens of sequence s are q[cu_q_lens[s]:cu_q_lens[s+1]].
      k_pages, v_pages: the stacked pool [num_layers, num_blocks, num_kv_heads, block_size,
        head_dim] (or one layer's 4-D pages with layer=None); already hold this step's
        keys/values. num_q_heads must be a multiple of num_kv_heads (GQA/MQA). Either may
        be an 8-bit ``QuantizedPages`` pair (stacked only): pages are dequantized to fp32
        as they are gathered (values x their int8 token-head or fp8 layer-head scale).
      layer: int32 scalar (may be traced), the layer whose pages to read; pages are
        gathered from the stacked pool directly, never sliced out whole.
      block_tables: int32[S, max_blocks_per_seq]; page ids of each sequence, in order.
      kv_lens: int32[S]; context length of each sequence INCLUDING this step's tokens.
      cu_q_lens: int32[S+1]; cumulative query lengths, cu_q_lens[0] = 0. Padding sequences
        have q_len 0 and kv_len 0; tokens at index >= cu_q_lens[S] are padding.
      sm_scale: score scale, usually head_dim ** -0.5.
      sliding_window: if set, a query at position p attends keys in (p - window, p]; a
        traced int32 scalar (per-layer windows) means no window when <= 0.
      soft_cap: if set, scores become cap * tanh(scores / cap) (after sm_scale).
      tree_mask: uint32[T] or None: draft-tree verification rows
        (``pallas_kernels.reference.tree_visible``): bit d of a row's word lets it see
        the key d positions back, keys 32 or more back always; None (or all bits set)
        is the causal rule.
      chunk_keys, chunk_bytes: tiling (module docstring): keys per chunk (rounded down to
        whole pages, at least one) and the bytes one batch may gather or score per chunk
        (sets the batch size B, at least one item); default ``default_tiling()``. Results
        do not depend on them beyond fp32 rounding.

    Returns:
      [T, num_q_heads, head_dim] in q.dtype; padding tokens get exactly 0. Query i of
      sequence s sits at position kv_lens[s] - q_len_s + i. Scores and the value sum are in
      fp32; keys at or past kv_len (and unused pages, e.g. NaN-filled) never reach the output.
    """
    k_pages, v_pages, k_scale, v_scale, fmt = split_quantized(k_pages, v_pages, layer)
    check_shapes(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, layer)
    check_options(sliding_window, soft_cap)
    k_pages, v_pages, layer = stacked_pool(k_pages, v_pages, layer)
    for name, value in (("chunk_keys", chunk_keys), ("chunk_bytes", chunk_bytes)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {value}")
    if tree_mask is not None and tree_mask.shape != (q.shape[0],):
        raise ValueError(f"tree_mask must be uint32[T={q.shape[0]}], got {tree_mask.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, block_size, _ = k_pages.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    qb = -(-num_tokens // num_seqs)
    num_items = num_seqs + -(-num_tokens // qb)

    # Static tiling: C pages per chunk, B items per batch (both >= 1).
    default_keys, default_bytes = default_tiling()
    chunk_keys = default_keys if chunk_keys is None else chunk_keys
    chunk_bytes = default_bytes if chunk_bytes is None else chunk_bytes
    chunk_keys = max_blocks * block_size if chunk_keys is None else chunk_keys  # whole table
    chunk = max(1, min(max_blocks, chunk_keys // block_size))
    chunk_keys = chunk * block_size
    page_bytes = 2 * num_kv_heads * block_size * head_dim * 4  # K + V, fp32
    item_bytes = max(chunk * page_bytes, 4 * num_q_heads * qb * chunk_keys)
    batch = max(1, min(num_items, chunk_bytes // item_bytes))
    num_batches = -(-num_items // batch)
    num_chunks_max = -(-max_blocks // chunk)
    # Columns padded to whole chunks with the null block (its keys are masked).
    block_tables = block_tables.astype(jnp.int32)
    block_tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks_max * chunk - max_blocks)))
    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)

    # Items: (sequence, first row); their key extent (last query position + 1) in pages.
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    n_tiles = (q_lens + qb - 1) // qb
    cu_tiles = jnp.cumsum(n_tiles)
    item = jnp.arange(num_batches * batch, dtype=jnp.int32)
    item_seq = jnp.searchsorted(cu_tiles, item, side="right").astype(jnp.int32)
    item_valid = item_seq < num_seqs
    item_seq = jnp.minimum(item_seq, num_seqs - 1)
    item_tile = item - (cu_tiles[item_seq] - n_tiles[item_seq])
    item_start = cu_q_lens[item_seq] + item_tile * qb
    item_end = jnp.minimum(item_start + qb, cu_q_lens[item_seq + 1])
    key_end = kv_lens[item_seq] - cu_q_lens[item_seq + 1] + item_end  # last qpos + 1
    item_chunks = jnp.where(item_valid, (key_end + chunk_keys - 1) // chunk_keys, 0)
    # Longest first: a batch's trip count is its first item's; invalid items sort last.
    order = jnp.argsort(-item_chunks, stable=True)
    b_seq, b_start, b_valid, b_chunks = (
        x[order].reshape(num_batches, batch)
        for x in (item_seq, item_start, item_valid, item_chunks)
    )
    num_live = -(-jnp.sum(item_valid.astype(jnp.int32)) // batch)

    highest = lax.Precision.HIGHEST
    offsets = jnp.arange(chunk_keys, dtype=jnp.int32)

    def run_batch(j, out):
        seq, start, valid = b_seq[j], b_start[j], b_valid[j]  # [B]
        rows = start[:, None] + jnp.arange(qb, dtype=jnp.int32)  # [B, qb]
        row_valid = valid[:, None] & (rows < cu_q_lens[seq + 1][:, None])
        qi = q[jnp.clip(rows, 0, num_tokens - 1)].astype(jnp.float32)  # [B, qb, Hq, D]
        qi = qi.reshape(batch, qb, num_kv_heads, group, head_dim)
        kv_len = kv_lens[seq]  # [B]
        qpos = kv_len[:, None] - q_lens[seq][:, None] + (rows - cu_q_lens[seq][:, None])
        if tree_mask is not None:
            row_bits = tree_mask[jnp.clip(rows, 0, num_tokens - 1)][:, :, None]  # [B, qb, 1]
        tables = block_tables[seq]  # [B, C * num_chunks_max]

        def one_chunk(c, carry):
            m, denom, acc = carry  # [B, Hkv, G, qb], same, [B, Hkv, G, qb, D]
            pages = lax.dynamic_slice_in_dim(tables, c * chunk, chunk, axis=1)  # [B, C]
            kpos = c * chunk_keys + offsets  # [C * bs]
            key_valid = kpos[None, :] < kv_len[:, None]  # [B, C * bs]
            k = gather_dequantized(k_pages, k_scale, layer, pages, fmt)  # [B, C, Hkv, bs, D] fp32
            # Zero values past kv_len: masked probabilities are 0, but 0 * NaN is NaN.
            v_ok = key_valid.reshape(batch, chunk, 1, block_size, 1)
            v = jnp.where(v_ok, gather_dequantized(v_pages, v_scale, layer, pages, fmt), 0.0)
            s = jnp.einsum("nqhgd,nmhbd->nhgqmb", qi, k, precision=highest) * sm_scale
            s = s.reshape(batch, num_kv_heads, group, qb, chunk_keys)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = key_valid[:, None, :] & (kpos[None, None, :] <= qpos[:, :, None])
            mask &= row_valid[:, :, None]
            mask &= window_visible(kpos[None, None, :], qpos[:, :, None], sliding_window)
            if tree_mask is not None:
                mask &= tree_visible(kpos[None, None, :], qpos[:, :, None], row_bits)
            mask = mask[:, None, None]  # [B, 1, 1, qb, C * bs]
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
            alpha = jnp.exp(m - m_safe)  # 0 while m is -inf; 1 when the max is unchanged
            denom = denom * alpha + jnp.sum(p, axis=-1)
            p = p.reshape(batch, num_kv_heads, group, qb, chunk, block_size)
            pv = jnp.einsum("nhgqmb,nmhbd->nhgqd", p, v, precision=highest)
            return m_new, denom, acc * alpha[..., None] + pv

        shape = (batch, num_kv_heads, group, qb)
        init = (
            jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32),
        )
        _, denom, acc = lax.fori_loop(0, b_chunks[j, 0], one_chunk, init)
        ok = denom > 0
        o = jnp.where(ok[..., None], acc / jnp.where(ok, denom, 1.0)[..., None], 0.0)
        o = o.transpose(0, 3, 1, 2, 4).reshape(batch * qb, num_q_heads, head_dim)
        out_rows = jnp.where(row_valid, rows, num_tokens).reshape(-1)  # num_tokens: dropped
        return out.at[out_rows].set(o.astype(out.dtype), mode="drop")

    out = jnp.zeros((num_tokens, num_q_heads, head_dim), q.dtype)
    return lax.fori_loop(0, num_live, run_batch, out)
