"""Dense-gather jnp reference for ragged paged attention (the kernels' test oracle).

Kept here, free of flax, so the kernel tests run in a torch/flax-free environment. It
gathers every sequence's pages into a dense [S, max_blocks * block_size] cache and runs
masked softmax attention in float32; the XLA reference in pagedjax/attention has the same
signature and is interchangeable with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK = -1e30  # finite, so rows with no visible key give 0 rather than NaN


def check_paged_inputs(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array | None,
) -> None:
    """Raises ValueError on inconsistent shapes or dtypes (shared by reference and kernels)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [num_blocks, num_kv_heads, block_size, head_dim],"
            f" got {k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages/v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}")
    _, num_kv_heads, _, head_dim = k_pages.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != page head_dim {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(
            f"num_q_heads {q.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(
            f"block_tables must be int32[S, max_blocks], got {block_tables.dtype}"
            f"{list(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if kv_lens.shape != (num_seqs,) or kv_lens.dtype != jnp.int32:
        raise ValueError(f"kv_lens must be int32[{num_seqs}], got {kv_lens.dtype}{kv_lens.shape}")
    if cu_q_lens is not None and (
        cu_q_lens.shape != (num_seqs + 1,) or cu_q_lens.dtype != jnp.int32
    ):
        raise ValueError(
            f"cu_q_lens must be int32[{num_seqs + 1}], got {cu_q_lens.dtype}{cu_q_lens.shape}"
        )


def ragged_paged_attention_reference(
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
    """Causal attention of ragged query tokens over paged KV.

    Shapes: q [T, Hq, D]; k_pages, v_pages [N, Hkv, B, D]; block_tables int32[S, M];
    kv_lens int32[S] (including this step's tokens); cu_q_lens int32[S+1]. Returns
    [T, Hq, D] in q.dtype; tokens at index >= cu_q_lens[S] are 0.
    """
    check_paged_inputs(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_pages.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    ctx = max_blocks * block_size

    tok = jnp.arange(num_tokens)
    # Sequence of each token (padding tokens land on S and are zeroed at the end).
    seq = jnp.searchsorted(cu_q_lens, tok, side="right") - 1
    valid_tok = tok < cu_q_lens[num_seqs]
    seq_c = jnp.clip(seq, 0, num_seqs - 1)
    q_len = cu_q_lens[seq_c + 1] - cu_q_lens[seq_c]
    pos = kv_lens[seq_c] - q_len + (tok - cu_q_lens[seq_c])  # [T]

    # Dense gather per token's sequence: [T, Hkv, ctx, D]. Memory-hungry, fine for tests.
    def gather(pages: jax.Array) -> jax.Array:
        g = pages[block_tables]  # [S, M, Hkv, B, D]
        g = g.transpose(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, ctx, head_dim)
        return g[seq_c].astype(jnp.float32)

    k = gather(k_pages)
    v = gather(v_pages)
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    s = jnp.einsum("thgd,thcd->thgc", qf, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    col = jnp.arange(ctx)[None, :]
    visible = (col <= pos[:, None]) & (col < kv_lens[seq_c][:, None]) & valid_tok[:, None]
    if sliding_window is not None:
        visible &= col > pos[:, None] - sliding_window
    visible = visible[:, None, None, :]
    s = jnp.where(visible, s, _MASK)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True))
    p = jnp.where(visible, p, 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    # where() on v too: 0 * NaN would otherwise leak poisoned slots into the sum.
    pv = jnp.einsum("thgc,thcd->thgd", p, jnp.where(visible[:, :, 0, :, None], v, 0.0))
    out = jnp.where(denom > 0, pv / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Decode (one query token per sequence): q [S, Hq, D] -> [S, Hq, D].

    Sequences with kv_len 0 (padding) output 0.
    """
    num_seqs = q.shape[0]
    # Padding sequences (kv_len 0) get q_len 0, so their row is a padding token.
    q_lens = (kv_lens > 0).astype(jnp.int32)
    # Pack live rows first (the ragged layout), then scatter back to sequence order.
    order = jnp.argsort(1 - q_lens, stable=True)
    cu_q_lens = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens[order], dtype=jnp.int32)]
    )
    out = ragged_paged_attention_reference(
        q[order],
        k_pages,
        v_pages,
        block_tables[order],
        kv_lens[order],
        cu_q_lens,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    return jnp.zeros_like(out).at[order].set(out)[:num_seqs]
