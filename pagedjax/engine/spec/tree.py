"""Draft trees in the verification step: tree mask, depth positions, the walk, compaction.

A speculating row whose drafts form a tree holds, as a chain does, its last real token
(the root, query index 0, slot position ``base`` = total - 1) and then its nodes i = 0 ..
nd - 1 at consecutive slots ``base + 1 + i`` (query index 1 + i), parents first:
``parents[r, i]`` is -1 (the root) or a node index < i. A chain is the tree with
parents[i] = i - 1. This module gives the verification (``verify.py``) what changes:

- **tree_mask** (``ModelInput.tree_mask``, the attention backends' rule,
  ``pallas_kernels.reference.tree_visible``): node i sees the prefix and the root (every
  bit d >= i + 1) and, of the nodes, itself and its ancestors a (bit i - a). Every other
  token (prefill chunks, plain decode rows, the root) has all bits: the causal rule.
- **positions** (RoPE / learned positions, and M-RoPE's rope_positions alike): base +
  depth(i), depth of a root child 1; the slot mapping keeps the slot index (computed
  before, from the slot positions).
- **the walk** (greedy sample-and-compare, per level): from the root, the child whose
  token equals the target's token at its parent is accepted, until no child matches;
  a = the path's length, and the target's token at the path's last node is the bonus /
  correction. The target's token at a node of depth d is drawn with output position
  output_len + d, the key a plain run uses there, so seeded sampling stays equal to no
  speculation (the drafts are point masses: sample-and-compare is the rejection rule).
- **the repack**: the packed sampler rows of each row are permuted so that row position
  d holds the target's output at the path's depth-d node (d = 0: the root), which is the
  chain layout the host's output processor reads (``sampled_offsets``).
- **compaction**: the accepted path's KV moves from slot base + 1 + path[d] to
  base + 1 + d (d < a; nothing for a node already in place, so a chain copies nothing),
  in every layer of every stacked pool leaf ([L, N, H, B, D]); the rest is rolled back
  by ``update`` through the memory layer as rejected chain drafts are.

Shapes: S rows (batch-row order), K = the static node width (the tree budget). All
functions are pure jnp, traced inside the verification program; cost O(S * K^2) plus,
for compaction, a gather and a scatter of S * K slots per layer (a few KiB per layer).
Refusals: nodes past 31 (the mask's reach) are refused at configuration time
(``DraftTreeConfig``); sliding-window models are refused by ``check_tree_model`` (their
window would be measured in slots, not depths).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pagedjax.attention import PAD_SLOT


def check_tree_model(arch: Any) -> None:
    """ValueError for a model draft trees cannot verify: a sliding window (the attention
    measures the window in slots, and a tree's slots are not its positions)."""
    if getattr(arch, "sliding_window", None) is not None:
        raise ValueError(
            "speculative_config.tree: draft trees are not built for sliding-window models"
            f" (window {arch.sliding_window}: the window would be measured in slots, not"
            " tree depths); use chain drafts (no tree key)"
        )


def node_depths(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(depth int32[S, K], ancestors uint32[S, K]) of nodes with parents int32[S, K]
    (-1 = root; parents first). depth: 1 for a root child; ancestors: bit a set for each
    node ancestor a and the node itself."""
    s, k = parents.shape
    safe = jnp.maximum(parents, 0)
    own = jnp.left_shift(jnp.uint32(1), jnp.arange(k, dtype=jnp.uint32))[None, :]

    def body(_: Any, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        depth, anc = carry
        pd = jnp.take_along_axis(depth, safe, axis=1)
        pa = jnp.take_along_axis(anc, safe, axis=1)
        root = parents < 0
        return jnp.where(root, 1, pd + 1), jnp.where(root, own, own | pa)

    init = (jnp.ones((s, k), jnp.int32), jnp.broadcast_to(own, (s, k)))
    return lax.fori_loop(0, k, body, init)  # K rounds: the deepest chain settles


def node_words(ancestors: jax.Array) -> jax.Array:
    """uint32[S, K] tree-mask words: node i sees bits >= i + 1 (root and prefix) and bit
    i - a for each ancestor a (and itself, bit 0)."""
    k = ancestors.shape[1]
    i = jnp.arange(k, dtype=jnp.uint32)
    a = jnp.arange(k, dtype=jnp.uint32)
    bit = (ancestors[:, :, None] >> a[None, None, :]) & 1  # [S, K(i), K(a)]
    low = a[None, :] <= i[:, None]
    shifted = jnp.where(low[None], bit << (i[:, None] - jnp.minimum(a[None, :], i[:, None]))[None],
                        0)  # fmt: skip
    rev = jnp.bitwise_or.reduce(shifted.astype(jnp.uint32), axis=2)
    high = ~((jnp.left_shift(jnp.uint32(1), i + 1)) - 1)  # bits >= i + 1
    return rev | high[None, :]


def tree_inputs(inp: Any, parents: jax.Array, nd: jax.Array,
                num_seqs: int) -> tuple[Any, jax.Array]:  # fmt: skip
    """``inp`` with the tree's positions and tree_mask set; also depth int32[S, K].
    parents int32[S, K], nd int32[S] nodes per batch row (0: not speculating)."""
    k = parents.shape[1]
    depth, anc = node_depths(parents)
    words = node_words(anc)
    cu = inp.cu_q_lens
    t = jnp.arange(inp.tokens.shape[0], dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), num_seqs - 1)
    last = cu[1:] - 1  # each row's last query token
    node = t - (last[row] - nd[row]) - 1  # node index of the token, if it is one
    is_node = (t < cu[-1]) & (node >= 0) & (node < nd[row])
    safe = jnp.clip(node, 0, k - 1)
    d = depth[row, safe]
    shift = jnp.where(is_node, d - 1 - node, 0)  # depth position - slot position
    mask = jnp.where(is_node, words[row, safe], jnp.uint32(0xFFFFFFFF))
    rope = inp.rope_positions  # M-RoPE: every row of it moves with the token's depth
    rope = None if rope is None else rope + shift
    return inp._replace(positions=inp.positions + shift, rope_positions=rope,
                        tree_mask=mask), depth


def walk(target: jax.Array, offset: jax.Array, node_tokens: jax.Array, parents: jax.Array,
         nd: jax.Array) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Greedy acceptance per level. target int32[size]: the target's token at each packed
    sampler row (row r's query index j at offset[r] + j); node_tokens int32[S, K].
    Returns (accepted int32[S], path int32[S, K]: the accepted nodes by depth, -1 past)."""
    s, k = parents.shape
    size = target.shape[0]
    live = jnp.arange(k)[None, :] < nd[:, None]

    def body(d: jax.Array, carry: tuple) -> tuple:
        cur, acc, alive, path = carry
        tok = target[jnp.minimum(offset + cur, size - 1)]
        cand = live & (parents == (cur - 1)[:, None]) & (node_tokens == tok[:, None])
        has = alive & jnp.any(cand, axis=1)
        child = jnp.argmax(cand, axis=1).astype(jnp.int32)  # the first matching child
        path = path.at[:, d].set(jnp.where(has, child, -1))
        return jnp.where(has, child + 1, cur), acc + has, alive & has, path

    init = (jnp.zeros(s, jnp.int32), jnp.zeros(s, jnp.int32), nd > 0,
            jnp.full((s, k), -1, jnp.int32))  # fmt: skip
    _, acc, _, path = lax.fori_loop(0, k, body, init)
    return acc, path


def repack(out: Any, path: jax.Array, accepted: jax.Array, offset: jax.Array, frow: jax.Array,
           j: jax.Array, fvalid: jax.Array) -> Any:  # fmt: skip
    """The sampler output with each row's positions d <= accepted taken from the path's
    depth-d node (d = 0: the root), the chain layout; other rows unchanged."""
    size = out.token_ids.shape[0]
    f = jnp.arange(size, dtype=jnp.int32)
    node = path[frow, jnp.clip(j - 1, 0, path.shape[1] - 1)]
    src_j = jnp.where(j == 0, 0, node + 1)
    take = fvalid & (j <= accepted[frow])
    src = jnp.where(take, offset[frow] + src_j, f)
    return jax.tree.map(lambda x: x[src], out)


def compact(kv: Any, tables: jax.Array, seq_ids: jax.Array, base: jax.Array, path: jax.Array,
            accepted: jax.Array, block_size: int) -> Any:  # fmt: skip
    """kv' with each row's accepted node KV moved from slot position base + 1 + path[d]
    to base + 1 + d (d < accepted, path[d] != d), in every [L, N, H, B, D] leaf.
    tables int32[max_seqs, M]; seq_ids / base int32[S] (padding rows: seq_id -1)."""
    s, k = path.shape
    d = jnp.arange(k, dtype=jnp.int32)[None, :]
    move = (d < accepted[:, None]) & (path != d) & (seq_ids[:, None] >= 0)
    seq = jnp.maximum(seq_ids, 0)[:, None]

    def slot(pos: jax.Array) -> jax.Array:
        pos = jnp.clip(pos, 0, tables.shape[1] * block_size - 1)
        return tables[seq, pos // block_size] * block_size + pos % block_size

    src = jnp.where(move, slot(base[:, None] + 1 + jnp.maximum(path, 0)), PAD_SLOT).reshape(-1)
    dst = jnp.where(move, slot(base[:, None] + 1 + d), PAD_SLOT).reshape(-1)

    def copy(leaf: jax.Array) -> jax.Array:
        if not hasattr(leaf, "ndim") or leaf.ndim != 5 or leaf.shape[3] != block_size:
            return leaf
        n = leaf.shape[1]
        sb, so = jnp.minimum(src // block_size, n - 1), src % block_size
        rows = leaf[:, sb, :, so]  # [P, L, H, D], read before any write
        db = jnp.where(dst == PAD_SLOT, n, dst // block_size)
        return leaf.at[:, db, :, dst % block_size].set(rows, mode="drop")

    # Unconditional (padding entries drop): a lax.cond around the donated pool may make
    # XLA copy the whole pool into the branch, where the scatter of S * K rows is in place.
    return jax.tree.map(copy, kv)


def write_path(tokens: jax.Array, out_tokens: jax.Array, seq_ids: jax.Array, emit: jax.Array,
               total: jax.Array, offset: jax.Array, accepted: jax.Array,
               k: int) -> jax.Array:  # fmt: skip
    """tokens' with each emitting row's accepted path tokens (the repacked target tokens
    at positions d < accepted <= k, which equal the path's drafts) at total + d."""
    s = seq_ids.shape[0]
    d = jnp.arange(k, dtype=jnp.int32)[None, :]
    ok = emit[:, None] & (d < accepted[:, None])
    vals = out_tokens[jnp.minimum(offset[:, None] + d, out_tokens.shape[0] - 1)]
    row = jnp.where(ok, jnp.broadcast_to(seq_ids[:, None], (s, k)), tokens.shape[0])
    return tokens.at[row, total[:, None] + d].set(vals, mode="drop")


__all__ = ["check_tree_model", "compact", "node_depths", "node_words", "repack", "tree_inputs",
           "walk", "write_path"]  # fmt: skip
