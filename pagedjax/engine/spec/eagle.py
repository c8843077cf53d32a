"""EAGLE-style draft head in the engine: its own one-layer KV pool, proposals, catch-up.

``{"method": "eagle", "model": DIR, "num_speculative_tokens": k}`` with DIR a head
directory (``pagedjax/model/eagle.py``: config.json + model.safetensors; train one with
``python -m pagedjax.tools.train_eagle``). Notation: committed tokens x_0 .. x_{L-1}
of a sequence (L = ``total``), f_p the target's (post-norm) feature at position p,
g_p the head's output there (g_p ~ f_{p+1}; lm_head(g_p) predicts x_{p+2}).

**KV: a separate one-layer pool under the same block ids.** The head's attention needs
its own K/V for every earlier position (computed from the head's inputs, not the
target's). It lives in ``EagleDraft.kv``: (k, v), each ``[1, num_blocks, Hkv, B, D]``,
indexed by the *target's* block tables and slot mapping. So the grow path, rollback
(blocks past the accepted length return to the pool: the head's rows in them go with
them), prefix-cache sharing and the block-table invariant need nothing new, and the
target's pool and its layer loop stay untouched (simplest correct choice: a second
layer slice of the same pool would change every backend's pool shape check). Cost: the
head's bytes per token (``head_kv_bytes_per_token``: SmolLM2-135M's head adds 1/30 to
the target's), counted in the KV budget like a separate draft's pool, so the same
memory gives proportionally fewer blocks and the engine allocates no more than it.
Swap preemption copies the head's blocks with the target's (``apply_swaps``,
``draft_pool.py``), so a swapped-in sequence's head reads its own rows.

**Every step runs the head** (the speculative path is taken even when no row has
drafts), because the head's KV must follow every token the target processes:

1. propose (``EagleDraft.propose``, before verification, one jitted program per row
   count; only on steps with drafts, over the drafting rows packed first,
   ``SpeculativeDecoder._packed_rows``): draft 0 = argmax lm_head(g_{L-2}), with g_{L-2}
   kept per slot in ``EagleDraft.feature`` by the previous step; then for i = 1 .. k-1
   one batched head step at position L-2+i on (g, draft i-1) gives draft i. These k-1
   steps write head KV at positions L-1 .. L+k-3 from *approximate* features.
2. verify (``EagleVerifier.step``: ``SpecVerifier`` plus a catch-up in the same
   program): the target's forward also returns f_p for every token of the ragged batch
   (the input of its final norm, captured by ``nn.intercept_methods``); after
   acceptance the head runs once over the batch's committed positions p (a prefill
   chunk: all of them; a speculating row: its last real token and the a accepted
   drafts) with the exact inputs (f_p, x_{p+1}), overwriting step 1's approximate
   rows, and keeps g at each row's last committed position for the next proposal.
   Positions past the accepted length are not written (PAD_SLOT).

**Exactness does not depend on the head**: verification is the target's (greedy: the
longest prefix equal to the target's argmax), so a wrong, untrained or stale head only
lowers acceptance. That is what makes the following simplifications safe, each
costing acceptance only: a step on the plain path (a row asking for prompt logprobs)
writes no head KV; n > 1 samples forked after the first token start from a stale g.

**Truncated draft vocabulary** (a head directory with ``draft_vocab``, model/eagle.py):
``ensure`` gathers the LM head's rows for those ids once (``params["lm"]``, [N, H]) and
every draft is ``vocab[argmax(g @ lm.T)]``; so a draft is always an id of the subset,
and the drafting cost of the LM head shrinks by V / N. Drafts are greedy (a point mass
q = one-hot, verified by sample-and-compare) unless ``draft_sample_method`` is
"probabilistic": then each is a sample of q = softmax(logits / T) over the subset (q
scattered back to the V ids, zero elsewhere) and the verification applies rejection
sampling (``draft_sampling.py``).

Refused (by name, ``check_eagle``): a quantized KV cache (the head's pool would need
the calibration / scales path), quantized target embeddings / LM head, a non-Llama
target; tensor parallelism is refused for every method (llm_engine.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.host_arrays import upload
from pagedjax.engine.model_runner import apply_cow
from pagedjax.engine.spec.draft_pool import host_pool, mirror_swaps
from pagedjax.engine.spec.draft_sampling import draft_drawer, store
from pagedjax.engine.spec.verify import SpecVerifier
from pagedjax.memory.block_table import PAD_SLOT, slot_mapping
from pagedjax.model import ModelArch, ModelInput, QuantizedWeight, build_module
from pagedjax.model.eagle import EagleConfig, EagleHead, load_head
from pagedjax.model.kv_cache import cache_bytes_per_token
from pagedjax.model.layers import dot_transposed
from pagedjax.model.llama import LlamaForCausalLM


def embed_tokens(params: Any, arch: ModelArch, ids: jax.Array) -> jax.Array:
    """The target's input embedding of ids (int32[...]) -> [..., H]."""
    x = jnp.take(params["embed_tokens"]["embedding"], ids, axis=0)
    return x * jnp.asarray(arch.hidden_size**0.5, x.dtype) if arch.embed_scale else x


def lm_logits(params: Any, arch: ModelArch, g: jax.Array) -> jax.Array:
    """The target's LM head on features g [..., H] -> fp32 logits [..., V] (no norm:
    features are post-norm, as the LM head sees them)."""
    if arch.tie_word_embeddings:
        w = params["embed_tokens"]["embedding"]
        return dot_transposed(g.astype(w.dtype), w).astype(jnp.float32)  # 1 row: as 2
    w = params["lm_head"]["kernel"]
    return jnp.dot(g.astype(w.dtype), w).astype(jnp.float32)


def forward_with_features(
    params: Any, kv: Any, inp: ModelInput, *, arch: ModelArch, attention_fn: Callable[..., Any],
    native_matmul: bool = False,
) -> tuple[Any, jax.Array, jax.Array]:
    """The target's forward, plus its post-norm features for every token.

    Runs the model with logits_indices = every token and intercepts the final norm:
    its output [T, H] is kept as the features, and only the rows at the caller's
    ``inp.logits_indices`` continue into the LM head (native_matmul: as ``forward``'s).
    Returns (kv', fp32 logits [len(logits_indices), V], features [T, H])."""
    t = inp.tokens.shape[0]
    kept: dict[str, jax.Array] = {}

    def grab(next_fun, args, kwargs, context):
        mod = context.module
        if (context.method_name == "__call__" and mod.name == "norm"
                and isinstance(mod.parent, LlamaForCausalLM)):  # fmt: skip
            feats = next_fun(*args, **kwargs)
            kept["features"] = feats
            return jnp.take(feats, inp.logits_indices, axis=0, mode="clip")
        return next_fun(*args, **kwargs)

    module = build_module(arch, attention_fn=attention_fn, native_matmul=native_matmul)
    every = inp._replace(logits_indices=jnp.arange(t, dtype=jnp.int32))
    with nn.intercept_methods(grab):
        kv, logits = module.apply({"params": params}, kv, every)
    return kv, logits, kept["features"]


def head_kv_bytes_per_token(head_dir: str, arch: ModelArch, dtype: Any) -> int:
    """KV bytes per token of the head's one-layer pool in ``dtype`` (its config.json
    only; FileNotFoundError / ValueError naming the directory, as ``load_head``)."""
    path = Path(head_dir).expanduser() / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"eagle head directory {str(path.parent)!r} lacks config.json"
                                " (train one with `python -m pagedjax.tools.train_eagle`)")
    head = EagleConfig.from_dict(json.loads(path.read_text()), where=str(path)).head_arch(arch)
    return cache_bytes_per_token(head, "auto", dtype)


def check_eagle(arch: ModelArch, params: Any, kv: Any, method: str = "eagle") -> None:
    """NotImplementedError naming the unsupported combination (``method``: the name
    the errors give, "eagle" or "eagle3")."""
    emb = params["embed_tokens"]["embedding"]
    head = params.get("lm_head", {}).get("kernel")
    if isinstance(emb, QuantizedWeight) or isinstance(head, QuantizedWeight):
        raise NotImplementedError(f"speculative method {method!r} with quantized target weights"
                                  " (embedding / LM head) is not built")  # fmt: skip
    if not (isinstance(kv, tuple | list) and len(kv) == 2) or jnp.dtype(kv[0].dtype).itemsize < 2:
        raise NotImplementedError(f"speculative method {method!r} with a quantized KV cache"
                                  " (cache_dtype int8 / fp8) is not built")  # fmt: skip


class EagleDraft:
    """The head, its KV pool and per-slot feature (module docstring)."""

    def __init__(self, arch: ModelArch, head_dir: str, attention_fn: Callable[..., Any],
                 block_size: int, k: int):  # fmt: skip
        self.arch, self.block_size, self.k = arch, block_size, k
        # clear errors: missing / mismatched. params: {"head": the head's flax params}, plus
        # after ``ensure`` with a truncated vocabulary "vocab" int32[N] and "lm" [N, H].
        self.cfg, head, self.draft_vocab = load_head(head_dir, arch)
        self.params: dict[str, Any] = {"head": head}
        self.head_arch = self.cfg.head_arch(arch)
        self.module = EagleHead(self.head_arch, attention_fn=attention_fn)
        self.kv: Any = None  # allocated on first use (``ensure``): needs the pool's size
        self.host_kv: Any = None  # its swap pool under the target's host block ids
        self.feature: Any = None  # [max_seqs, H] g at each slot's last committed position
        self.trace_count: dict[int, int] = {}
        self.propose = self.jit_propose()

    def jit_propose(self) -> Any:
        """The jitted proposal program (``_propose``; a subclass with its own __init__,
        spec/eagle3.py, calls this too)."""
        return jax.jit(self._propose, static_argnames=("num_seqs",),
                       donate_argnames=("draft_kv", "tokens"))  # fmt: skip

    def ensure(self, core: Any) -> None:
        """Allocate the head's pool (the target's block count and size) and features."""
        if self.kv is not None:
            return
        kv = core.device.kv
        check_eagle(self.arch, core.params, kv)
        if self.draft_vocab is not None:
            ids = upload(self.draft_vocab)
            emb = core.params["embed_tokens"]["embedding"]
            tied = self.arch.tie_word_embeddings
            w = emb[ids] if tied else core.params["lm_head"]["kernel"][:, ids].T
            self.params = dict(self.params, vocab=ids, lm=w)
        _, nb, _, b, _ = kv[0].shape
        a = self.head_arch
        shape = (1, nb, a.num_kv_heads, b, a.head_dim)
        self.kv = (jnp.zeros(shape, kv[0].dtype), jnp.zeros(shape, kv[1].dtype))
        self.host_kv = host_pool(self.kv, jax.tree.leaves(core.device.host_kv)[0].shape[1] - 1)
        self.feature = upload(np.zeros((core.max_seqs, a.hidden_size), np.float32))

    def apply_swaps(self, plan: Any, host: dict) -> None:
        """The step's swap copies on the head's pool (``draft_pool.mirror_swaps``); nothing
        before the pool exists (no step has written it)."""
        if self.kv is not None:
            self.kv = mirror_swaps(self.kv, self.host_kv, plan, host)

    def head_step(self, params: Any, draft_kv: Any, feats: jax.Array, next_ids: jax.Array,
                  inp: ModelInput, target_params: Any) -> tuple[Any, jax.Array]:  # fmt: skip
        """One head forward over a ragged batch: (draft_kv', g [T, H])."""
        x = embed_tokens(target_params, self.arch, next_ids)
        return self.module.apply({"params": params["head"]}, draft_kv,
                                 feats.astype(jnp.float32), x, inp)  # fmt: skip

    def draft_logits(self, params: Any, target_params: Any,
                     g: jax.Array) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
        """(logits [S, N], vocab int32[N] or None) from head outputs g [S, H]: over the
        draft vocabulary when the head has one (``params["lm"]``), else over the target's
        (vocab None: N = V, ids are positions)."""
        if "lm" in params:
            w = params["lm"]
            return dot_transposed(g.astype(w.dtype), w), params["vocab"]  # 1 row: as 2
        return lm_logits(target_params, self.arch, g), None

    def draft_ids(self, params: Any, target_params: Any, g: jax.Array,
                  draw: Any = None, i: Any = 0) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
        """(drafts int32[S], q float32[S, V] or None) from head outputs g [S, H]: the
        argmax, or with draw (draft_sampling.draft_drawer) draft i's sample and its q."""
        logits, vocab = self.draft_logits(params, target_params, g)
        if draw is not None:
            return draw(i, logits, vocab)
        ids = jnp.argmax(logits, axis=-1)
        return (ids if vocab is None else vocab[ids]).astype(jnp.int32), None

    def _propose(self, params: Any, target_params: Any, draft_kv: Any, feature: jax.Array,
                 tokens: jax.Array, mem: Any, seq_ids: jax.Array, total: jax.Array,
                 counts: jax.Array, sampling: Any = None, output_len: Any = None, *,
                 num_seqs: int) -> tuple:  # fmt: skip
        """draft_kv and tokens donated; seq_ids, total, counts int32[N] in batch-row
        order (first num_seqs used). Writes draft i of row r at total + i, i < counts[r].
        Returns (draft_kv', tokens'); with sampling (SamplingTensors by slot) and
        output_len: sampled drafts, (draft_kv', tokens', q float32[num_seqs, K, V])."""
        self.trace_count[num_seqs] = self.trace_count.get(num_seqs, 0) + 1
        tables = mem.tables.tables
        draft_kv = apply_cow(draft_kv, mem.last_cow.src, mem.last_cow.dst, mem.last_cow.valid)
        sid = seq_ids[:num_seqs]
        row_ok = sid >= 0
        safe = jnp.maximum(sid, 0)
        tot, cnt = total[:num_seqs], counts[:num_seqs]
        n = tokens.shape[0]
        g = feature[safe]  # [S, H]: g_{L-2}
        draw = q = None
        if sampling is not None:
            draw = draft_drawer(sampling, output_len, sid, self.arch.vocab_size)
        d, p0 = self.draft_ids(params, target_params, g, draw, jnp.int32(0))
        if draw is not None:
            q = store(jnp.zeros((num_seqs, self.k, self.arch.vocab_size), jnp.float32), 0, p0,
                      row_ok & (cnt > 0))  # fmt: skip
        tokens = tokens.at[jnp.where(row_ok & (cnt > 0), safe, n), tot].set(d, mode="drop")
        block_tables = jnp.where(row_ok[:, None], tables[safe], 0)

        def body(i, carry):
            draft_kv, tokens, g, d, qd = carry  # qd: the drafts' q
            active = row_ok & (i < cnt)
            pos = jnp.maximum(tot - 2 + i, 0)
            slots = slot_mapping(tables, safe, pos, active, self.block_size)
            # One query per active row, packed first in row order (idle rows: q_len 0).
            q = active.astype(jnp.int32)
            cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q, dtype=jnp.int32)])
            dest = jnp.where(active, cu[:-1], num_seqs)
            pack_i = lambda fill, v: jnp.full((num_seqs,), fill, jnp.int32).at[dest].set(
                v, mode="drop"
            )
            pack_f = lambda v: jnp.zeros_like(v).at[dest].set(v, mode="drop")
            inp = ModelInput(
                tokens=pack_i(0, d), positions=pack_i(0, pos),
                slot_mapping=pack_i(PAD_SLOT, slots), block_tables=block_tables,
                kv_lens=jnp.where(active, pos + 1, 0), cu_q_lens=cu,
                logits_indices=jnp.minimum(cu[:-1], num_seqs - 1),
            )  # fmt: skip
            draft_kv, out = self.head_step(params, draft_kv, pack_f(g), pack_i(0, d), inp,
                                           target_params)  # fmt: skip
            g_new = out[jnp.minimum(cu[:-1], num_seqs - 1)]  # unpack: row r's query
            g = jnp.where(active[:, None], g_new, g)
            nd, probs = self.draft_ids(params, target_params, g_new, draw, i)
            if draw is not None:
                qd = store(qd, i, probs, active)
            tokens = tokens.at[jnp.where(active, safe, n), tot + i].set(nd, mode="drop")
            return draft_kv, tokens, g, jnp.where(active, nd, d), qd

        draft_kv, tokens, _, _, q = jax.lax.fori_loop(1, self.k, body,
                                                      (draft_kv, tokens, g, d, q))  # fmt: skip
        return (draft_kv, tokens) if draw is None else (draft_kv, tokens, q)


class EagleVerifier(SpecVerifier):
    """``SpecVerifier`` whose program also runs the head's catch-up (module docstring).

    step(params, kv, tokens, mem, batch, num_drafts, sampling, prompt_len, output_len,
    head_params, draft_kv, feature, draft_probs=None, parents=None, *, num_tokens,
    num_seqs, drafts=True) -> (kv', tokens', out, accepted, draft_kv', feature'); kv,
    tokens, draft_kv and feature are donated; drafts=False: the catch-up only
    (``SpecVerifier.verify``'s no-draft program); draft_probs: sampled drafts' q,
    parents: draft trees (``SpecVerifier.verify``; the catch-up then reads the accepted
    path's features)."""

    def __init__(self, draft: EagleDraft, *args: Any, tree_features: Any = None):
        super().__init__(*args)
        self.draft = draft
        # eagle_tree.catch_up_inputs with draft trees (passed in: eagle_tree imports this)
        self.tree_features = tree_features
        self.step = jax.jit(
            self._eagle_step,
            static_argnames=("num_tokens", "num_seqs", "drafts"),
            donate_argnames=("kv", "tokens", "draft_kv", "feature"),
        )

    def _forward(self, params: Any, kv: Any, inp: Any) -> tuple[Any, jax.Array, Any]:
        return forward_with_features(params, kv, inp, arch=self.arch,
                                     attention_fn=self.attention_fn,
                                     native_matmul=self.native_matmul)  # fmt: skip

    def _eagle_step(self, params: Any, kv: Any, tokens: jax.Array, mem: Any, batch: Any,
                    num_drafts: jax.Array, slot_sampling: Any, prompt_len: jax.Array,
                    output_len: jax.Array, head_params: Any, draft_kv: Any,
                    feature: jax.Array, draft_probs: Any = None, parents: Any = None, *,
                    num_tokens: int, num_seqs: int, drafts: bool = True) -> tuple:  # fmt: skip
        kv, tokens, out, accepted, aux = self.verify(
            params, kv, tokens, mem, batch, num_drafts, slot_sampling, prompt_len, output_len,
            draft_probs, parents, num_tokens=num_tokens, num_seqs=num_seqs, drafts=drafts,
        )  # fmt: skip
        inp, feats = aux["inp"], aux["extra"]
        if parents is not None:  # trees: each committed position's own feature (eagle_tree.py)
            nd_rows = jnp.where(batch.seq_ids[:num_seqs] >= 0, num_drafts[:num_seqs], 0)
            feats = self.tree_features(inp, feats, aux["path"], nd_rows, num_seqs)
        draft_kv = apply_cow(draft_kv, mem.last_cow.src, mem.last_cow.dst, mem.last_cow.valid)
        seq_ids = batch.seq_ids[:num_seqs]
        row_ok = seq_ids >= 0
        safe = jnp.maximum(seq_ids, 0)
        nd = jnp.where(row_ok, num_drafts[:num_seqs], 0)
        q = jnp.where(row_ok, batch.q_lens[:num_seqs], 0)
        q_eff = q - nd + accepted  # committed positions per row this step
        cu = inp.cu_q_lens
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        row = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
        r = jnp.minimum(row, num_seqs - 1)
        keep = (row < num_seqs) & (t - cu[r] < q_eff[r])
        nxt_pos = jnp.minimum(inp.positions + 1, tokens.shape[1] - 1)
        next_ids = jnp.where(keep, tokens[safe[r], nxt_pos], 0)
        head_inp = inp._replace(slot_mapping=jnp.where(keep, inp.slot_mapping, PAD_SLOT))
        draft_kv, g = self.draft.head_step(head_params, draft_kv, feats, next_ids, head_inp,
                                           params)  # fmt: skip
        last = jnp.clip(cu[:-1] + q_eff - 1, 0, num_tokens - 1)
        n = feature.shape[0]
        upd = row_ok & (q_eff > 0)
        feature = feature.at[jnp.where(upd, safe, n)].set(g[last].astype(feature.dtype),
                                                          mode="drop")  # fmt: skip
        return kv, tokens, out, accepted, draft_kv, feature


__all__ = ["EagleDraft", "EagleVerifier", "check_eagle", "embed_tokens",
           "forward_with_features", "head_kv_bytes_per_token", "lm_logits"]  # fmt: skip
