"""Speculative decoding in the engine step: propose, grow, verify, record, roll back.

``SpeculativeDecoder.run`` replaces the device step of ``LLMEngine._run`` for a step in
which some decode row has proposals (docs/speculative_decoding.md gives the reasons):

1. host: after ``schedule``, each eligible decode row (q_len 1, it emits, its sample
   already has a token, no n > 1 fork pending, not beam search) asks the proposer for
   up to k drafts, capped so the accepted run plus the bonus token never passes the
   sequence's output target (max_tokens, max_model_len), the step's token budget
   (``max_num_batched_tokens``) and the free blocks (no preemption for speculation).
2. device (``_extend``, one jitted call): the drafts go into the token buffer at
   positions ``total .. total + k - 1`` and the rows' block tables grow to
   ``start + 1 + k`` through the memory policy's normal grow (copy-on-write and
   prefix-cache invalidation included); the row's q_len becomes 1 + k.
3. device (``SpecVerifier.step``, one jitted program per (T, S) bucket): the ragged
   forward scores every row, each speculating row at its 1 + k positions; sample and
   accept the longest matching prefix a; write the correction / bonus token.
4. host: record the a + 1 tokens in order with the usual stop checks (EOS, stop ids,
   stop strings, length), so a stop inside an accepted run ends the output there.
   With prefix caching, only blocks full of accepted tokens are registered.
5. device (``_commit``): num_computed and output_len grow by a (``update`` adds the
   usual one), and each row is truncated to ``start + 1 + a`` tokens: blocks wholly
   past it return to the pool (``memory/rollback.py``).

A separate draft checkpoint (``spec_draft_model.py``) runs over every step's batch
between steps 2 and 3 (its own pool, the target's block ids), also in steps that take
the plain path; its pool follows swaps through ``apply_swaps``.

A step with no proposal (or one with prompt-logprob rows) takes the plain path. With
speculation on, the engine runs the one-step path only (no K-step decode loop).
Stats: ``stats()`` (see ``SpecCounters``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import SpeculativeConfig
from pagedjax.engine import admission
from pagedjax.engine.buckets import pick, seqs_for_tokens
from pagedjax.engine.spec.draft_model import (
    DraftCheckpoint,
    SeparateDraft,
    check_draft_source,
    is_separate_draft,
    load_draft,
)
from pagedjax.engine.spec.eagle import EagleDraft, EagleVerifier
from pagedjax.engine.spec.layer_skip import LayerSkipDraft
from pagedjax.engine.spec.ngram import NgramProposer
from pagedjax.engine.spec.verify import SpecVerifier, sampled_offsets
from pagedjax.memory.rollback import truncate_batched

BUILT_METHODS = ("ngram", "draft_model", "eagle")


def check_buildable(config: SpeculativeConfig | None, target_model: str | None = None) -> None:
    """Errors naming what cannot be built, before any loading: NotImplementedError for
    a method not built; ValueError for a layer-skip draft (``draft_num_layers``) of
    another model; FileNotFoundError for a separate draft checkpoint
    (``spec_draft_model.py``) or an eagle head directory that is not there."""
    if config is None:
        return
    if config.method not in BUILT_METHODS:
        raise NotImplementedError(
            f"speculative_config method {config.method!r} is not built yet; built:"
            f" {list(BUILT_METHODS)}"
        )
    if is_separate_draft(config):
        check_draft_source(str(config.model))
    elif config.method == "draft_model" and config.model not in ("self", target_model):
        raise ValueError(
            f"speculative_config draft_num_layers selects a layer-skip draft, the target's"
            f" own first layers (model 'self'); model {config.model!r} is another checkpoint:"
            " drop draft_num_layers to use it as a separate draft"
        )
    if config.method == "eagle" and not Path(str(config.model)).expanduser().is_dir():
        raise FileNotFoundError(
            f"speculative_config model {config.model!r}: no eagle head directory there"
            " (config.json + model.safetensors; `python -m pagedjax.tools.train_eagle`)"
        )


@dataclass
class SpecCounters:
    """Since the last reset. steps: steps that verified proposals; rows: speculating
    rows verified; proposed / accepted: draft tokens verified / accepted; emitted:
    tokens the speculating rows recorded (accepted + corrections / bonus tokens)."""

    steps: int = 0
    rows: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0

    def stats(self) -> dict[str, float | int]:
        """spec_acceptance_rate: accepted / proposed draft tokens.
        spec_mean_accepted_length: tokens per speculating row and step, the bonus
        included (1 + accepted drafts; vLLM's "mean acceptance length").
        spec_proposals_per_step: draft tokens verified per speculating step."""
        return dict(
            spec_steps=self.steps,
            spec_rows=self.rows,
            spec_proposed_tokens=self.proposed,
            spec_accepted_tokens=self.accepted,
            spec_emitted_tokens=self.emitted,
            spec_acceptance_rate=self.accepted / self.proposed if self.proposed else 0.0,
            spec_mean_accepted_length=(self.rows + self.accepted) / self.rows if self.rows else 0.0,
            spec_proposals_per_step=self.proposed / self.steps if self.steps else 0.0,
        )


def _extend(policy: Any, state: Any, tokens: jax.Array, seq_ids: jax.Array, new_lens: jax.Array,
            mask: jax.Array, draft_pos: jax.Array, drafts: jax.Array) -> tuple:  # fmt: skip
    """Grow the masked slots to new_lens (int32[N]) and write drafts (int32[N, K], -1 =
    none) at draft_pos + j. Returns (state', tokens', ok bool[N])."""
    no_wm = jnp.zeros(mask.shape, bool)
    mem, ok = policy.grow(state.mem, seq_ids, new_lens, new_lens, new_lens, mask, no_wm)
    n, k = drafts.shape
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    row = jnp.where(mask[:, None] & (drafts >= 0), seq_ids[:, None], tokens.shape[0])
    tokens = tokens.at[row, draft_pos[:, None] + j].set(drafts, mode="drop")
    return state._replace(mem=mem), tokens, ok


def _commit(block_size: int, state: Any, seq_ids: jax.Array, start: jax.Array,
            accepted: jax.Array, mask: jax.Array) -> Any:  # fmt: skip
    """Masked rows keep a drafts: lengths grow by a (``update`` adds the step's one
    token), tables shrink to start + 1 + a tokens."""
    n = state.num_computed.shape[0]
    ids = jnp.where(mask, seq_ids, n)
    a = jnp.zeros((seq_ids.shape[0],), jnp.int32).at[: accepted.shape[0]].set(accepted)
    mem = state.mem
    pool, tables = truncate_batched(mem.pool, mem.tables, seq_ids, start + 1 + a, mask, block_size)
    return state._replace(
        num_computed=state.num_computed.at[ids].add(a, mode="drop"),
        output_len=state.output_len.at[ids].add(a, mode="drop"),
        mem=mem._replace(pool=pool, tables=tables),
    )


class SpeculativeDecoder:
    """One engine's speculative decoding (see the module docstring).

    config: SpeculativeConfig; the rest as ``ModelRunner`` (the verification program
    and the drafts share the engine's attention backend, block size and native_matmul
    choice) plus the memory policy.
    """

    def __init__(self, config: SpeculativeConfig, arch: Any, block_size: int,
                 attention_fn: Any, max_logprobs: int, policy: Any,
                 draft_checkpoint: DraftCheckpoint | None = None,
                 native_matmul: bool = False):  # fmt: skip
        if not is_separate_draft(config):
            check_buildable(config, config.model)
        elif draft_checkpoint is None:
            raise ValueError("a separate draft_model needs its loaded checkpoint"
                             " (spec_draft_model.load_draft)")  # fmt: skip
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft = self.eagle = self.separate = None
        if draft_checkpoint is not None:  # its own pool, the target's block ids
            self.separate = SeparateDraft(draft_checkpoint, attention_fn, block_size,
                                          policy.num_blocks, policy.num_host_blocks,
                                          native_matmul)  # fmt: skip
        elif config.method == "draft_model":
            n = config.draft_num_layers
            self.draft = LayerSkipDraft(arch, n, attention_fn, block_size, self.k, native_matmul)
        verifier_args = (arch, block_size, attention_fn, max_logprobs, self.k, native_matmul)
        if config.method == "eagle":  # spec_eagle.py: the head runs on every step
            self.eagle = EagleDraft(arch, config.model, attention_fn, block_size, self.k)
            self.verifier = EagleVerifier(self.eagle, *verifier_args)
        else:
            self.verifier = SpecVerifier(*verifier_args)
        self.block_size = block_size
        self.counters = SpecCounters()
        self._extend = jax.jit(functools.partial(_extend, policy), donate_argnums=(0, 1))
        self._commit = jax.jit(functools.partial(_commit, block_size), donate_argnums=(0,))

    def jits(self) -> dict[str, Any]:
        """The jitted functions by name (compile counting)."""
        draft = {} if self.draft is None else {"spec_draft": self.draft.propose}
        if self.eagle is not None:
            draft["spec_eagle_propose"] = self.eagle.propose
        if self.separate is not None:
            draft["spec_draft_model"] = self.separate.propose
        return dict(spec_extend=self._extend, spec_commit=self._commit,
                    spec_verify=self.verifier.step, **draft)  # fmt: skip

    def reset_stats(self) -> None:
        self.counters = SpecCounters()

    def apply_swaps(self, plan: Any, host: dict) -> None:
        """The step's swap copies on a separate draft's or the eagle head's pool
        (``LLMEngine._apply_swaps``; draft_pool.py)."""
        if self.separate is not None:
            self.separate.apply_swaps(plan, host)
        if self.eagle is not None:
            self.eagle.apply_swaps(plan, host)

    def stats(self) -> dict[str, float | int]:
        """``SpecCounters.stats`` plus spec_compilations (this decoder's programs)."""
        compiled = sum(f._cache_size() for f in self.jits().values())
        return self.counters.stats() | {"spec_compilations": compiled}

    def warm_up(self, core: Any, pairs: list[tuple[int, int]]) -> None:
        """Compile the speculative programs for the runner's warm-up pairs (T, S), on
        inputs that change nothing (no row masked, an all-padding batch), with exactly
        the argument types ``run`` passes (jit caches by them)."""
        if not pairs:
            return
        dev, n = core.device, core.max_seqs
        i32, f = np.zeros(n, np.int32), np.zeros(n, bool)
        drafts = np.full((n, self.k), -1, np.int32)
        dev.state, dev.tokens, ok = self._extend(dev.state, dev.tokens, i32, i32, f, i32, drafts)
        _, batch = dev.preview_schedule()  # the pytree schedule returns, zeroed: padding
        batch = jax.tree.map(jnp.zeros_like, batch)
        batch = batch._replace(seq_ids=jnp.full_like(batch.seq_ids, -1))
        ext = batch._replace(q_lens=jnp.asarray(i32), num_tokens=jnp.int32(0), swap=None)
        if self.eagle is not None:
            self.eagle.ensure(core)
        for t, s in pairs:
            mem = dev.state.mem
            mem = mem._replace(last_cow=mem.last_cow._replace(valid=jnp.asarray(f)))
            if self.eagle is not None:
                self._eagle_propose(core, mem, i32, i32, i32, s)
            if self.draft is not None:
                dev.kv, dev.tokens = self.draft.propose(
                    self.draft.params_for(core.params), dev.kv, dev.tokens, mem, i32, i32,
                    i32, num_seqs=s,
                )  # fmt: skip
            if self.separate is not None:
                d = self.separate
                d.kv, dev.tokens = d.propose(d.params, d.kv, dev.tokens, mem,
                                             batch._replace(swap=None), jnp.asarray(i32),
                                             num_tokens=t, num_seqs=s)  # fmt: skip
            acc = self._verify(core, mem, ext, jnp.asarray(i32), t, s)
            dev.state = self._commit(dev.state, i32, i32, acc, jnp.asarray(f))
        jax.block_until_ready((dev.state, ok))

    # ------------------------------------------------------------------ planning

    def _plan(self, engine: Any, host: dict, owners: list) -> np.ndarray:
        """int32[N] drafts per batch row, and the drafts themselves (int32[N, K], -1
        padded), within the budget and the free blocks."""
        core = engine.core
        n, num_seqs = core.max_seqs, int(host["num_seqs"])
        counts = np.zeros(n, np.int32)
        drafts = np.full((n, self.k), -1, np.int32)
        limit = self.config.disable_by_batch_size
        if limit is not None and num_seqs >= limit:
            return counts, drafts
        budget = engine.sched_limits.max_num_batched_tokens - int(host["num_tokens"])
        if budget <= 0:
            return counts, drafts
        free, lengths = jax.device_get((core.device.state.mem.pool.num_free,
                                        core.device.state.mem.tables.lengths))  # fmt: skip
        free = int(free)
        b = self.block_size
        for r in range(num_seqs):
            req, seq = owners[r]
            out = len(seq.detok.ids)
            if not host["emits"][r] or host["q_lens"][r] != 1 or out == 0 or req.pending:
                continue
            if req.host_driven:
                continue
            k = min(self.k, seq.target - out - 1, budget)
            if k <= 0:
                continue
            if any(d is not None for d in (self.draft, self.eagle, self.separate)):  # on device
                prop = [-1] * k
            else:
                prop = self.proposer.propose(req.prompt_token_ids + seq.detok.ids, k)
                k = len(prop)
            start = int(host["start_pos"][r])
            held = int(lengths[int(host["seq_ids"][r])])
            while k > 0:
                need = max(-(-(start + 1 + k) // b) - (-(-held // b)), 0)
                if need <= free:
                    break
                k -= 1
            if k == 0:
                continue
            free -= max(-(-(start + 1 + k) // b) - (-(-held // b)), 0)
            budget -= k
            counts[r] = k
            drafts[r, :k] = prop[:k]
        return counts, drafts

    # ------------------------------------------------------------------ the step

    def _eagle_propose(self, core: Any, mem: Any, sid: Any, total: Any, counts: Any,
                       num_seqs: int) -> None:  # fmt: skip
        e, dev = self.eagle, core.device
        e.kv, dev.tokens = e.propose(e.params, core.params, e.kv, e.feature, dev.tokens, mem,
                                     sid, total, counts, num_seqs=num_seqs)  # fmt: skip

    def _verify(self, core: Any, mem: Any, ext: Any, num_drafts: Any, num_tokens: int,
                num_seqs: int, want_out: bool = False) -> Any:  # fmt: skip
        """The verification program (plus the eagle catch-up); (out, accepted) when
        want_out, else accepted."""
        dev, st = core.device, core.device.state
        args = (core.params, dev.kv, dev.tokens, mem, ext, num_drafts, dev.sampling(),
                st.prompt_len, st.output_len)  # fmt: skip
        kw = dict(num_tokens=num_tokens, num_seqs=num_seqs)
        if self.eagle is None:
            dev.kv, dev.tokens, out, acc = self.verifier.step(*args, **kw)
        else:
            e = self.eagle
            dev.kv, dev.tokens, out, acc, e.kv, e.feature = self.verifier.step(
                *args, e.params, e.kv, e.feature, **kw
            )
        return (out, acc) if want_out else acc

    def run(self, engine: Any, batch: Any, host: dict, touched: dict,
            finished_mask: np.ndarray, recycle_mask: np.ndarray) -> bool:  # fmt: skip
        """The speculative device step and its host half (module docstring); False
        (nothing done) when no row has a proposal: the caller takes the plain path."""
        core, dev = engine.core, engine.core.device
        num_seqs = int(host["num_seqs"])
        seq_ids, emits = host["seq_ids"], host["emits"]
        owners = [core.book.owner(int(seq_ids[r])) for r in range(num_seqs)]
        # The scheduled batch's bucket (the separate draft's forward runs over it).
        sched_tokens = pick(engine.token_buckets, int(host["num_tokens"]))
        sched_seqs = seqs_for_tokens(engine.seq_buckets, sched_tokens)
        if any(
            req.prompt_logprobs is not None and host["start_pos"][r] < len(req.prompt_token_ids)
            for r, (req, _) in enumerate(owners)
        ):
            if self.separate is not None:  # its KV follows every step (spec_draft_model.py)
                self.separate.run(core, batch, np.zeros(core.max_seqs, np.int32),
                                  sched_tokens, sched_seqs)  # fmt: skip
            return False  # prompt logprobs need every token's logits: the plain path
        counts, drafts = self._plan(engine, host, owners)
        if not counts.any() and self.eagle is None:
            if self.separate is not None:  # the draft's forward only (no proposals)
                self.separate.run(core, batch, counts, sched_tokens, sched_seqs)
            return False  # (the eagle head must see every step: spec_eagle.py)
        mask = counts > 0
        start = host["start_pos"].astype(np.int32)
        sid = seq_ids.astype(np.int32)
        dev.state, dev.tokens, ok = self._extend(
            dev.state, dev.tokens, sid, start + 1 + counts, mask, start + 1, drafts
        )
        num_tokens = int(host["num_tokens"]) + int(counts.sum())
        padded_tokens = pick(engine.token_buckets, num_tokens)
        padded_seqs = seqs_for_tokens(engine.seq_buckets, padded_tokens)
        if self.draft is not None:
            dev.kv, dev.tokens = self.draft.propose(
                self.draft.params_for(core.params), dev.kv, dev.tokens,
                dev.state.mem, sid, start + 1, counts, num_seqs=padded_seqs,
            )  # fmt: skip
        if self.separate is not None:  # over the scheduled batch, then the k draft steps
            self.separate.run(core, batch, counts, sched_tokens, sched_seqs)
        if self.eagle is not None:
            self.eagle.ensure(core)
            if counts.any():
                self._eagle_propose(core, dev.state.mem, sid, start + 1, counts, padded_seqs)
        q_ext = (host["q_lens"] + counts).astype(np.int32)
        ext = batch._replace(q_lens=jnp.asarray(q_ext), num_tokens=jnp.int32(num_tokens), swap=None)
        out, accepted = self._verify(core, dev.state.mem, ext, jnp.asarray(counts),
                                     padded_tokens, padded_seqs, want_out=True)  # fmt: skip
        rows = [r for r in range(num_seqs) if emits[r]]
        want_top = any(owners[r][1].logprobs is not None for r in rows)
        fetch = [out.token_ids, out.logprobs, accepted, ok]
        # The tables after the grow: registration may name blocks ``_extend`` handed out.
        tables = dev.state.mem.tables.tables if engine.enable_prefix_caching else None
        fetch += [tables]
        if want_top:
            fetch += [out.ranks, out.top_ids, out.top_logprobs]
        got = jax.device_get(fetch)
        if not bool(np.all(got[3])):  # _plan counted the free blocks: a bug if it fails
            raise RuntimeError("speculative grow failed after planning; blocks miscounted")
        acc = got[2]
        offsets = sampled_offsets(counts, num_seqs)
        eos = core.book.eos
        q_acc = host["q_lens"].copy()
        c = self.counters
        c.steps += int(counts.any())
        for r in rows:
            req, seq = owners[r]
            first = len(seq.detok.ids) == 0
            a = int(acc[r]) if counts[r] else 0
            recorded = 0
            for j in range(a + 1):
                i = int(offsets[r]) + j
                top = (got[5][i], got[6][i], got[7][i]) if want_top else None
                recorded += 1
                if seq.record(int(got[0][i]), float(got[1][i]), top, eos):
                    recycle_mask[seq.slot] = True
                    finished_mask[r] = seq.finish_reason == "stop"
                    break
            if counts[r]:
                c.rows += 1
                c.proposed += int(counts[r])
                c.accepted += a
                c.emitted += recorded
                q_acc[r] = min(1 + a, recorded + 1)
            touched[req.request_id] = req
            if first and req.pending and seq.index == 0:
                engine.fork_samples(req, seq)
        if engine.enable_prefix_caching:
            acc_batch = batch._replace(q_lens=jnp.asarray(q_acc.astype(np.int32)))
            admission.register_blocks(
                core, acc_batch, {**host, "q_lens": q_acc, "tables": got[4]}, owners
            )
        dev.state = self._commit(dev.state, sid, start, accepted, jnp.asarray(mask))
        return True


def build_speculator(config: SpeculativeConfig | None, *args: Any) -> SpeculativeDecoder | None:
    """A SpeculativeDecoder for ``config`` (args as its constructor's), None when off."""
    return None if config is None else SpeculativeDecoder(config, *args)


__all__ = ["SpecCounters", "SpeculativeDecoder", "build_speculator", "check_buildable",
           "load_draft"]  # fmt: skip
