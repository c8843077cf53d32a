"""Medusa heads in the engine: per-slot feature, chain proposals, no KV of their own.

``{"method": "medusa", "model": DIR, "num_speculative_tokens": k}`` with DIR a head
directory (``pagedjax/model/medusa.py``: pagedjax's layout or vLLM's Medusa checkpoint
names; train one with ``python -m pagedjax.tools.train_medusa``). Drafts per row:
k = min(num_speculative_tokens, num_heads) (vLLM refuses a k above its heads' count
unless a multiple; here it is capped). Notation as ``eagle.py``: committed tokens
x_0 .. x_{L-1} (L = ``total``), f_p the target's post-norm feature at position p.

1. propose (``MedusaDraft.propose``, before verification, one jitted program per
   sequence bucket): f_{L-2}, kept per slot in ``MedusaDraft.feature`` by the previous
   step (the target's forward over x_{L-2} predicted x_{L-1}), goes through all heads
   at once: draft i = argmax of head i (it predicts x_{L+i}), i < the row's count.
   With ``draft_sample_method="probabilistic"`` draft i is a sample of head i's
   softmax at the request's temperature and its q is kept for rejection sampling
   (``draft_sampling.py``, as the EAGLE head's).
2. verify (``MedusaVerifier.step``: ``SpecVerifier`` plus one gather in the same
   program): the target's forward also returns f_p for every token
   (``eagle.forward_with_features``); after acceptance each row's feature at its last
   committed position (L' - 2 for its new length L') is stored for the next proposal.

Like the EAGLE head, every step takes the verification program (even without
drafts), so the feature follows every token the target processes (a prefill chunk
included). Exactness does not depend on the heads (verification is the target's): a
stale feature (a step on the plain path for a row wanting prompt logprobs; n > 1
samples forked after their first token) only lowers acceptance. Nothing follows swaps
or rollback: the feature is rewritten by the row's next verified step. Not built:
Medusa's tree of candidates (top-k per head, tree attention; issue 36 names trees
separately); typical acceptance (Medusa-2's) — verification here is the exact rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.host_arrays import upload
from pagedjax.engine.spec.draft_sampling import draft_drawer, store
from pagedjax.engine.spec.eagle import forward_with_features
from pagedjax.engine.spec.verify import SpecVerifier
from pagedjax.model import ModelArch
from pagedjax.model.medusa import load_heads, medusa_logits


class MedusaDraft:
    """The heads and the per-slot feature (module docstring). k: the engine's
    num_speculative_tokens; ``self.k`` = min(k, num_heads), the drafts per row."""

    def __init__(self, arch: ModelArch, head_dir: str, k: int):
        self.arch = arch
        self.cfg, self.params = load_heads(head_dir, arch)  # clear errors: missing / mismatch
        self.k = min(k, self.cfg.num_heads)
        self.feature: Any = None  # float32[max_seqs, H]: f at each slot's L - 2 (``ensure``)
        self.trace_count: dict[int, int] = {}
        self.propose = jax.jit(self._propose, static_argnames=("num_seqs",),
                               donate_argnames=("tokens",))  # fmt: skip

    def ensure(self, core: Any) -> None:
        """Allocate the per-slot features (zeros: a first proposal from them only costs
        acceptance; every prefill writes its row's)."""
        if self.feature is None:
            self.feature = upload(np.zeros((core.max_seqs, self.arch.hidden_size), np.float32))

    def _propose(self, params: Any, feature: jax.Array, tokens: jax.Array, seq_ids: jax.Array,
                 total: jax.Array, counts: jax.Array, sampling: Any = None,
                 output_len: Any = None, *, num_seqs: int) -> tuple:  # fmt: skip
        """tokens int32[N, Lb] donated; seq_ids, total, counts int32[N] in batch-row order
        (first num_seqs used). Writes draft i of row r at total + i, i < counts[r].
        Returns (tokens',), or with sampling (SamplingTensors by slot) and output_len:
        (tokens', q float32[num_seqs, K, V]) for sampled drafts."""
        self.trace_count[num_seqs] = self.trace_count.get(num_seqs, 0) + 1
        sid = seq_ids[:num_seqs]
        row_ok = sid >= 0
        safe = jnp.maximum(sid, 0)
        tot, cnt = total[:num_seqs], counts[:num_seqs]
        logits = medusa_logits(params, feature[safe])  # [S, N, V]
        n = tokens.shape[0]
        q = None
        if sampling is None:
            drafts = jnp.argmax(logits[:, : self.k], axis=-1).astype(jnp.int32)  # [S, k]
        else:
            draw = draft_drawer(sampling, output_len, sid, self.arch.vocab_size)
            q = jnp.zeros((num_seqs, self.k, self.arch.vocab_size), jnp.float32)
            cols = []
            for i in range(self.k):  # static k: one draw per head
                d, p = draw(jnp.int32(i), logits[:, i])
                q = store(q, i, p, row_ok & (i < cnt))
                cols.append(d)
            drafts = jnp.stack(cols, axis=1)
        j = jnp.arange(self.k, dtype=jnp.int32)[None, :]
        write = row_ok[:, None] & (j < cnt[:, None])
        rows = jnp.where(write, safe[:, None], n)
        tokens = tokens.at[rows, tot[:, None] + j].set(drafts, mode="drop")
        return (tokens,) if q is None else (tokens, q)


class MedusaVerifier(SpecVerifier):
    """``SpecVerifier`` whose program also keeps each row's feature (module docstring).

    step(params, kv, tokens, mem, batch, num_drafts, sampling, prompt_len, output_len,
    feature, draft_probs=None, *, num_tokens, num_seqs, drafts=True) -> (kv', tokens', out,
    accepted, feature'); kv, tokens and feature are donated; drafts=False: the features
    only (``SpecVerifier.verify``'s no-draft program)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.step = jax.jit(self._medusa_step,
                            static_argnames=("num_tokens", "num_seqs", "drafts"),
                            donate_argnames=("kv", "tokens", "feature"))  # fmt: skip

    def _forward(self, params: Any, kv: Any, inp: Any) -> tuple[Any, jax.Array, Any]:
        return forward_with_features(params, kv, inp, arch=self.arch,
                                     attention_fn=self.attention_fn,
                                     native_matmul=self.native_matmul)  # fmt: skip

    def _medusa_step(self, params: Any, kv: Any, tokens: jax.Array, mem: Any, batch: Any,
                     num_drafts: jax.Array, slot_sampling: Any, prompt_len: jax.Array,
                     output_len: jax.Array, feature: jax.Array, draft_probs: Any = None, *,
                     num_tokens: int, num_seqs: int, drafts: bool = True) -> tuple:  # fmt: skip
        kv, tokens, out, accepted, aux = self.verify(
            params, kv, tokens, mem, batch, num_drafts, slot_sampling, prompt_len, output_len,
            draft_probs, num_tokens=num_tokens, num_seqs=num_seqs, drafts=drafts,
        )  # fmt: skip
        feature = keep_last_features(feature, aux["extra"], aux["inp"].cu_q_lens, batch,
                                     num_drafts, accepted, num_seqs)  # fmt: skip
        return kv, tokens, out, accepted, feature


def keep_last_features(feature: jax.Array, feats: jax.Array, cu_q_lens: jax.Array, batch: Any,
                       num_drafts: jax.Array, accepted: jax.Array,
                       num_seqs: int) -> jax.Array:  # fmt: skip
    """feature float32[N, H] with each batch row's f at its last committed position
    (its last real token plus the accepted drafts) from feats [T, H]; rows that
    committed nothing this step (and padding rows) keep theirs."""
    seq_ids = batch.seq_ids[:num_seqs]
    row_ok = seq_ids >= 0
    q = jnp.where(row_ok, batch.q_lens[:num_seqs], 0)
    q_eff = q - jnp.where(row_ok, num_drafts[:num_seqs], 0) + accepted
    last = jnp.clip(cu_q_lens[:-1] + q_eff - 1, 0, feats.shape[0] - 1)
    upd = row_ok & (q_eff > 0)
    n = feature.shape[0]
    return feature.at[jnp.where(upd, seq_ids, n)].set(feats[last].astype(feature.dtype),
                                                      mode="drop")  # fmt: skip


def build_medusa(
    arch: ModelArch, head_dir: str, k: int, verifier_args: Callable[[int], tuple]
) -> tuple[MedusaDraft, MedusaVerifier]:
    """(draft, verifier); verifier_args(k) -> ``SpecVerifier``'s arguments for the
    draft's k (the capped one)."""
    draft = MedusaDraft(arch, head_dir, k)
    return draft, MedusaVerifier(*verifier_args(draft.k))


__all__ = ["MedusaDraft", "MedusaVerifier", "build_medusa", "keep_last_features"]
