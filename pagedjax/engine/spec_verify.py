"""The device half of a speculative step: verify k proposals per row in one ragged forward.

A speculating row is a decode row whose query grew from 1 to 1 + k tokens: its last
real token, then its k draft ids, which the host already wrote into the token buffer at
positions ``total .. total + k - 1`` (``total`` = prompt + output length). It is just a
longer row of the existing ragged batch, so the attention backends, the KV writes and
the bucketing are unchanged. The forward returns logits at the row's last 1 + K tokens
(K = the static ``num_speculative_tokens``; rows with fewer drafts repeat their last
index), and each of the [S, K + 1] positions is sampled with the row's own
``SamplingTensors`` and ``output_position = output_len + j``: a sampled row's key is
still a function of (seed, sample index, output position), so the target token at each
position is exactly the one a run without speculation would have drawn there, given the
same prefix. Penalties see the drafts before each position (they sit in the token
buffer), which equal the target's tokens wherever they are accepted.

Acceptance (``accepted_prefix``): the draft at position j is kept iff it equals the
target's token there, the longest such prefix a; the row emits the a drafts plus the
target's token at position a (the correction, or a bonus token when all k matched).
For a draft that is a point mass (n-gram lookup, a greedy draft model) this is the
rejection rule of Leviathan et al. (2023) with q = one-hot: the draft token is accepted
with probability p(draft) = min(1, p / q), and after a rejection the emitted token is a
sample of p restricted to the other tokens, the normalised residual (p - q)+. The general
rule for a draft distribution q is ``pagedjax/sampling/rejection.py``.

Shapes (N slots, Lb = max_model_len, T / S the token / sequence bucket, K static):
  num_drafts int32[N] in batch-row order (0 for rows that do not speculate).
Returns (kv', tokens' with each emitting row's correction/bonus token written at
``total + a``, SamplerOutput of [S * (K + 1)] rows (row r's position j at r * (K+1) + j),
accepted int32[S]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.engine.model_runner import apply_cow, build_model_input, token_history
from pagedjax.model import ModelArch
from pagedjax.model.forward import forward
from pagedjax.sampling import SamplingTensors, sample
from pagedjax.scheduler import ScheduledBatch


def accepted_prefix(drafts: jax.Array, targets: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """int32[S]: leading positions j < num_drafts[r] where drafts[r, j] == targets[r, j].

    drafts, targets: int32[S, K] (targets: the target's token at each draft position).
    """
    k = drafts.shape[1]
    ok = (drafts == targets) & (jnp.arange(k, dtype=jnp.int32)[None, :] < num_drafts[:, None])
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


class SpecVerifier:
    """The jitted verification step for one (arch, attention, block size, K).

    ``trace_count[(T, S)]`` counts traces per bucket, like ``ModelRunner.trace_count``:
    one compilation per bucket, whatever the number of drafts in it.
    """

    def __init__(
        self,
        arch: ModelArch,
        block_size: int,
        attention_fn: Callable[..., jax.Array],
        max_logprobs: int,
        num_speculative_tokens: int,
    ):
        self.arch, self.block_size = arch, block_size
        self.max_logprobs = max_logprobs
        self.k = num_speculative_tokens
        self.trace_count: dict[tuple[int, int], int] = {}
        self._attention_fn = attention_fn
        self.step = jax.jit(
            self._step,
            static_argnames=("num_tokens", "num_seqs"),
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
        *,
        num_tokens: int,
        num_seqs: int,
    ) -> tuple[Any, jax.Array, Any, jax.Array]:
        key = (num_tokens, num_seqs)
        self.trace_count[key] = self.trace_count.get(key, 0) + 1  # at trace time only
        k1 = self.k + 1
        inp = build_model_input(
            tokens, mem.tables.tables, batch, num_tokens, num_seqs, self.block_size
        )
        kv = apply_cow(kv, mem.last_cow.src, mem.last_cow.dst, mem.last_cow.valid)
        nd = num_drafts[:num_seqs]
        last = inp.cu_q_lens[1:] - 1  # each row's last token
        j = jnp.arange(k1, dtype=jnp.int32)[None, :]
        first = jnp.maximum(last - nd, 0)[:, None]  # the row's last real token
        idx = jnp.clip(first + j, 0, jnp.maximum(last, 0)[:, None])  # [S, K+1]
        inp = inp._replace(logits_indices=idx.reshape(-1))
        kv, logits = forward(params, kv, inp, arch=self.arch, attention_fn=self._attention_fn)

        seq_ids = batch.seq_ids[:num_seqs]
        safe = jnp.maximum(seq_ids, 0)
        rep = jnp.repeat(safe, k1)  # [S * (K+1)] slot of each sampled position
        offset = jnp.tile(j[0], num_seqs)  # position j within the row
        t = jax.tree.map(lambda a: a[rep], slot_sampling)
        t = t._replace(output_position=output_len[rep] + offset)
        total = prompt_len[safe] + output_len[safe]  # [S] index of the first draft
        history = token_history(tokens, rep, prompt_len[rep], total[rep] + offset)
        out = sample(logits, t, history, max_logprobs=self.max_logprobs)

        targets = out.token_ids.reshape(num_seqs, k1)
        col = jnp.minimum(total[:, None] + j[:, : self.k], tokens.shape[1] - 1)
        drafts = tokens[safe[:, None], col]  # [S, K]
        accepted = accepted_prefix(drafts, targets[:, : self.k], nd)
        emit = batch.emits[:num_seqs] & (seq_ids >= 0)
        nxt = jnp.take_along_axis(targets, accepted[:, None], axis=1)[:, 0]
        n = tokens.shape[0]
        tokens = tokens.at[jnp.where(emit, seq_ids, n), total + accepted].set(nxt, mode="drop")
        return kv, tokens, out, accepted


__all__ = ["SpecVerifier", "accepted_prefix"]
