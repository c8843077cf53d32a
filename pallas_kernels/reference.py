"""Dense-gather jnp reference for ragged paged attention (the kernels' test oracle).

Kept here, free of flax, so the kernel tests run in a torch/flax-free environment. It
gathers every sequence's pages into a dense [S, max_blocks * block_size] cache and runs
masked softmax attention in float32; the XLA reference in pagedjax/attention has the same
signature and is interchangeable with it.

Pool layout (the calling convention of every backend): ``k_pool, v_pool`` are stacked over
layers, ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``, and the caller
passes the layer index ``layer`` (an int32 scalar, traced inside the model's layer loop);
a kernel indexes the pool itself, because handing it ``pool[layer]`` would copy the layer's
pages every layer of every step. One layer's 4-D pages with ``layer=None`` are accepted too
(tests, single-layer callers). ``sliding_window`` may be a traced int32 scalar (per-layer
windows under the layer loop), where 0 means no window.
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
    layer: jax.Array | int | None = None,
) -> None:
    """Raises ValueError on inconsistent shapes or dtypes (shared by reference and kernels).

    The pool is [num_layers, num_blocks, num_kv_heads, block_size, head_dim] with a layer
    index, or one layer's [num_blocks, num_kv_heads, block_size, head_dim] with layer=None.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim not in (4, 5) or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pool and v_pool must both be [num_layers, num_blocks, num_kv_heads, block_size,"
            f" head_dim] (or one layer's 4-D pages), got {k_pages.shape} and {v_pages.shape}"
        )
    if (k_pages.ndim == 5) != (layer is not None):
        raise ValueError(
            f"a {k_pages.ndim}-D pool needs layer={'an index' if k_pages.ndim == 5 else 'None'}"
        )
    if layer is not None and jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar index, got shape {jnp.shape(layer)}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages/v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}")
    _, num_kv_heads, _, head_dim = k_pages.shape[-4:]
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


def stacked_pool(
    k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array | int | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(k [L, N, Hkv, B, D], v, layer int32 scalar): a 4-D pool gains a unit layer axis
    (a free reshape) and layer 0, so kernels handle one layout."""
    if k_pool.ndim == 4:
        return k_pool[None], v_pool[None], jnp.zeros((), jnp.int32)
    return k_pool, v_pool, jnp.asarray(layer, jnp.int32)


def window_visible(col: jax.Array, pos: jax.Array, sliding_window: jax.Array | int | None):
    """Mask of keys at ``col`` a query at ``pos`` sees under the window: (pos - w, pos].
    ``sliding_window`` None (static) or a traced int32 scalar <= 0 means no window."""
    if sliding_window is None:
        return jnp.ones(jnp.broadcast_shapes(col.shape, pos.shape), bool)
    if isinstance(sliding_window, int):
        return col > pos - sliding_window
    w = jnp.asarray(sliding_window, jnp.int32)
    return (w <= 0) | (col > pos - w)


TREE_BITS = 32  # a tree mask covers the 32 keys nearest a query (uint32 per row)


def tree_visible(col: jax.Array, pos: jax.Array, tree_mask: jax.Array | None):
    """Mask of keys at ``col`` a query at ``pos`` sees under a draft-tree mask.

    ``tree_mask`` uint32, broadcast against ``pos`` (one word per query row): bit d set
    means the query sees the key d positions back (d = pos - col, 0 = itself); keys
    ``TREE_BITS`` or more back are always visible (subject to the causal and window
    rules), keys ahead never. All bits set (0xFFFFFFFF) is the causal rule, so prefill and
    decode rows share a step with tree rows. A tree whose nodes sit in consecutive slots
    in topological order (parents first) sets, for node j, the bits j - a of its
    ancestors a (and 0, itself) and every bit above j (the prefix). None: causal.
    """
    if tree_mask is None:
        return jnp.ones(jnp.broadcast_shapes(col.shape, pos.shape), bool)
    d = pos - col
    shift = jnp.clip(d, 0, TREE_BITS - 1).astype(jnp.uint32)
    bit = jnp.right_shift(jnp.asarray(tree_mask, jnp.uint32), shift) & jnp.uint32(1)
    return (d >= TREE_BITS) | ((d >= 0) & (bit == 1))


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    tree_mask: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of ragged query tokens over paged KV.

    Shapes: q [T, Hq, D]; k_pages, v_pages [L, N, Hkv, B, D] with ``layer`` (or [N, Hkv,
    B, D] with layer=None); block_tables int32[S, M]; kv_lens int32[S] (including this
    step's tokens); cu_q_lens int32[S+1]; tree_mask uint32[T] or None (``tree_visible``).
    Returns [T, Hq, D] in q.dtype; tokens at index >= cu_q_lens[S] are 0. (A test oracle:
    it slices the layer out, a copy.)
    """
    check_paged_inputs(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, layer)
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
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
    visible &= window_visible(col, pos[:, None], sliding_window)
    if tree_mask is not None:
        visible &= tree_visible(col, pos[:, None], tree_mask[:, None])
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
    layer: jax.Array | int | None = None,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
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
        layer=layer,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    return jnp.zeros_like(out).at[order].set(out)[:num_seqs]
