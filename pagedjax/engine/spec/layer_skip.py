"""Layer-skip draft: the target's own first N layers, final norm and LM head propose.

``{"method": "draft_model", "model": "self", "draft_num_layers": N}``: a draft that needs
no other checkpoint (LayerSkip / "self-speculative decoding", Elhoushi et al. 2024,
Zhang et al. 2023). It proposes k tokens greedily (or sampled from its q with
``draft_sample_method="probabilistic"``, ``draft_sampling.py``), one batched step per
draft token, all k in one jitted program (a ``lax.fori_loop``) per sequence bucket.

Its KV: the draft's layers are the target's layers 0..N-1 with the same weights, so the
KV it needs for every committed token is exactly what the target already wrote in
layers 0..N-1 of the shared pool. The draft reads and writes those layers in place
(block tables, slots and rollback are the target's) instead of keeping a second pool:
the draft tokens' rows it writes are the rows the verification step then rewrites for
the same tokens, and the rows of rejected drafts are rolled back with the target's. A
separate draft checkpoint has its own pool: ``spec_draft_model.py``.

Inputs: the extended state (``speculative._extend`` grew each speculating row to
``start + 1 + k``), the token buffer holding the last real token at ``total - 1``.
Draft i (0-based) of row r reads position ``total - 1 + i`` and writes its argmax at
``total + i`` for i < k_r; rows past their k_r write nothing (PAD_SLOT).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.engine.model_runner import apply_cow
from pagedjax.engine.spec.draft_sampling import draft_drawer, store
from pagedjax.memory.block_table import PAD_SLOT, slot_mapping
from pagedjax.model import ModelArch, ModelInput
from pagedjax.model.forward import build_module


def draft_arch(arch: ModelArch, num_layers: int) -> ModelArch:
    """arch cut to its first ``num_layers`` layers (same pool layout, same head)."""
    if not 1 <= num_layers < arch.num_layers:
        raise ValueError(
            f"draft_num_layers must be in [1, {arch.num_layers - 1}] for this model, got"
            f" {num_layers}"
        )
    return dataclasses.replace(
        arch, num_layers=num_layers, layer_windows=arch.layer_windows[:num_layers]
    )


def draft_params(params: Any, num_layers: int) -> Any:
    """The target's params with the stacked ``layers`` cut to the first num_layers."""
    return {
        **params,
        "layers": jax.tree.map(lambda x: x[:num_layers], params["layers"]),
    }


class LayerSkipDraft:
    """Greedy proposals from the first N layers (see the module docstring)."""

    def __init__(self, arch: ModelArch, num_layers: int, attention_fn: Callable[..., Any],
                 block_size: int, k: int, native_matmul: bool = False):  # fmt: skip
        self.arch = draft_arch(arch, num_layers)
        self.num_layers, self.block_size, self.k = num_layers, block_size, k
        self.module = build_module(self.arch, attention_fn=attention_fn,
                                   native_matmul=native_matmul)  # as the target's step
        self.trace_count: dict[int, int] = {}
        self._params_src: Any = None
        self._params: Any = None
        self.propose = jax.jit(self._propose, static_argnames=("num_seqs",),
                               donate_argnames=("kv", "tokens"))  # fmt: skip

    def params_for(self, params: Any) -> Any:
        """The draft's params (cut once per target params object)."""
        if self._params_src is not params:
            self._params = jax.jit(draft_params, static_argnums=1)(params, self.num_layers)
            self._params_src = params
        return self._params

    def _propose(self, params: Any, kv: Any, tokens: jax.Array, mem: Any,
                 seq_ids: jax.Array, total: jax.Array, counts: jax.Array,
                 sampling: Any = None, output_len: jax.Array | None = None, *,
                 num_seqs: int) -> tuple:  # fmt: skip
        """kv (whole pool, donated), tokens (donated), mem: the paged state (tables and
        the step's pending copy-on-write, applied first so the draft reads the copied
        block; the verification step applies it again, harmlessly); seq_ids, total,
        counts int32[N] in batch-row order (first num_seqs used). Returns (kv', tokens'
        with the drafts written). With sampling (SamplingTensors by slot) and output_len
        int32[N] by slot: sampled drafts (draft_sampling.py), returns (kv', tokens', q
        float32[num_seqs, K, V])."""
        self.trace_count[num_seqs] = self.trace_count.get(num_seqs, 0) + 1
        kv = apply_cow(kv, mem.last_cow.src, mem.last_cow.dst, mem.last_cow.valid)
        apply = lambda kv, inp: self.module.apply({"params": params}, kv, inp)
        draw = q = None
        if sampling is not None:
            draw = draft_drawer(sampling, output_len, seq_ids[:num_seqs], self.arch.vocab_size)
            q = jnp.zeros((num_seqs, self.k, self.arch.vocab_size), jnp.float32)
        return greedy_draft_steps(apply, kv, tokens, mem.tables.tables, seq_ids, total,
                                  counts, 0, self.k, kv_tail=0, num_seqs=num_seqs,
                                  block_size=self.block_size, draw=draw, q=q)  # fmt: skip


def greedy_draft_steps(apply: Callable[[Any, ModelInput], tuple[Any, jax.Array]], kv: Any,
                       tokens: jax.Array, tables: jax.Array, seq_ids: jax.Array,
                       total: jax.Array, counts: jax.Array, lower: Any, upper: Any, *,
                       kv_tail: int, num_seqs: int, block_size: int,
                       draw: Callable[..., tuple] | None = None,
                       q: jax.Array | None = None) -> tuple:  # fmt: skip
    """Batched one-token draft steps i in [lower, upper) (bounds may be traced).

    Step i feeds each active row the token at position ``total - 1 + i`` (writing its
    KV there through ``apply(kv, ModelInput) -> (kv', logits [S, V])``, the draft's
    forward) and writes the argmax at ``total + i`` when i < counts (draft i). A row is
    active while i < counts + kv_tail: kv_tail = 1 runs one more step whose only use is
    the KV of the last draft (``spec_draft_model.py``: a separate draft needs its own KV
    at every position the verification may accept). seq_ids, total, counts: int32[N]
    in batch-row order, first num_seqs used; rows past their run write nothing
    (PAD_SLOT). Returns (kv', tokens'). With draw (``draft_sampling.draft_drawer``) and
    q float32[S, K, V]: draft i is draw(i, logits)'s sample and its q goes to q[:, i];
    returns (kv', tokens', q')."""
    sid = seq_ids[:num_seqs]
    row_ok = sid >= 0
    safe = jnp.maximum(sid, 0)
    tot, cnt = total[:num_seqs], counts[:num_seqs]
    n = tokens.shape[0]
    block_tables = jnp.where(row_ok[:, None], tables[safe], 0)

    def body(i, carry):
        kv, tokens, qd = carry  # qd: the drafts' q (q below: query lengths)
        active = row_ok & (i < cnt + kv_tail)
        pos = jnp.maximum(tot - 1 + i, 0)
        ids = tokens[safe, jnp.minimum(pos, tokens.shape[1] - 1)]
        slots = slot_mapping(tables, safe, pos, active, block_size)
        # Ragged layout: one query token per active row, idle rows get q_len 0 (and
        # kv_len 0); the active rows' tokens are packed first, in row order.
        q = active.astype(jnp.int32)
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q, dtype=jnp.int32)])
        dest = jnp.where(active, cu[:-1], num_seqs)  # out of range: dropped
        pack = lambda fill, v: jnp.full((num_seqs,), fill, jnp.int32).at[dest].set(
            v, mode="drop"
        )
        inp = ModelInput(
            tokens=pack(0, ids),
            positions=pack(0, pos),
            slot_mapping=pack(PAD_SLOT, slots),
            block_tables=block_tables,
            kv_lens=jnp.where(active, pos + 1, 0),
            cu_q_lens=cu,
            logits_indices=jnp.minimum(cu[:-1], num_seqs - 1),
        )
        kv, logits = apply(kv, inp)
        if draw is None:
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            nxt, probs = draw(i, logits)
            qd = store(qd, i, probs, active & (i < cnt))
        dst = jnp.where(active & (i < cnt), safe, n)  # out of range: dropped
        tokens = tokens.at[dst, tot + i].set(nxt, mode="drop")
        return kv, tokens, qd

    kv, tokens, q = jax.lax.fori_loop(lower, upper, body, (kv, tokens, q))
    return (kv, tokens) if draw is None else (kv, tokens, q)


__all__ = ["LayerSkipDraft", "draft_arch", "draft_params", "greedy_draft_steps"]
