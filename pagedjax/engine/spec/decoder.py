"""Speculative decoding in the engine step: plan, schedule, verify, record, roll back.

Speculation is part of the scheduled batch (docs/speculative_decoding.md gives the
reasons), as vLLM's scheduler reserves lookahead slots:

1. host, before ``schedule`` (``plan``): each decoding slot (it has a token, no n > 1
   fork pending, not beam search) asks for k speculative slots, capped so the accepted
   run plus the token sampled after it never passes its output target; the n-gram
   proposer's drafts are known here. k is num_speculative_tokens, or the batch-size
   table's k for this batch (vLLM's num_speculative_tokens_per_batch_size), cut per row
   by the automatic rule when on (``k_schedule.py``: measured acceptance and step cost,
   down to 0: a plain step).
2. device, ``schedule(state, lookahead)``: a RUNNING decode row gets 1 + k tokens
   within the step's token budget, its blocks grown (and others preempted) like any
   token's; ``batch.spec_lens`` says how many drafts each row got (maybe fewer).
3. device (``run``): the drafts go into the token buffer (a drafting model writes its
   own there: layer-skip, a separate checkpoint, the EAGLE head, Medusa heads), then the
   verification program (one per (T, S) bucket) scores every row at all its positions,
   samples and accepts the longest matching prefix a, and writes the correction /
   bonus token; sampled drafts (``draft_sample_method="probabilistic"``) are verified by
   rejection sampling instead (``draft_sampling.py``).
4. host: the engine's output processor records the a + 1 tokens in order with the usual
   stop checks, so a stop inside an accepted run ends the output there; with prefix
   caching only blocks full of accepted tokens are registered.
5. device, ``update(..., accepted)``: lengths grow by 1 + a, and rows with rejected
   drafts are truncated through the memory policy (``PagedPolicy.truncate``: blocks
   wholly past the accepted length return to the pool, memory/rollback.py).

Draft trees (``speculative_config.tree``, pagedjax's own key; ``tree.py``): a row's drafts
are the nodes of a tree (parents by slot, ``_parents``, set by ``plan`` for ``run``):
n-gram tries (``ngram_tree.py``) or EAGLE's top-k-then-chains (``eagle_tree.py``),
verified with the tree mask, the accepted path's KV compacted in the same program.
EAGLE-2's dynamic tree (``tree.dynamic``) has the same depths, so ``_parents`` keeps the
static layout for the host (levels: the automatic rule, counters) and the verification
reads the parents its proposal program returned (scattered back to batch rows).
With the automatic rule a tree is cut by whole levels (``k_schedule.allocate_levels``;
n-gram tries laid out breadth-first so kept levels are a prefix of the nodes).

A separate draft checkpoint runs over every step's batch (its own pool, the target's
block ids), also in plain steps; its pool and the EAGLE head's follow swaps through
``apply_swaps``. A step without drafts takes the plain program (the EAGLE head and
Medusa heads, whose features must follow every step, verify always: no proposal then,
only the head's catch-up; their proposals run on the drafting rows only, packed). While
a request wanting prompt logprobs holds a slot nobody speculates. With a drafting model the
engine runs the one-step path only (the n-gram method also drafts inside the fused
K-step program). Stats: ``stats()`` (see ``SpecCounters``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import SpeculativeConfig
from pagedjax.engine.buckets import pick, seqs_for_tokens
from pagedjax.engine.host_arrays import filled_like, upload, zeros_like_tree
from pagedjax.engine.logit_controls import grammar_drafts, needs_host
from pagedjax.engine.spec.draft_model import (
    DraftCheckpoint,
    SeparateDraft,
    check_draft_source,
    is_separate_draft,
    load_draft,
)
from pagedjax.engine.spec.eagle import EagleDraft, EagleVerifier
from pagedjax.engine.spec.eagle3 import Eagle3Draft, Eagle3Verifier
from pagedjax.engine.spec.eagle_tree import EagleTreeDraft, branch_parents, catch_up_inputs
from pagedjax.engine.spec.k_schedule import (
    Acceptance,
    StepCost,
    allocate,
    allocate_levels,
    batch_size_lookup,
    bfs_order,
    choose_with_refresh,
    node_levels,
)
from pagedjax.engine.spec.layer_skip import LayerSkipDraft
from pagedjax.engine.spec.medusa import MedusaDraft, build_medusa
from pagedjax.engine.spec.ngram import NgramProposer
from pagedjax.engine.spec.ngram_tree import NgramTreeProposer
from pagedjax.engine.spec.tree import check_tree_model
from pagedjax.engine.spec.verify import SpecVerifier, sampled_rows, write_drafts
from pagedjax.structured.drafts import MAX_DRAFTS, check_drafts

BUILT_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa")


def head_rows(rows: int, bucket: int) -> int:
    """The rows a Medusa proposal runs on: the next power of two >= ``rows``, at most the
    sequence ``bucket`` (so a handful of program sizes below each bucket)."""
    return min(bucket, 1 << max(rows - 1, 0).bit_length())


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
    heads = ("eagle", "eagle3", "medusa")
    if config.method in heads and not Path(str(config.model)).expanduser().is_dir():
        raise FileNotFoundError(
            f"speculative_config model {config.model!r}: no {config.method} head directory"
            f" there (config.json + model.safetensors; `python -m pagedjax.tools.train_"
            f"{config.method}`)"
        )


@dataclass
class SpecCounters:
    """Since the last reset. steps: steps that verified proposals; rows: speculating
    rows verified; proposed / accepted: draft tokens verified / accepted; emitted:
    tokens the speculating rows recorded (accepted + corrections / bonus tokens)."""

    steps: int = 0
    fused_steps: int = 0  # of the steps, those run inside the fused K-step program
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
            spec_fused_steps=self.fused_steps,
            spec_rows=self.rows,
            spec_proposed_tokens=self.proposed,
            spec_accepted_tokens=self.accepted,
            spec_emitted_tokens=self.emitted,
            spec_acceptance_rate=self.accepted / self.proposed if self.proposed else 0.0,
            spec_mean_accepted_length=(self.rows + self.accepted) / self.rows if self.rows else 0.0,
            spec_proposals_per_step=self.proposed / self.steps if self.steps else 0.0,
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
        # Draft trees (tree.py, ngram_tree.py): K, the static node width, is the budget;
        # num_speculative_tokens bounds the depth. Parents by slot, set by plan for run.
        self.tree, self.tree_proposer, self._parents = config.tree, None, None
        self.eagle_tree: EagleTreeDraft | None = None
        if config.tree is not None:
            check_tree_model(arch)
            self.tree_proposer = NgramTreeProposer(config.prompt_lookup_min,
                                                   config.prompt_lookup_max,
                                                   config.tree.budget, config.tree.top_k)
            self.k = config.tree.budget
            if config.method in ("eagle", "eagle3"):  # eagle_tree.py: whole levels of branches
                b = config.tree.top_k
                self.k = b * min(config.num_speculative_tokens, config.tree.budget // b)
        self.draft = self.eagle = self.separate = None
        self.medusa: MedusaDraft | None = None
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
            self.verifier = EagleVerifier(self.eagle, *verifier_args,
                                          tree_features=catch_up_inputs)  # fmt: skip
            if config.tree is not None:
                self.eagle_tree = EagleTreeDraft(self.eagle, config.tree.top_k, self.k,
                                                 config.tree.dynamic)  # fmt: skip
        elif config.method == "eagle3":  # spec/eagle3.py: the eagle path, fused features
            self.eagle = Eagle3Draft(arch, config.model, attention_fn, block_size, self.k)
            # Trees as EAGLE's (eagle_tree.py drives any EagleDraft: the head fed its own g
            # at draft positions); the catch-up remaps the fused [T, 3H] features the same.
            self.verifier = Eagle3Verifier(self.eagle, *verifier_args,
                                           tree_features=catch_up_inputs)  # fmt: skip
            if config.tree is not None:
                self.eagle_tree = EagleTreeDraft(self.eagle, config.tree.top_k, self.k)
        elif config.method == "medusa":  # spec/medusa.py: k capped at the heads' count
            self.medusa, self.verifier = build_medusa(
                arch, str(config.model), self.k, lambda k: (*verifier_args[:4], k, native_matmul)
            )  # fmt: skip
            self.k = self.medusa.k
        else:
            self.verifier = SpecVerifier(*verifier_args)
        self.block_size = block_size
        # Sampled drafts (draft_sampling.py) for the drafting models; n-gram drafts have
        # no q (point masses) and keep sample-and-compare, as vLLM treats them.
        self.probabilistic = config.draft_sample_method == "probabilistic" and not self.host_drafts
        self.vocab_size = arch.vocab_size
        self._zero_q: dict[int, Any] = {}  # S -> zeros [S, K, V]: a step without drafts
        self.counters = SpecCounters()
        self._write = jax.jit(write_drafts, donate_argnums=(0,))
        # k per step (k_schedule.py): vLLM's batch-size table, pagedjax's automatic rule.
        self.acceptance: Acceptance | None = None  # sized on first plan (max_seqs)
        self.cost = StepCost()
        self.k_history: list[int] = []  # drafts planned per step (most recent last, <= 64)
        self._rows: np.ndarray | None = None  # slots of the verified step's batch rows
        self._drafted = False  # whether the last ``run`` had rows with drafts (observe)
        # Constrained rows' drafts (structured/drafts.py): by slot, the grammar's mask
        # after each draft (int32[max_seqs, K, W], allocated on first use) and which
        # slots planned such drafts this step.
        self._grammar_masks: np.ndarray | None = None
        self._constrained: np.ndarray | None = None

    def step_k(self, batch_size: int) -> int:
        """Drafts per row allowed for a step of ``batch_size`` sequences: k, or the
        batch-size table's entry (vLLM's num_speculative_tokens_per_batch_size)."""
        table = self.config.num_speculative_tokens_per_batch_size
        if table is None:
            return self.k
        return int(batch_size_lookup(table, max(batch_size, 1), self.k)[max(batch_size, 1)])

    def observe(self, bucket: tuple[int, int], seconds: float) -> None:
        """A step's wall time from dispatch to its tokens on the host (the engine's
        ``_run``: drafting programs included) by key (drafts, T, S), drafts: whether ``run``
        had rows with drafts. Not "whether it verified": a head method (EAGLE, Medusa)
        runs its verification program, for the head's catch-up, on a step without drafts
        too, and the rule's cost(0) must be what such a step costs that method."""
        if self.config.auto_num_speculative_tokens:
            self.cost.observe((self._drafted, *bucket), seconds)

    def jits(self) -> dict[str, Any]:
        """The jitted functions by name (compile counting)."""
        draft = {} if self.draft is None else {"spec_draft": self.draft.propose}
        if self.eagle is not None:
            draft["spec_eagle_propose"] = self.eagle.propose
        if self.eagle_tree is not None:
            draft["spec_eagle_tree_propose"] = self.eagle_tree.propose
            draft["spec_eagle_tree_parents"] = self.eagle_tree.scatter
        if self.medusa is not None:
            draft["spec_medusa_propose"] = self.medusa.propose
        if self.separate is not None:
            draft["spec_draft_model"] = self.separate.propose
        return dict(spec_write=self._write, spec_verify=self.verifier.step, **draft)

    def reset_stats(self) -> None:
        self.counters = SpecCounters()

    def apply_swaps(self, plan: Any, host: dict) -> None:
        """The step's swap copies on a separate draft's or the eagle head's pool
        (``swap_copies.apply_swap_copies``; draft_pool.py)."""
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
        inputs that change nothing (an all-padding batch, no row with drafts), with
        exactly the argument types ``run`` passes (jit caches by them)."""
        if not pairs:
            return
        dev, n = core.device, core.max_seqs
        i32, f = np.zeros(n, np.int32), np.zeros(n, bool)
        _, batch = dev.preview_schedule()  # the pytree schedule returns, zeroed: padding
        batch = zeros_like_tree(batch)  # host-built (host_arrays.py), same placement
        batch = batch._replace(seq_ids=filled_like(batch.seq_ids, -1), swap=None)
        dev.write_tokens(self._write, np.full(n, -1, np.int32), i32,
                         np.full((n, self.k), -1, np.int32))  # fmt: skip
        if self.eagle is not None:
            self.eagle.ensure(core)
        if self.medusa is not None:
            self.medusa.ensure(core)
        for t, s in pairs:
            mem = dev.state.mem
            mem = mem._replace(last_cow=mem.last_cow._replace(valid=upload(f)))
            if self.eagle is not None:  # every head_rows size (_packed_rows)
                for rows in sorted({head_rows(n, s) for n in range(1, s + 1)}):
                    _, par = self._eagle_propose(core, mem, i32, i32, i32, rows)
                    if par is not None:
                        self._rows_parents(par, np.zeros(0, np.int32), n)
            if self.medusa is not None:
                for rows in sorted({head_rows(n, s) for n in range(1, s + 1)}):
                    self._medusa_propose(core, i32, i32, i32, rows)
            if self.draft is not None:
                dev.run_program(self.draft.propose, self.draft.params_for(core.params), mem,
                                i32, i32, i32, *self._sampling_args(core),
                                num_seqs=s)  # fmt: skip
            if self.separate is not None:
                self.separate.run(core, batch, i32, t, s, mem=mem, num_drafts=self._q_k)
            out = self._verify(core, mem, batch, upload(i32), t, s, self._no_q(s),
                               self._row_parents(n))  # fmt: skip
            if self.every_step:  # its steps without drafts
                out = self._catch_up(core, mem, batch, upload(i32), t, s)
        jax.block_until_ready((dev.state, out))

    @property
    def _q_k(self) -> int:
        """K of the drafts' q (sampled drafts), 0 without."""
        return self.k if self.probabilistic else 0

    def _sampling_args(self, core: Any) -> tuple:
        """The propose programs' extra arguments for sampled drafts: (sampling tensors by
        slot, output_len by slot), or () for greedy drafts."""
        if not self.probabilistic:
            return ()
        return core.device.sampling(), core.device.state.output_len

    def _no_q(self, num_seqs: int) -> Any:
        """The verification's draft_probs when no draft was sampled: None for greedy
        drafts, else zeros [S, K, V] (one program per bucket either way)."""
        if not self.probabilistic:
            return None
        if num_seqs not in self._zero_q:
            zeros = np.zeros((num_seqs, self.k, self.vocab_size), np.float32)
            self._zero_q[num_seqs] = upload(zeros)
        return self._zero_q[num_seqs]

    # ------------------------------------------------------------------ planning

    def plan(self, core: Any) -> tuple[np.ndarray, np.ndarray]:
        """Before ``schedule``: (lookahead int32[max_seqs], drafts int32[max_seqs, K])
        by slot. A slot gets k > 0 speculative slots when its sequence decodes (it has
        a token; no n > 1 fork pending; not beam search), capped so the accepted run
        plus the token sampled after it never passes its output target; the scheduler
        then budgets them (``schedule``'s ``lookahead``: token budget, blocks, maybe
        fewer). The n-gram proposer's drafts are known here; a drafting model's are
        computed on device after the schedule (-1 here). No slot speculates while a
        request wanting prompt logprobs holds a slot (they need every logits row of
        the plain step) or when ``disable_by_batch_size`` slots are taken. A slot whose
        mask changes per token (``logit_controls.needs_host``) gets none, except a
        constrained row whose only such control is its host grammar, with n-gram chain
        drafts: its drafts are checked against the grammar (``_grammar_drafts``). A
        device FSM row drafts by any method, chains or trees (the verification walks its
        FSM along each node's path, whoever made the drafts)."""
        n = core.max_seqs
        lookahead = np.zeros(n, np.int32)
        drafts = np.full((n, self.k), -1, np.int32)
        owners = core.book.slot_owner
        self._constrained = None
        if not self.may_speculate(core):
            return self._planned(lookahead, drafts)
        k_step = self.step_k(len(owners))  # may_speculate: > 0
        on_device = not self.host_drafts
        if self.tree is not None:
            self._parents = np.full((n, self.k), -1, np.int32)
            k_step = min(k_step, self.config.num_speculative_tokens)  # the depth
        rows = []  # (slot, req, seq, k: its depth cap, constrained)
        for slot, (req, seq) in owners.items():
            out = len(seq.detok.ids)
            if out == 0 or req.pending or req.host_driven or seq.finish_reason is not None:
                continue
            constrained = False
            if core.controls is not None and needs_host(core.book, req, seq):
                # Its mask changes with each token: no drafts (logit_controls.py), unless
                # the mask is its grammar's and the drafts are host chains.
                constrained = self.fusable and grammar_drafts(core.controls, core.book, req, seq)
                if not constrained:
                    continue
            k = min(k_step, seq.target - out - 1, MAX_DRAFTS if constrained else k_step)
            if k > 0:
                rows.append((slot, req, seq, k, constrained))
        auto = self._auto_key(core) if self.config.auto_num_speculative_tokens else None
        if auto is not None and rows:
            caps = np.zeros(n, np.int32)
            caps[[r[0] for r in rows]] = [r[3] for r in rows]
            if not self._auto_may_draft(core, auto, caps):
                return self._planned(lookahead, drafts)
        for slot, req, seq, k, constrained in rows:
            out = len(seq.detok.ids)
            if self.eagle_tree is not None:  # whole levels first, within max_model_len
                room = core.max_model_len - len(req.prompt_token_ids) - out
                k = min(self.eagle_tree.b * min(k, self.eagle_tree.levels), room)
                self._parents[slot, :k] = branch_parents(self.eagle_tree.b, k)
            elif self.tree is not None:  # nodes past max_model_len would have no slot
                ids = req.prompt_token_ids + seq.detok.ids
                k = self._plan_tree(slot, ids, seq.params, k, core.max_model_len - len(ids),
                                    drafts)  # fmt: skip
            elif not on_device:
                prop = self.proposer.propose(req.prompt_token_ids + seq.detok.ids, k)
                if constrained and len(prop):
                    prop = prop[: self._grammar_drafts(core, slot, seq, prop)]
                k = len(prop)
                drafts[slot, :k] = prop
            lookahead[slot] = k
        if auto is not None:
            self._auto(core, auto, lookahead, drafts)
        return self._planned(lookahead, drafts)

    def _grammar_drafts(self, core: Any, slot: int, seq: Any, prop: Any) -> int:
        """A constrained slot's drafts checked against its grammar (structured/drafts.py):
        how many stand; their masks kept by slot for ``run``."""
        n = core.max_seqs
        if self._grammar_masks is None:
            words = core.controls.mask_words
            self._grammar_masks = np.full((n, self.k, words), -1, np.int32)
        if self._constrained is None:
            self._constrained = np.zeros(n, bool)
        self._constrained[slot] = True
        return check_drafts(seq.guide, prop, seq.grammar_mask, self._grammar_masks[slot])

    def _plan_tree(self, slot: int, ids: list[int], params: Any, depth: int, room: int,
                   drafts: np.ndarray) -> int:  # fmt: skip
        """A slot's draft tree (ngram_tree.py) into drafts / self._parents; its node count.
        A penalised row gets the chain proposal (a chain's token history is exact; a
        tree node's would hold its off-path siblings)."""
        penalised = (params.presence_penalty != 0 or params.frequency_penalty != 0
                     or params.repetition_penalty != 1)  # fmt: skip
        if penalised:
            toks = self.proposer.propose(ids, min(depth, self.k))
            pars = list(range(-1, len(toks) - 1))
        else:
            toks, pars = self.tree_proposer.propose_tree(ids, depth, room)
            if self.config.auto_num_speculative_tokens:  # levels as prefixes (_auto)
                order, pars, _ = bfs_order(pars)
                toks = [toks[i] for i in order]
        drafts[slot, : len(toks)] = toks
        self._parents[slot, : len(toks)] = pars
        return len(toks)

    def _auto_key(self, core: Any) -> Any:
        """The automatic rule's cost key of this step with m drafts (or tree nodes):
        key(m) -> (m > 0, T, S), the bucket the batch plus its drafts would take. Binds
        each slot's acceptance to its sequence first."""
        owners = core.book.slot_owner
        if self.acceptance is None:
            self.acceptance = Acceptance(core.max_seqs)
        for slot, (_, seq) in owners.items():
            self.acceptance.bind(slot, id(seq))
        base, largest = len(owners), core.token_buckets[-1]

        def key(m: int) -> tuple[bool, int, int]:
            t = pick(core.token_buckets, min(base + m, largest))
            return (m > 0, t, seqs_for_tokens(core.seq_buckets, t))

        return key

    def _auto_may_draft(self, core: Any, key: Any, caps: np.ndarray) -> bool:
        """Whether the automatic rule can draft at all this step, before any proposal:
        the rule (key: ``_auto_key``'s) on chains of each row's depth cap (caps
        int32[max_seqs] by slot), the
        most any proposal could give for its node count (each level one node, every
        level filled; a real proposal's gain for n nodes is at most this, its cost the
        same). So when this allocates nothing, the rule would allocate nothing whatever
        the proposals, and ``plan`` skips them: the n-gram search over 64 rows' token
        lists was ~4 % of a 64-row step (a trie: 0.33 s of 7.2 s, cProfile) on steps
        where the rule drafted nothing."""
        live = np.flatnonzero(caps)
        alpha, base = self.acceptance.alpha(live), len(core.book.slot_owner)
        chains = choose_with_refresh(lambda cost: allocate(alpha, caps[live], base, cost),
                                     key, self.cost)  # fmt: skip
        return bool(chains.sum())

    def _auto(self, core: Any, key: Any, lookahead: np.ndarray, drafts: np.ndarray) -> None:
        """pagedjax's automatic rule (k_schedule.allocate), in place: each row's k cut
        to the allocation from its acceptance and the measured cost of the step (key:
        ``_auto_key``'s, made once per ``plan``)."""
        live = np.flatnonzero(lookahead)
        if not live.size:
            return
        base = len(core.book.slot_owner)
        alpha, caps = self.acceptance.alpha(live), lookahead[live].copy()
        # Trees by levels: breadth-first nodes, so depths 1 .. d are a prefix (k_schedule).
        depth = [] if self.tree is None else [node_levels(self._parents[s, :c])
                                              for s, c in zip(live, caps, strict=True)]
        widths = [np.bincount(d, minlength=int(d.max()) + 1)[1:] for d in depth]

        def choose(cost: Any) -> np.ndarray:  # drafts (chain) or nodes (tree) per live row
            if self.tree is None:
                return allocate(alpha, caps, base, cost)
            keep = allocate_levels(alpha, widths, base, cost)
            return np.array([int((d <= n).sum()) for d, n in zip(depth, keep, strict=True)])

        lookahead[live] = choose_with_refresh(choose, key, self.cost)
        if self.tree is not None:
            self._parents[np.arange(self.k)[None, :] >= lookahead[:, None]] = -1
        drafts[np.arange(self.k)[None, :] >= lookahead[:, None]] = -1

    def _planned(self, lookahead: np.ndarray, drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.k_history = (self.k_history + [int(lookahead.max(initial=0))])[-64:]
        return lookahead, drafts

    @property
    def host_drafts(self) -> bool:
        """Its drafts are made on the host by ``plan`` (the n-gram method, chain or tree)."""
        return all(d is None for d in (self.draft, self.eagle, self.separate, self.medusa))

    @property
    def every_step(self) -> bool:
        """Its state follows every step (the EAGLE / EAGLE-3 head's KV and features, Medusa's
        features), so a step without drafts still runs its verifier (the no-draft program)
        instead of the plain one."""
        return self.eagle is not None or self.medusa is not None

    @property
    def fusable(self) -> bool:
        """Its drafts can be made inside the fused K-step program (the n-gram chain method:
        ``ngram_device.py``); drafting models and trees take the one-step path."""
        return self.host_drafts and self.tree is None

    def loop_k(self, core: Any) -> int:
        """Drafts per row at most in a fused K-step dispatch (``decode_loop``'s spec_k):
        the batch-size table's k when the step may speculate, else 0. The automatic rule
        does not run inside the loop (its drafts are planned on device)."""
        return self.step_k(len(core.book.slot_owner)) if self.may_speculate(core) else 0

    def may_speculate(self, core: Any) -> bool:
        """The conditions on the whole step (``plan``): no slot holder wants prompt
        logprobs, fewer than ``disable_by_batch_size`` slots are taken."""
        owners = core.book.slot_owner
        limit = self.config.disable_by_batch_size
        if limit is not None and len(owners) >= limit:
            return False
        if self.step_k(len(owners)) == 0:  # the batch-size table says: a plain step
            return False
        return not any(req.prompt_logprobs is not None for req, _ in owners.values())

    # ------------------------------------------------------------------ the step

    def _eagle_propose(self, core: Any, mem: Any, sid: Any, total: Any, counts: Any,
                       num_seqs: int) -> tuple[Any, Any]:  # fmt: skip
        """The head's proposals: (their q (sampled drafts) or None, the dynamic tree's
        parents int32[num_seqs, K] in the proposal's row order, or None)."""
        e = self.eagle
        extra = self._sampling_args(core)
        if self.eagle_tree is not None:  # eagle_tree.py: greedy trees only
            def propose_tree(tokens: Any) -> tuple[Any, Any]:
                kv, tokens, *par = self.eagle_tree.propose(e.params, core.params, e.kv,
                                                           e.feature, tokens, mem, sid, total,
                                                           counts, num_seqs=num_seqs)  # fmt: skip
                return tokens, (kv, par[0] if par else None)

            e.kv, parents = core.device.with_tokens(propose_tree)
            return None, parents

        def propose(tokens: Any) -> tuple[Any, Any]:
            kv, tokens, *q = e.propose(e.params, core.params, e.kv, e.feature, tokens, mem,
                                       sid, total, counts, *extra, num_seqs=num_seqs)  # fmt: skip
            return tokens, (kv, q[0] if q else None)

        e.kv, q = core.device.with_tokens(propose)
        return q, None

    def _rows_parents(self, packed: Any, live: np.ndarray, n: int) -> Any:
        """The dynamic tree's parents from the packed proposal rows (packed row i: batch
        row live[i]) to batch-row order, int32[n, K], rows without drafts -1 (as
        ``_row_parents`` gives the host's)."""
        index = np.full(packed.shape[0], n, np.int32)
        index[: live.size] = live
        return self.eagle_tree.scatter(packed, upload(index), rows=n)

    def _packed_rows(self, core: Any, sid: np.ndarray, total: np.ndarray, spec: np.ndarray,
                     padded_seqs: int, propose: Any) -> tuple[Any, Any]:  # fmt: skip
        """A head's proposals (EAGLE, Medusa) for the drafting rows only, packed first
        into a ``head_rows`` program: propose(seq_ids, total, counts, num_seqs) -> (q or
        None, parents or None). A row's proposal reads only its own slot's feature, head
        KV and block table (and samples with its slot's key), so packing changes nothing
        in it: with the automatic rule keeping a few of 64 rows, the head's layer steps
        and draft LM heads run on those few. Returns (sampled drafts' q in batch-row order
        [S, K, V] or None, the dynamic tree's parents in batch-row order [max_seqs, K] or
        None)."""
        live = np.flatnonzero(spec)
        packed = [np.full(core.max_seqs, fill, np.int32) for fill in (-1, 0, 0)]
        for arr, src in zip(packed, (sid, total, spec), strict=True):
            arr[: live.size] = src[live]
        q, par = propose(*packed, head_rows(live.size, padded_seqs))
        if par is not None:
            par = self._rows_parents(par, live.astype(np.int32), core.max_seqs)
        if q is None:
            return None, par
        full = jnp.zeros((padded_seqs, *q.shape[1:]), q.dtype)
        return full.at[upload(live.astype(np.int32))].set(q[: live.size]), par

    def _medusa_propose(self, core: Any, sid: Any, total: Any, counts: Any,
                        num_seqs: int) -> Any:  # fmt: skip
        """The heads' proposals; their q (sampled drafts) or None."""
        m, extra = self.medusa, self._sampling_args(core)

        def propose(tokens: Any) -> tuple[Any, Any]:
            tokens, *q = m.propose(m.params, m.feature, tokens, sid, total, counts, *extra,
                                   num_seqs=num_seqs)  # fmt: skip
            return tokens, (q[0] if q else None)

        return core.device.with_tokens(propose), None

    def _verify(self, core: Any, mem: Any, batch: Any, num_drafts: Any, num_tokens: int,
                num_seqs: int, draft_probs: Any = None, parents: Any = None,
                grammar_masks: Any = None, drafts: bool = True) -> Any:  # fmt: skip
        """The verification program (plus the eagle catch-up); (out, accepted). parents:
        the trees' parents by batch row (int32[max_seqs, K]) with a tree config, None for
        chains. grammar_masks: constrained rows' per-position masks (int32[max_seqs, K,
        W], batch rows; n-gram chains only, so the plain verifier). drafts=False: a head
        method's step without drafts (num_drafts all 0, no q, parents or masks), the
        bucket's no-draft program (``SpecVerifier.verify``: S sampled rows, not S (K + 1))."""
        dev, st = core.device, core.device.state
        args = (mem, batch, num_drafts, dev.sampling(), st.prompt_len, st.output_len)
        kw = dict(num_tokens=num_tokens, num_seqs=num_seqs)
        if not drafts:
            kw["drafts"] = False
        if self.medusa is not None:
            m = self.medusa
            out, acc, m.feature = dev.run_program(self.verifier.step, core.params, *args,
                                                  m.feature, draft_probs, **kw)  # fmt: skip
        elif self.eagle is None:
            tree = () if parents is None else (parents,)
            if grammar_masks is not None:
                kw["grammar_masks"] = grammar_masks
            out, acc = dev.run_program(self.verifier.step, core.params, *args, draft_probs,
                                       *tree, **kw)  # fmt: skip
        else:
            e = self.eagle
            tree = () if parents is None else (parents,)
            out, acc, e.kv, e.feature = dev.run_program(
                self.verifier.step, core.params, *args, e.params, e.kv, e.feature, draft_probs,
                *tree, **kw,
            )  # fmt: skip
        return out, acc

    def run(self, core: Any, batch: Any, host: dict, drafts: np.ndarray, buckets: Any,
            plain_rows: bool) -> tuple[Any, Any] | None:  # fmt: skip
        """The step's device program when speculating: write the drafts the scheduler
        gave slots to (``host["spec_lens"]``, batch-row order), let a drafting model
        propose them, verify every row (one program per (T, S) bucket). Returns the
        sampler's output packed by ``verify.sampled_offsets`` and accepted int32[S], on
        device; None when the plain program is to run (no row has drafts and the head
        need not see the step, or ``plain_rows``: a row needs every logits row).
        buckets(num_tokens) -> (T, S). A separate draft's forward follows every step."""
        dev = core.device
        spec = host["spec_lens"].astype(np.int32)
        base_tokens = int(host["num_tokens"]) - int(spec.sum())
        sched_tokens, sched_seqs = buckets(base_tokens)  # the batch without its drafts
        base = batch._replace(q_lens=batch.q_lens - batch.spec_lens)
        self._drafted = bool(spec.any())
        if plain_rows or (not spec.any() and not self.every_step):
            if spec.any():
                raise RuntimeError("drafts were scheduled for a step that cannot verify them")
            if self.separate is not None:  # the draft's forward only (no proposals)
                self.separate.run(core, base, spec, sched_tokens, sched_seqs,
                                  num_drafts=self._q_k)  # fmt: skip
            return None
        sid = host["seq_ids"].astype(np.int32)
        self._rows = sid  # count(): the batch rows' slots (per-slot acceptance)
        start = host["start_pos"].astype(np.int32)
        padded_tokens, padded_seqs = buckets(int(host["num_tokens"]))
        row_drafts = np.full((core.max_seqs, self.k), -1, np.int32)
        live = np.flatnonzero(spec)
        row_drafts[live] = drafts[sid[live]]
        row_drafts[np.arange(self.k)[None, :] >= spec[:, None]] = -1
        if live.size and self.host_drafts:  # else all -1: a no-op dispatch (models draft later)
            dev.write_tokens(self._write, sid, start + 1, row_drafts)
        q = None  # the sampled drafts' q, [S, K, V] in batch-row order
        dyn_parents = None  # the dynamic tree's parents (device), batch-row order
        if self.draft is not None:
            rest = dev.run_program(self.draft.propose, self.draft.params_for(core.params),
                                   dev.state.mem, sid, start + 1, spec,
                                   *self._sampling_args(core), num_seqs=padded_seqs)  # fmt: skip
            q = rest[0] if rest else None
        if self.separate is not None:  # over the scheduled batch, then the k draft steps
            q = self.separate.run(core, base, spec, sched_tokens, sched_seqs,
                                  num_drafts=self._q_k)  # fmt: skip
            if q is not None and q.shape[0] != padded_seqs:  # its own (smaller) S bucket
                q = jnp.pad(q[:padded_seqs], ((0, max(padded_seqs - q.shape[0], 0)), (0, 0),
                                              (0, 0)))  # fmt: skip
        if self.eagle is not None:
            self.eagle.ensure(core)
            if spec.any():
                q, dyn_parents = self._packed_rows(
                    core, sid, start + 1, spec, padded_seqs,
                    lambda *a: self._eagle_propose(core, core.device.state.mem, *a))
        if self.medusa is not None:
            self.medusa.ensure(core)
            if spec.any():
                # The heads' vocabulary projections cost rows x heads x H x V: run them
                # on the drafting rows, packed, not the whole sequence bucket (at batch 1
                # the bucket's 16 rows cost 3x the target's own step).
                q, _ = self._packed_rows(core, sid, start + 1, spec, padded_seqs, lambda *a:
                                         self._medusa_propose(core, *a))
        if not live.size:  # a head's catch-up only
            return self._catch_up(core, dev.state.mem, batch._replace(swap=None), upload(spec),
                                  padded_tokens, padded_seqs)  # fmt: skip
        if q is None:
            q = self._no_q(padded_seqs)
        # The dynamic tree's parents are the device's (data); the host's static layout
        # only gave depths (plan, _auto, count): the same by construction.
        parents = (self._row_parents(core.max_seqs, sid, live) if dyn_parents is None
                   else dyn_parents)  # fmt: skip
        masks = None
        held = live[self._constrained[sid[live]]] if self._constrained is not None else live[:0]
        if held.size:
            # Batch-row order, the bucket's S rows (the verification reads rows < S); only
            # this step's constrained rows (a slot's old masks may be another owner's).
            rows = np.full((padded_seqs, *self._grammar_masks.shape[1:]), -1, np.int32)
            rows[held] = self._grammar_masks[sid[held]]
            masks = upload(rows)
        return self._verify(core, dev.state.mem, batch._replace(swap=None), upload(spec),
                            padded_tokens, padded_seqs, q, parents, masks)  # fmt: skip

    def _catch_up(self, core: Any, mem: Any, batch: Any, num_drafts: Any, num_tokens: int,
                  num_seqs: int) -> Any:  # fmt: skip
        """A head method's step without drafts (num_drafts all 0): (out, accepted). Where
        the bucket has more tokens than sequences (T > S: prefill chunks), its no-draft
        program, which samples S rows instead of min(T, S (K + 1)) (``SpecVerifier.verify``
        drafts=False; a 64-row prefill paid +29 % for the LM head and sampler on the extra
        rows); where T = S (decode buckets) the two sizes are equal, so the chain
        verification itself, with no drafts, and no second program: each XLA:CPU program
        maps a few hundred memory regions, and an EAGLE engine already holds ~23k of
        Linux's default 65,530 (``vm.max_map_count``; several engines in one process ran
        out)."""
        if sampled_rows(num_tokens, num_seqs, self.k) > sampled_rows(num_tokens, num_seqs, 0):
            return self._verify(core, mem, batch, num_drafts, num_tokens, num_seqs, drafts=False)
        return self._verify(core, mem, batch, num_drafts, num_tokens, num_seqs,
                            self._no_q(num_seqs))  # fmt: skip

    def _row_parents(self, n: int, sid: np.ndarray | None = None,
                     live: np.ndarray | None = None) -> Any:  # fmt: skip
        """The trees' parents by batch row, int32[n, K] uploaded (rows without a tree: -1);
        None without a tree config."""
        if self.tree is None:
            return None
        rows = np.full((n, self.k), -1, np.int32)
        if live is not None and self._parents is not None:
            rows[live] = self._parents[sid[live]]
        return upload(rows)

    def count(self, spec_lens: np.ndarray, accepted: np.ndarray, recorded: np.ndarray) -> None:
        """Counters of one verified step: per batch row, drafts verified, accepted and
        tokens recorded (the output processor stops a row at its stop)."""
        c, rows = self.counters, np.flatnonzero(spec_lens)
        c.steps += int(rows.size > 0)
        c.rows += int(rows.size)
        c.proposed += int(spec_lens[rows].sum())
        c.accepted += int(accepted[rows].sum())
        c.emitted += int(recorded[rows].sum())
        if self.acceptance is not None and self._rows is not None:
            slots, drafts = self._rows[: len(spec_lens)], np.asarray(spec_lens)
            if self.tree is not None and self._parents is not None:  # levels verified
                drafts = np.array([node_levels(self._parents[s, :n]).max(initial=0)
                                   for s, n in zip(slots, drafts, strict=True)])  # fmt: skip
            self.acceptance.record(slots, drafts, np.asarray(accepted))
        self._rows = None


def build_speculator(config: SpeculativeConfig | None, *args: Any) -> SpeculativeDecoder | None:
    """A SpeculativeDecoder for ``config`` (args as its constructor's), None when off."""
    return None if config is None else SpeculativeDecoder(config, *args)


__all__ = ["SpecCounters", "SpeculativeDecoder", "build_speculator", "check_buildable",
           "load_draft"]  # fmt: skip
