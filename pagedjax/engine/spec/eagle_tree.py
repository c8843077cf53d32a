"""EAGLE draft trees, first version: top-k branches at depth 1, each continued as a chain.

``{"method": "eagle", ..., "tree": {"budget": N, "top_k": b}}``: the head's b most
likely first tokens (argmax of lm(g_{L-2}) replaced by its top b) each start a branch,
continued greedily by the head for m - 1 more levels, m = min(num_speculative_tokens,
N // b): b * m nodes. This is not yet EAGLE-2's dynamic tree (expanding the best nodes
by cumulative draft probability at every level): the shape is fixed, the first level
is where the head is least sure and a second candidate pays most.

**Layout** (level-major, so each level's nodes sit in consecutive slots): node
j = l * b + c is branch c's node at level l (0-based; depth l + 1), parent j - b (or
the root for l = 0): ``parents(b, K)``. Truncating to the first n nodes (the scheduler,
max_tokens) keeps whole levels first: a valid tree.

**The head's own KV is a tree too** (the same tree_mask mechanism as the target's): the
head step that consumes node j (its token, and the g of its parent, g_{L-2} for level
0) writes its head KV at slot position L - 1 + j and runs at RoPE position L - 1 + l
(the chain's head position for that depth). A level's b queries per row are one ragged
row of q_len b ending at kv_len L - 1 + (l + 1) * b, so ``tree.node_words`` of the same
parents gives their masks: the committed head entries (slots <= L - 2) and the branch's
own earlier entries are visible, the other branches' are not. Those rows are scratch:
the verification's catch-up (``EagleVerifier``) rewrites the committed positions from
the target's exact features, remapped along the accepted path (``catch_up_inputs``).

**The dynamic tree** (``"tree": {..., "dynamic": true}``, EAGLE-2's "expand the top-k
by cumulative draft confidence", pagedjax's own key): the same layout and sizes (b nodes
per level, m levels), but each level is chosen by the head's confidence. Level 0: the
head's top b first tokens, with their log-probabilities (log-softmax of the draft
logits, over the draft vocabulary when the head has one) as cumulative scores. Level
l + 1: each of the b level-l nodes proposes its top b children (distinct tokens); of
those b * b candidates the b with the largest cumulative log-probability (parent's +
child's) are kept, best first, each with its level-l parent, whose head output g is the
new node's head input. Parents become data: the program also returns them, int32[S, K]
(level-major, so a parent is always at the level before, and < the node), and the
head's own tree mask follows them (ancestor bits carried per row, ``node_words``). The
depths are the static layout's, so the scheduler, the cut by whole levels and the
automatic rule read the host's static ``branch_parents``; the verification reads the
device's. With b = 1 both trees are the chain. Not built: EAGLE-2's final global rerank
of all expanded nodes into the budget (here the budget is b * m, by whole levels: the
rerank would make the layout ragged and the level cut invalid).

Cost: m - 1 head steps of b rows per sequence (a chain: k - 1 steps of one row) and the
verification of b * m nodes; the dynamic tree adds a log-softmax and a top-b over b rows
of the draft vocabulary per level (the static tree's argmax reads the same logits).
Sampled drafts (``draft_sample_method="probabilistic"``) with trees are refused at
configuration time.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.model_runner import apply_cow
from pagedjax.engine.spec.eagle import EagleDraft
from pagedjax.engine.spec.tree import node_words
from pagedjax.memory.block_table import slot_mapping
from pagedjax.model import ModelInput


def branch_parents(branches: int, width: int) -> np.ndarray:
    """int32[width]: node j's parent in the level-major layout (-1 = root)."""
    j = np.arange(width)
    return np.where(j < branches, -1, j - branches).astype(np.int32)


class EagleTreeDraft:
    """The tree proposal program for an ``EagleDraft`` (its params, pool and features).

    propose(params, target_params, draft_kv, feature, tokens, mem, seq_ids, total, counts,
    *, num_seqs) -> (draft_kv', tokens'): writes node j of row r at total + j, j <
    counts[r] (batch-row order), the ``branch_parents`` layout; one program per S.
    dynamic=True (EAGLE-2's tree, module docstring): -> (draft_kv', tokens', parents
    int32[num_seqs, K]): node j's parent (-1: the root; -1 for nodes j >= counts[r] and
    rows without drafts), level-major as ``branch_parents`` (same depths).
    scatter(packed int32[P, K], index int32[P], *, rows) -> int32[rows, K]: packed row p
    at row index[p] (index >= rows: dropped), the others -1 (the decoder's packed
    proposal rows back to batch-row order)."""

    def __init__(self, draft: EagleDraft, branches: int, width: int, dynamic: bool = False):
        if width % branches:
            raise ValueError(f"tree width {width} is not whole levels of {branches} branches")
        self.draft, self.b, self.k, self.dynamic = draft, branches, width, dynamic
        self.levels = width // branches
        self.trace_count: dict[int, int] = {}
        self.propose = jax.jit(self._propose, static_argnames=("num_seqs",),
                               donate_argnames=("draft_kv", "tokens"))  # fmt: skip
        self.scatter = jax.jit(_scatter_rows, static_argnames=("rows",))

    def _propose(self, params: Any, target_params: Any, draft_kv: Any, feature: jax.Array,
                 tokens: jax.Array, mem: Any, seq_ids: jax.Array, total: jax.Array,
                 counts: jax.Array, *, num_seqs: int) -> tuple:  # fmt: skip
        self.trace_count[num_seqs] = self.trace_count.get(num_seqs, 0) + 1
        e, b, e_block = self.draft, self.b, self.draft.block_size
        tables = mem.tables.tables
        draft_kv = apply_cow(draft_kv, mem.last_cow.src, mem.last_cow.dst, mem.last_cow.valid)
        sid = seq_ids[:num_seqs]
        row_ok = sid >= 0
        safe = jnp.maximum(sid, 0)
        tot, cnt = total[:num_seqs], counts[:num_seqs]
        n = tokens.shape[0]
        logits, vocab = e.draft_logits(params, target_params, feature[safe])
        # [S, b] distinct first tokens (the static tree ranks the logits themselves)
        score, top = jax.lax.top_k(_log_probs(logits) if self.dynamic else logits, b)
        score = score.astype(jnp.float32)
        d = (top if vocab is None else vocab[top]).astype(jnp.int32)
        c = jnp.arange(b, dtype=jnp.int32)[None, :]
        live = row_ok[:, None] & (c < cnt[:, None])
        tokens = tokens.at[jnp.where(live, safe[:, None], n), tot[:, None] + c].set(d, mode="drop")
        g = jnp.broadcast_to(feature[safe][:, None, :], (num_seqs, b, feature.shape[1]))
        # Ancestors per row (bit a: node a, the node's own bit included): the head's tree
        # mask is node_words of them; a node not yet placed has its own bit only.
        own = jnp.left_shift(jnp.uint32(1), jnp.arange(self.k, dtype=jnp.uint32))
        anc = jnp.broadcast_to(own[None, :], (num_seqs, self.k))
        parents = jnp.full((num_seqs, self.k), -1, jnp.int32)
        block_tables = jnp.where(row_ok[:, None], tables[safe], 0)
        rows_t = num_seqs * b
        rows = jnp.arange(num_seqs)[:, None]

        def body(level: jax.Array, carry: tuple) -> tuple:
            draft_kv, tokens, g, d, score, anc, parents = carry
            active = row_ok & ((level + 1) * b < cnt)  # some child of this level is wanted
            q = jnp.where(active, b, 0)
            cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q, dtype=jnp.int32)])
            t = jnp.arange(rows_t, dtype=jnp.int32)
            r = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), num_seqs - 1)
            valid = t < cu[-1]
            br = jnp.clip(t - cu[r], 0, b - 1)
            node = level * b + br
            words = node_words(anc)  # uint32[S, K]
            slots = slot_mapping(tables, safe[r], tot[r] - 1 + node, valid, e_block)
            inp = ModelInput(
                tokens=jnp.where(valid, d[r, br], 0),
                positions=jnp.where(valid, tot[r] - 1 + level, 0),
                slot_mapping=slots, block_tables=block_tables,
                kv_lens=jnp.where(active, tot - 1 + (level + 1) * b, 0), cu_q_lens=cu,
                logits_indices=jnp.zeros((num_seqs,), jnp.int32),
                tree_mask=jnp.where(valid, words[r, node], jnp.uint32(0xFFFFFFFF)),
            )  # fmt: skip
            feats = jnp.where(valid[:, None], g[r, br], 0)
            draft_kv, out = e.head_step(params, draft_kv, feats, inp.tokens, inp, target_params)
            back = jnp.minimum(cu[:-1, None] + c, rows_t - 1)  # [S, b] row r's branch c
            g_new = out[back].astype(g.dtype)  # the level-l nodes' head outputs
            flat = g_new.reshape(-1, g.shape[-1])
            if self.dynamic:  # top b of the b * b children by cumulative log-probability
                lg, _ = e.draft_logits(params, target_params, flat)
                new_score, pb, ids = expand_level(score, lg.reshape(num_seqs, b, -1))
                nd = (ids if vocab is None else vocab[ids]).astype(jnp.int32)
                g_next = jnp.take_along_axis(g_new, pb[:, :, None], axis=1)
            else:  # each branch's argmax child
                nd, _ = e.draft_ids(params, target_params, flat)
                nd, new_score, g_next = nd.reshape(num_seqs, b), score, g_new
                pb = jnp.broadcast_to(c, (num_seqs, b))
            child = (level + 1) * b + c
            ok = active[:, None] & (child < cnt[:, None])
            tokens = tokens.at[jnp.where(ok, safe[:, None], n), tot[:, None] + child].set(
                nd, mode="drop")
            par = level * b + pb  # [S, b] the parents' node indices
            col = jnp.where(ok, child, self.k)  # out of range: dropped
            parents = parents.at[rows, col].set(par, mode="drop")
            anc = anc.at[rows, col].set(own[jnp.minimum(child, self.k - 1)]
                                        | jnp.take_along_axis(anc, par, axis=1),
                                        mode="drop")  # fmt: skip
            keep = active[:, None]
            return (draft_kv, tokens, jnp.where(keep[..., None], g_next, g),
                    jnp.where(keep, nd, d), jnp.where(keep, new_score, score), anc,
                    parents)  # fmt: skip

        init = (draft_kv, tokens, g, d, score, anc, parents)
        draft_kv, tokens, *_, parents = jax.lax.fori_loop(0, self.levels - 1, body, init)
        if not self.dynamic:
            return draft_kv, tokens
        return draft_kv, tokens, parents


def expand_level(score: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One level of EAGLE-2's expansion. score float32[S, b]: the level's nodes'
    cumulative log-probabilities; logits [S, b, N]: each node's draft logits for its
    children. Each node's top b children (log-softmax, distinct ids) are the b * b
    candidates, scored parent + child; the b best, best first, are returned as
    (score float32[S, b], parent branch int32[S, b] in [0, b), child id int32[S, b]:
    positions in the N logits). Cost: a log-softmax over S b N and two top-b."""
    s, b, _ = logits.shape
    lp, ids = jax.lax.top_k(_log_probs(logits), b)  # [S, b, b] each node's top b
    cand = (score[:, :, None] + lp).reshape(s, b * b)
    new_score, pick = jax.lax.top_k(cand, b)
    child = jnp.take_along_axis(ids.reshape(s, b * b), pick, axis=1)
    return new_score, (pick // b).astype(jnp.int32), child.astype(jnp.int32)


def _log_probs(logits: jax.Array) -> jax.Array:
    """float32 log-softmax over the last axis (the draft's log-probabilities)."""
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _scatter_rows(packed: jax.Array, index: jax.Array, *, rows: int) -> jax.Array:
    """int32[rows, K]: packed[p] at row index[p] (index >= rows dropped), the rest -1."""
    full = jnp.full((rows, packed.shape[1]), -1, jnp.int32)
    return full.at[index].set(packed.astype(jnp.int32), mode="drop")


def catch_up_inputs(chain_inp: ModelInput, feats: jax.Array, path: jax.Array, nd: jax.Array,
                    num_seqs: int) -> jax.Array:  # fmt: skip
    """The target's features [T, H] remapped for the head's catch-up after a tree step:
    a speculating row's query d + 1 (d < accepted) takes the feature of the path's
    depth-(d + 1) node instead of node d's, so the committed positions see their own
    tokens' features (chain_inp: the step's input with slot positions, as a chain's)."""
    cu = chain_inp.cu_q_lens
    t = jnp.arange(feats.shape[0], dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), num_seqs - 1)
    root = cu[1:] - 1 - nd  # each row's last real token
    d = t - root[row] - 1  # depth - 1 along the chain layout
    on_path = (t < cu[-1]) & (d >= 0) & (d < nd[row])
    node = path[row, jnp.clip(d, 0, path.shape[1] - 1)]
    src = jnp.where(on_path & (node >= 0), root[row] + 1 + node, t)
    return feats[src]


__all__ = ["EagleTreeDraft", "branch_parents", "catch_up_inputs", "expand_level"]
