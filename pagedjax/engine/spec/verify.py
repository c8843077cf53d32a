"""The device half of a speculative step: verify k proposals per row in one ragged forward.

A speculating row is a decode row whose query grew from 1 to 1 + k tokens: its last
real token, then its k draft ids, which the host already wrote into the token buffer at
positions ``total .. total + k - 1`` (``total`` = prompt + output length). It is just a
longer row of the existing ragged batch, so the attention backends, the KV writes and
the bucketing are unchanged. The forward returns logits at each row's last 1 + k_r
tokens only (every other row: its last token), packed into min(T, S * (K + 1)) rows
(K = the static ``num_speculative_tokens``), so a batch where few rows speculate pays
the LM head and the sampler for few extra rows. Each sampled position j of a row uses
the row's own ``SamplingTensors`` with ``output_position = output_len + j``: a key is
still a function of (seed, sample index, output position), so the target token at each
position is exactly the one a run without speculation would have drawn there, given the
same prefix. Penalties see the drafts before each position (they sit in the token
buffer), which equal the target's tokens wherever they are accepted.

Acceptance: the draft at position j is kept iff it equals the
target's token there, the longest such prefix a; the row emits the a drafts plus the
target's token at position a (the correction, or a bonus token when all k matched).
For a draft that is a point mass (n-gram lookup, a greedy draft model) this is the
rejection rule of Leviathan et al. (2023) with q = one-hot: the draft token is accepted
with probability p(draft) = min(1, p / q), and after a rejection the emitted token is a
sample of p restricted to the other tokens, the normalised residual (p - q)+. The general
rule for a draft distribution q is ``pagedjax/sampling/rejection.py``, applied here to
the rows whose drafts were sampled (``draft_probs``, ``draft_sampling.py``): p is then
the distribution the target samples from at each position, and the row emits its
accepted drafts plus the residual / bonus token, their logprobs recomputed.

Draft trees (``parents`` given; ``tree.py``): the drafts are the nodes of a tree per row
at consecutive slots, verified with the tree mask and depth positions, accepted level by
level (the same sample-and-compare rule), the output repacked into the chain layout
above, and the accepted path's KV compacted to the chain's slots in the same program.

Shapes (N slots, Lb = max_model_len, T / S the token / sequence bucket, K static):
  num_drafts int32[N] in batch-row order (0 for rows that do not speculate).
Returns (kv', tokens' with each emitting row's correction/bonus token written at
``total + a``, SamplerOutput of the packed positions (row r's position j at
``sampled_offsets(...)[r] + j``), accepted int32[S]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.model_runner import apply_cow, build_model_input, token_history
from pagedjax.engine.spec import tree
from pagedjax.model import ModelArch
from pagedjax.model.forward import forward
from pagedjax.sampling import SamplingTensors, output_for, processed_probs, sample
from pagedjax.sampling.rejection import position_keys, rejection_sample
from pagedjax.sampling.sampler import fsm_walk
from pagedjax.sampling.tensors import take_rows
from pagedjax.scheduler import ScheduledBatch


class SpecVerifier:
    """The jitted verification step for one (arch, attention, block size, K).

    ``trace_count[(T, S)]`` counts traces per bucket, like ``ModelRunner.trace_count``:
    one compilation per bucket, whatever the number of drafts in it; ``(T, S, 0)``
    counts the bucket's no-draft program (``drafts=False``, ``verify``).
    """

    def __init__(
        self,
        arch: ModelArch,
        block_size: int,
        attention_fn: Callable[..., jax.Array],
        max_logprobs: int,
        num_speculative_tokens: int,
        native_matmul: bool = False,
    ):
        self.arch, self.block_size = arch, block_size
        # The plain step's choice (ModelRunner.native_matmul): without it the k + 1-row
        # verification ran XLA's copy-then-dot under the layer loop, 1.6-2x the plain step.
        self.native_matmul = native_matmul
        self.max_logprobs = max_logprobs
        self.k = num_speculative_tokens
        self.trace_count: dict[tuple[int, int], int] = {}
        self.attention_fn = attention_fn
        self.step = jax.jit(
            self._step,
            static_argnames=("num_tokens", "num_seqs", "drafts"),
            donate_argnames=("kv", "tokens"),
        )

    def _step(
        self,
        params: Any,
        kv: Any,
        tokens: jax.Array,
        mem: Any,
        batch: ScheduledBatch,
        num_drafts: jax.Array,
        slot_sampling: SamplingTensors,
        prompt_len: jax.Array,
        output_len: jax.Array,
        draft_probs: jax.Array | None = None,
        parents: jax.Array | None = None,
        grammar_masks: jax.Array | None = None,
        *,
        num_tokens: int,
        num_seqs: int,
        drafts: bool = True,
    ) -> tuple[Any, jax.Array, Any, jax.Array]:
        kv, tokens, out, accepted, _ = self.verify(
            params, kv, tokens, mem, batch, num_drafts, slot_sampling, prompt_len, output_len,
            draft_probs, parents, grammar_masks, num_tokens=num_tokens, num_seqs=num_seqs,
            drafts=drafts,
        )  # fmt: skip
        return kv, tokens, out, accepted

    def _forward(self, params: Any, kv: Any, inp: Any) -> tuple[Any, jax.Array, Any]:
        """The target's forward: (kv', logits at inp.logits_indices, extra); extra is
        None here, a subclass may return more (``spec_eagle.py``: the features)."""
        kv, logits = forward(params, kv, inp, arch=self.arch, attention_fn=self.attention_fn,
                             native_matmul=self.native_matmul)  # fmt: skip
        return kv, logits, None

    def verify(
        self,
        params: Any,
        kv: Any,
        tokens: jax.Array,
        mem: Any,
        batch: ScheduledBatch,
        num_drafts: jax.Array,
        slot_sampling: SamplingTensors,
        prompt_len: jax.Array,
        output_len: jax.Array,
        draft_probs: jax.Array | None = None,
        parents: jax.Array | None = None,
        grammar_masks: jax.Array | None = None,
        *,
        num_tokens: int,
        num_seqs: int,
        drafts: bool = True,
    ) -> tuple[Any, jax.Array, Any, jax.Array, dict]:
        """``_step``'s body; also returns {"inp": the ModelInput, "extra": _forward's}.
        draft_probs float32[>= S, K, V] (batch-row order): the q each draft was sampled
        from (``draft_sampling.py``); its sampled rows (temperature > 0, with drafts) are
        verified by rejection sampling (``_rejection``), the others by sample-and-compare.
        parents int32[>= S, K] (batch-row order, -1 = the row's last token): the drafts
        form trees (``tree.py``: tree mask, depth positions, the walk, KV compaction);
        None: chains, and the program is the chain one. grammar_masks int32[>= S, K, W]
        (batch-row order): constrained rows' drafts (structured/drafts.py): position j >= 1
        of row r is sampled under grammar_masks[r, j - 1], the grammar's mask after the
        drafts before it (position 0 under the row's own grammar_mask); None: every
        position under its row's mask (a second program per bucket when given).
        drafts=False (static): no row has drafts (``num_drafts`` all 0; draft_probs,
        parents and grammar_masks None), so only each row's last token is sampled: S
        sampled rows instead of min(T, S * (K + 1)). The program a head method (EAGLE,
        Medusa) runs for its catch-up on a step without drafts: with S * (K + 1) rows a
        64-row prefill step paid the LM head and the sampler on 5x its rows (+29 %,
        docs/speculative_decoding.md)."""
        if not drafts and any(a is not None for a in (draft_probs, parents, grammar_masks)):
            raise ValueError("a no-draft verification takes no draft_probs, parents or"
                             " grammar_masks")  # fmt: skip
        key = (num_tokens, num_seqs) if drafts else (num_tokens, num_seqs, 0)
        self.trace_count[key] = self.trace_count.get(key, 0) + 1  # at trace time only
        inp = build_model_input(
            tokens, mem.tables.tables, batch, num_tokens, num_seqs, self.block_size
        )
        kv = apply_cow(kv, mem.last_cow.src, mem.last_cow.dst, mem.last_cow.valid)
        seq_ids = batch.seq_ids[:num_seqs]
        row_ok = seq_ids >= 0
        safe = jnp.maximum(seq_ids, 0)
        nd = jnp.where(row_ok & drafts, num_drafts[:num_seqs], 0)
        # Sampled positions, packed: row r owns 1 + nd[r] of them from offset[r] (fewer
        # than its q_len tokens, so they fit in min(T, S * (K + 1)) rows).
        m = jnp.where(row_ok, 1 + nd, 0)
        ends = jnp.cumsum(m, dtype=jnp.int32)
        offset = ends - m
        size = sampled_rows(num_tokens, num_seqs, self.k if drafts else 0)
        f = jnp.arange(size, dtype=jnp.int32)
        frow = jnp.minimum(jnp.searchsorted(ends, f, side="right"), num_seqs - 1)
        fvalid = f < ends[-1]
        j = jnp.where(fvalid, f - offset[frow], 0)  # position within the row's run
        last = inp.cu_q_lens[1:] - 1  # each row's last token
        first = jnp.maximum(last - nd, 0)  # the row's last real token
        idx = jnp.where(fvalid, jnp.minimum(first[frow] + j, last[frow]), 0)
        inp = inp._replace(logits_indices=idx)
        level = j  # each sampled position's depth past the row's last token
        chain_inp = inp  # slot positions, no tree mask (the EAGLE catch-up's input)
        if parents is not None:
            parents = parents[:num_seqs]
            inp, depth = tree.tree_inputs(inp, parents, nd, num_seqs)
            level = jnp.where(j == 0, 0, depth[frow, jnp.clip(j - 1, 0, self.k - 1)])
        kv, logits, extra = self._forward(params, kv, inp)

        slot = safe[frow]  # [size] the slot of each sampled position
        t = take_rows(slot_sampling, slot)
        # Padding positions read slot 0's row: they must not turn the top-k on.
        t = t._replace(output_position=output_len[slot] + level,
                       reports_top=t.reports_top & fvalid & row_ok[frow])  # fmt: skip
        if grammar_masks is not None:  # chains only (the decoder gives no tree masks)
            after = grammar_masks[frow, jnp.clip(j - 1, 0, self.k - 1)]
            t = t._replace(grammar_mask=jnp.where((j > 0)[:, None], after, t.grammar_mask))
        total = prompt_len[safe] + output_len[safe]  # [S] index of the first draft
        if t.fsm_table.shape[0] and drafts:
            # Device FSM rows' drafts: position j >= 1 is sampled under the FSM's state
            # after node j - 1's path, the drafts before it on a chain, its ancestors and
            # itself in a tree (a refused draft is never accepted: its parent position's
            # sample is drawn under the mask that refuses it, so the positions past it are
            # unused; unless the row allows nothing at all, the FSM's set and
            # allowed_token_ids disjoint, where the host's record ends the row anyway).
            col = jnp.minimum(total[:, None] + jnp.arange(self.k)[None, :], tokens.shape[1] - 1)
            walk = fsm_walk(take_rows(slot_sampling, safe), tokens[safe[:, None], col], parents)
            after = walk[frow, jnp.clip(j - 1, 0, self.k - 1)]
            t = t._replace(fsm_state=jnp.where(j > 0, after, t.fsm_state))
        # A tree node's history is exact on chains only (penalised rows get chains).
        history = token_history(tokens, slot, prompt_len[slot], total[frow] + level)
        out = sample(logits, t, history, max_logprobs=self.max_logprobs)
        if parents is not None:
            return self._tree_accept(kv, tokens, mem, batch, out, parents, nd, safe, total, offset,
                                     frow, j, fvalid, chain_inp, extra, num_seqs)  # fmt: skip

        # The draft at position j of a row sits in the token buffer at total + j.
        draft = tokens[slot, jnp.minimum(total[frow] + j, tokens.shape[1] - 1)]
        is_draft = fvalid & (j < nd[frow])
        miss = is_draft & (draft != out.token_ids)
        first_miss = jax.ops.segment_min(
            jnp.where(miss, j, self.k + 1), jnp.where(fvalid, frow, num_seqs),
            num_segments=num_seqs,
        )  # fmt: skip
        accepted = jnp.minimum(first_miss, nd).astype(jnp.int32)
        if draft_probs is not None:
            out, accepted = self._rejection(
                logits, t, history, out, accepted, draft_probs, tokens, slot_sampling,
                output_len, safe, total, nd, offset, frow, j, fvalid,
            )  # fmt: skip
        emit = batch.emits[:num_seqs] & row_ok
        nxt = out.token_ids[jnp.minimum(offset + accepted, size - 1)]
        n = tokens.shape[0]
        tokens = tokens.at[jnp.where(emit, seq_ids, n), total + accepted].set(nxt, mode="drop")
        return kv, tokens, out, accepted, {"inp": inp, "extra": extra}

    def _tree_accept(self, kv: Any, tokens: jax.Array, mem: Any, batch: ScheduledBatch,
                     out: Any, parents: jax.Array, nd: jax.Array, safe: jax.Array,
                     total: jax.Array, offset: jax.Array, frow: jax.Array, j: jax.Array,
                     fvalid: jax.Array, inp: Any, extra: Any,
                     num_seqs: int) -> tuple[Any, jax.Array, Any, jax.Array, dict]:  # fmt: skip
        """A tree's acceptance (``tree.py``): the walk, the output repacked into the chain
        layout, the accepted path's tokens and the bonus written, its KV compacted. aux:
        {"inp": the step's input with slot positions, "extra", "path": int32[S, K]}."""
        k = self.k
        pos = jnp.minimum(total[:, None] + jnp.arange(k)[None, :], tokens.shape[1] - 1)
        node_tokens = tokens[safe[:, None], pos]  # [S, K] the drafts as written
        accepted, path = tree.walk(out.token_ids, offset, node_tokens, parents, nd)
        out = tree.repack(out, path, accepted, offset, frow, j, fvalid)
        seq_ids = batch.seq_ids[:num_seqs]
        emit = batch.emits[:num_seqs] & (seq_ids >= 0)
        tokens = tree.write_path(tokens, out.token_ids, seq_ids, emit, total, offset,
                                 accepted + 1, k + 1)  # path and bonus  # fmt: skip
        kv = tree.compact(kv, mem.tables.tables, jnp.where(emit, seq_ids, -1), total - 1,
                          path, accepted, self.block_size)  # fmt: skip
        return kv, tokens, out, accepted, {"inp": inp, "extra": extra, "path": path}

    def _rejection(self, logits: jax.Array, t: SamplingTensors, history: Any, out: Any,
                   accepted: jax.Array, draft_probs: jax.Array, tokens: jax.Array,
                   slot_sampling: SamplingTensors, output_len: jax.Array, safe: jax.Array,
                   total: jax.Array, nd: jax.Array, offset: jax.Array, frow: jax.Array,
                   j: jax.Array, fvalid: jax.Array) -> tuple[Any, jax.Array]:  # fmt: skip
        """Rejection sampling (``sampling/rejection.py``) for the sampled rows: p is the
        distribution the target samples from at each packed position (penalties,
        temperature, filters: ``processed_probs``), gathered to [S, K + 1, V]; q the
        drafts'. Returns (out with those rows' emitted tokens and their logprobs,
        accepted); greedy rows and rows without drafts keep ``out`` and ``accepted``."""
        s, k = safe.shape[0], self.k
        size = logits.shape[0]
        p = processed_probs(logits, t, history)  # [size, V]
        jj = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
        dense = jnp.minimum(offset[:, None] + jnp.minimum(jj, nd[:, None]), size - 1)
        target = p[dense]  # [S, K + 1, V]
        pos = jnp.minimum(total[:, None] + jj[:, :k], tokens.shape[1] - 1)
        draft_ids = jnp.maximum(tokens[safe[:, None], pos], 0)
        keys = position_keys(slot_sampling.seed[safe], slot_sampling.sample_index[safe],
                             output_len[safe], k + 1)  # fmt: skip
        res = rejection_sample(target, draft_probs[:s], draft_ids, nd, keys)
        sampled = ~slot_sampling.greedy[safe] & (nd > 0)  # [S]
        accepted = jnp.where(sampled, res.accepted, accepted)
        emitted = res.token_ids[frow, jnp.minimum(j, k)]  # [size] packed
        ids = jnp.where(fvalid & sampled[frow], emitted, out.token_ids)
        return output_for(logits, t, ids, max_logprobs=self.max_logprobs), accepted


def sampled_rows(num_tokens: int, num_seqs: int, k: int) -> int:
    """Static size of the packed sampled positions for bucket (T, S)."""
    return min(num_tokens, num_seqs * (k + 1))


def sampled_offsets(counts: np.ndarray, num_seqs: int) -> np.ndarray:
    """Host mirror of the packing: int[num_seqs] offset of each batch row's positions
    (row r's position j is sampled row offset[r] + j). counts: drafts per batch row."""
    m = 1 + np.asarray(counts[:num_seqs], np.int64)
    return np.cumsum(m) - m


def write_drafts(tokens: jax.Array, seq_ids: jax.Array, draft_pos: jax.Array,
                 drafts: jax.Array) -> jax.Array:
    """tokens' with each batch row's drafts (int32[S, K] in batch-row order, -1 = none)
    at draft_pos + j (int32[S]); padding rows (seq_id -1) write nothing."""
    n, k = drafts.shape
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    row = jnp.where((seq_ids[:, None] >= 0) & (drafts >= 0), seq_ids[:, None], tokens.shape[0])
    return tokens.at[row, draft_pos[:, None] + j].set(drafts, mode="drop")


__all__ = ["SpecVerifier", "sampled_offsets", "sampled_rows", "write_drafts"]
