"""The host half of the logit controls and structured outputs: what each sequence may
sample next, written into its slot's sampling row before a step.

Static controls (allowed_token_ids, logit_bias) enter the slot's row once, when the slot
is bound (``SamplingTensors.from_params``), and work in every program, the fused K-step
loop and speculative verification included. Dynamic ones change with each accepted
token and need the host between steps (``needs_host``):

- min_tokens: the sequence's stop ids (EOS unless ignore_eos, and stop_token_ids) are
  masked while it has fewer than min_tokens output tokens (vLLM's MinTokens processor).
- bad_words: each word's token sequences (``bad_words_token_ids``: vLLM's rule, with and
  without a leading space); a sequence's last token is masked when the tokens before it
  were just generated (vLLM's apply_bad_words over the output tokens).
- structured outputs: the sequence's Guide (pagedjax/structured) takes each accepted
  token (``SequenceState.record``) and fills its grammar mask for the next step. The
  one-step path fills it while the device runs the step's forward (``fill_masks``,
  ``LLMEngine._run``: the forward and the sampling as two programs, vLLM's
  ``execute_model`` / ``sample_tokens`` split), so the host's grammar work and the
  mask's upload hide behind the device where the data allows; ``write_rows`` writes a
  slot's grammar row before the step only where it must read the mask then (min_tokens,
  bad words) or the mask is already filled.

With ``StructuredOutputsConfig.device_fsm``, a regex, choice or (xgrammar's, non-
recursive) JSON-schema constraint becomes a token DFA on the device instead
(structured/token_fsm.py, structured/json_regex.py): the slot's sampling row carries its
state (``fsm_state``), every such constraint's table is one shared table
(``token_fsm.combine``), and the step masks and advances the state itself. Such a slot
does not need the host between steps (the fused K-step loop runs it) and drafts by any
method, chains or trees, n-gram or a drafting model: its verification samples each draft
position under the FSM's state after that position's path (``sampler.fsm_walk``). Which
path each constrained sample took is counted (``structured_device_fsm`` /
``structured_host_masks``) and logged.

Reasoning models (``reasoning_parser``, structured/reasoning.py): a constrained sample
whose prompt did not end the reasoning runs unconstrained until its output ends with
``</think>``'s ids: on the host path its guide is a ``GatedGuide`` (an all-ones mask, no
grammar advance, no forced tokens); on the device FSM path its row has no FSM state (-1)
and needs the host while the gate is open, then starts at the FSM's initial state.

While a slot needs the host, the engine runs one-step programs (the K-step loop reports
"structured_output" in its skipped reasons) and the slot does not speculate, so outputs
equal those of plain decoding (docs/structured_outputs.md says why); except a slot whose
only per-token control is its host grammar (``grammar_drafts``): with n-gram chain
drafts it speculates, its drafts checked against the grammar and each verified position
masked with the grammar's state after the drafts before it (structured/drafts.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedjax.config import StructuredOutputsConfig
from pagedjax.engine.jump_forward import JumpForward
from pagedjax.engine.sequence import MaskFills
from pagedjax.sampling import SamplingParams
from pagedjax.sampling.tensors import mask_words, static_token_mask
from pagedjax.structured import StructuredOutputManager
from pagedjax.structured.token_fsm import TokenFsm, combine

log = logging.getLogger(__name__)


def bad_words_token_ids(tokenizer: Any, words: Sequence[str], vocab_size: int) -> list[list[int]]:
    """Each bad word's token ids as vLLM derives them: the word (left-stripped) encoded
    without special tokens, plus the encoding of " " + word when it starts with another
    token and has the same length (the word in the middle of a text). ValueError for an id
    outside the vocabulary or a word that encodes to nothing."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words: {word!r} encodes to no tokens")
        out.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    bad = sorted({t for ids in out for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(
            f"bad_words give token ids {bad} outside the vocabulary [0, {vocab_size})"
        )
    return out


def needs_host(book: Any, req: Any, seq: Any) -> bool:
    """True while the sequence's mask changes between steps (see the module docstring);
    a device FSM row in its reasoning too (the host finds the end tag and starts the FSM)."""
    if seq.guide is not None or req.bad_words_ids or seq.in_reasoning:
        return True
    return len(seq.detok.ids) < seq.params.min_tokens and bool(book.stop_ids(seq))


def grammar_drafts(controls: Any, book: Any, req: Any, seq: Any) -> bool:
    """True when the sequence's only per-token control is its grammar on the host (no
    bad words, min_tokens reached, no device FSM, jump-forward off): it may draft, its
    drafts checked against the grammar (structured/drafts.py, spec/decoder.py)."""
    if seq.guide is None or seq.fsm is not None or req.bad_words_ids:
        return False
    if controls.jump_forward is not None:
        return False  # forced tokens are appended after the step: not a draft's place
    return len(seq.detok.ids) >= seq.params.min_tokens or not book.stop_ids(seq)


def clear_bits(mask: np.ndarray, ids: Any) -> None:
    """Clear token ids' bits in an int32[W] packed mask, in place."""
    words = mask.view(np.uint32)
    for t in ids:
        words[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))


def token_mask(book: Any, req: Any, seq: Any, vocab_size: int,
               min_tokens: bool = True) -> np.ndarray:  # fmt: skip
    """int32[W]: allowed_token_ids, minus the stop ids before min_tokens (unless
    ``min_tokens`` is False), minus the bad words' last tokens whose prefixes the output
    just ended with."""
    p = seq.params
    mask = static_token_mask(p, vocab_size).copy()
    out = seq.detok.ids
    if min_tokens and len(out) < p.min_tokens:
        clear_bits(mask, book.stop_ids(seq))
    for word in req.bad_words_ids:
        prefix = word[:-1]
        if len(prefix) <= len(out) and (not prefix or out[-len(prefix):] == prefix):
            clear_bits(mask, word[-1:])
    return mask


class LogitControls:
    """Per engine: prepares each request's dynamic controls at add_request (bad words'
    ids, the compiled constraint; ValueError before any engine state changes) and writes
    the slots' dynamic masks before each iteration."""

    def __init__(self, vocab_size: int, tokenizer: Any, config: StructuredOutputsConfig,
                 eos_ids: set[int], platform: str = "cpu"):  # fmt: skip
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self.mask_words = mask_words(vocab_size)  # W of the packed masks
        self._all = np.full(self.mask_words, -1, np.int32)
        self.structured = StructuredOutputManager(config, tokenizer, vocab_size, sorted(eos_ids))
        self.host_steps = 0  # iterations run with a host-masked slot (stats)
        # Fill grammar masks while the forward runs (config: "auto" is off on the CPU).
        overlap = config.overlap_mask_fill
        self.overlap_mask_fill = platform != "cpu" if overlap == "auto" else bool(overlap)
        # Slots whose grammar row write_rows left for fill_masks (their seq), this step.
        self._unwritten: dict[int, Any] = {}
        # Grammar mask fills (SequenceState.fill_pending_mask: every one, at start, in
        # write_rows, a speculative plan or fill_masks) and their host seconds; of those
        # seconds, the ones spent while the step's forward had been dispatched
        # (overlapped), and of those the ones of steps whose forward was still running
        # after the last fill (hidden: a lower bound, fills that outlasted the forward
        # count as not hidden at all).
        self.mask_fills = MaskFills()
        self.mask_fill_overlapped_s = 0.0
        self.mask_fill_hidden_s = 0.0
        # Jump-forward decoding (engine/jump_forward.py): None when off, so the output
        # processor does no work for it.
        self.jump_forward = JumpForward() if config.jump_forward else None
        # The device FSM's shared table: the constraints it holds (ids -> first row). It
        # is rebuilt (fsm_version + 1) only when a slot's constraint is not in it, so
        # states stay valid across programs while constraints only leave.
        self.fsm_version = 0
        self._fsm_offsets: dict[int, int] = {}
        self._fsm_held: list[TokenFsm] = []

    def prepare(self, params: SamplingParams,
                fsm: bool = True) -> tuple[list[list[int]], Any, Any]:  # fmt: skip
        """(bad words' token ids, compiled constraint or None, its device FSM or None)
        of a request's params (the FSM only with device_fsm on and a constraint that
        may take it; see ``_device_fsm``). fsm=False: no FSM is built (a front end's
        validation only)."""
        words = []
        if params.bad_words:
            words = bad_words_token_ids(self._tokenizer, params.bad_words, self.vocab_size)
        so = params.structured_outputs
        if so is None:
            return words, None, None
        compiled = self.structured.compile(so)  # validates it (a ValueError: refused)
        return words, compiled, self._device_fsm(params, compiled.backend) if fsm else None

    def _device_fsm(self, params: SamplingParams, backend: str) -> Any:
        """The TokenFsm for this request, a reason string (host path), or None (off)."""
        cfg = self.structured.config
        if not cfg.device_fsm:
            return None
        if cfg.jump_forward:
            return "jump_forward needs the host matcher"
        for name in ("min_tokens", "bad_words"):
            if getattr(params, name):
                return f"{name} needs host masks"
        return self.structured.device_fsm(params.structured_outputs, backend)

    def attach(self, req: Any, prepared: tuple[list[list[int]], Any, Any]) -> None:
        """Give a new request its prepared controls: every sample its own matcher, or
        its own device FSM state."""
        req.bad_words_ids, compiled, fsm = prepared
        if compiled is None:
            return
        req.structured_backend = compiled.backend
        stats = self.structured.stats
        if isinstance(fsm, TokenFsm):
            req.structured_path = "device_fsm"
            stats.device_fsm += len(req.seqs)
            log.debug("request %s: device FSM (%d states x %d token classes, %d bytes)",
                      req.request_id, *fsm.table.shape, fsm.nbytes)  # fmt: skip
            for seq in req.seqs:
                # In reasoning (structured/reasoning.py) the row has no FSM state (-1:
                # unconstrained) until its gate closes (SequenceState.record).
                seq.reasoning = self.structured.reasoning_gate(req.prompt_token_ids)
                seq.fsm, seq.fsm_state = fsm, -1 if seq.reasoning else fsm.initial
            return
        req.structured_path = "host_masks" if fsm is None else f"host_masks: {fsm}"
        if fsm is not None:
            stats.host_masks += len(req.seqs)
            stats.fsm_fallbacks[fsm] = stats.fsm_fallbacks.get(fsm, 0) + 1
            log.info("request %s: host masks, not the device FSM: %s", req.request_id, fsm)
        for seq in req.seqs:
            seq.start_guide(self.structured.guide(compiled, req.prompt_token_ids), len(self._all),
                            self.mask_fills)  # fmt: skip
            if seq.dead_end:
                raise ValueError("structured_outputs: the constraint allows no token at its"
                                 " start (no token of the vocabulary can begin it)")

    def stats(self) -> dict[str, float | int]:
        """structured_host_steps: iterations in which some slot needed host masks (they
        ran as one-step programs, without speculation for those slots);
        structured_compiles, structured_cache_hits, structured_compile_s: compilation;
        jump_forward_jumps, jump_forward_tokens: forced runs appended and their tokens
        (0 with jump_forward off); structured_mask_fills, structured_mask_fill_s: grammar
        masks filled on the host and their seconds, structured_mask_fill_overlapped_s the
        part filled while the step's forward ran, structured_mask_fill_hidden_s the part
        of that which ended before the forward did (``fill_masks``; hidden / fill_s is
        the share hidden; seconds, so replicas' counters add up).
        Counted since the engine started (reset_stats leaves them)."""
        s = self.structured.stats
        jf = self.jump_forward.stats() if self.jump_forward is not None else {}
        return dict(jump_forward_jumps=0, jump_forward_tokens=0) | jf | dict(
            structured_device_fsm=s.device_fsm,
            structured_host_masks=s.host_masks,
            structured_fsm_fallbacks=sum(s.fsm_fallbacks.values()),
            structured_fsm_build_s=s.fsm_build_s,
            structured_host_steps=self.host_steps,
            structured_compiles=s.compiles,
            structured_cache_hits=s.cache_hits,
            structured_compile_s=s.compile_s,
            structured_mask_fills=self.mask_fills.fills,
            structured_mask_fill_s=self.mask_fills.seconds,
            structured_mask_fill_overlapped_s=self.mask_fill_overlapped_s,
            structured_mask_fill_hidden_s=self.mask_fill_hidden_s,
        )

    def write_rows(self, core: Any) -> bool:
        """Before an iteration: each slot with a dynamic control gets its current masks
        (a row whose value did not change is not uploaded again). Returns True when some
        slot needs the host this iteration."""
        book, dev = core.book, core.device
        any_host = False
        self._unwritten = {}
        self._write_fsm_rows(book, dev)
        for slot, (req, seq) in book.slot_owner.items():
            p = seq.params
            if not (p.min_tokens or req.bad_words_ids or seq.guide is not None
                    or seq.in_reasoning):
                continue
            any_host |= needs_host(book, req, seq)
            if req.bad_words_ids or len(seq.detok.ids) < p.min_tokens:
                grammar = seq.grammar_mask if seq.guide is not None else self._all
                mask = token_mask(book, req, seq, self.vocab_size)
                if seq.guide is not None and not np.any(mask & grammar):
                    # The grammar allows only what min_tokens masks (its end, EOS): the
                    # grammar wins, rather than sampling from an empty distribution.
                    mask = token_mask(book, req, seq, self.vocab_size, min_tokens=False)
                dev.set_sampling_value("token_mask", slot, mask)
            else:  # nothing dynamic left in it: the static mask, unchanged once written
                dev.set_sampling_value("token_mask", slot, static_token_mask(p, self.vocab_size))
                if seq.guide is not None and seq.mask_pending:
                    # Written by ``fill_masks`` once filled (while the forward runs).
                    self._unwritten[slot] = seq
                    continue
                grammar = seq.grammar_mask if seq.guide is not None else self._all
            dev.set_sampling_value("grammar_mask", slot, grammar)
        self.host_steps += any_host
        return any_host

    def step_fills(self, dev: Any, owners: list, rows: list[int], *,
                   can_overlap: bool) -> Any:  # fmt: skip
        """The step's grammar rows that ``write_rows`` left (``pending_masks``): a
        callback ``after(logits)`` that fills them once the forward was dispatched
        (``DeviceState.run_step``; overlap_mask_fill on and a plain step: can_overlap),
        or None, having filled them now."""
        pending = self.pending_masks(owners, rows)
        if pending and self.overlap_mask_fill and can_overlap:
            return functools.partial(self.fill_masks, dev, pending)
        if pending:
            self.fill_masks(dev, pending)
        return None

    def pending_masks(self, owners: list, rows: list[int]) -> list[tuple[int, Any]]:
        """(slot, seq) of the step's emitting rows whose grammar row ``write_rows`` left
        unwritten, its mask not filled then (it may have been read, so filled, since)."""
        if not self._unwritten:  # no grammar row waits (the common step): no scan
            return []
        seqs = [owners[r][1] for r in rows]
        return [(seq.slot, seq) for seq in seqs if self._unwritten.get(seq.slot) is seq]

    def fill_masks(self, dev: Any, pending: list[tuple[int, Any]],
                   running: Any = None) -> None:  # fmt: skip
        """Fill the pending grammar masks and write them into their slots' sampling rows
        (uploaded with the next ``dev.sampling()``). running: a device array of the
        program dispatched before the fills (the step's logits), or None when nothing
        runs beside them; the fill time counts as hidden when it is still not ready
        after the last fill."""
        before = self.mask_fills.seconds
        for slot, seq in pending:
            dev.set_sampling_value("grammar_mask", slot, seq.grammar_mask)
            del self._unwritten[slot]
        dt = self.mask_fills.seconds - before
        if running is not None:
            self.mask_fill_overlapped_s += dt
            if not running.is_ready():
                self.mask_fill_hidden_s += dt

    def _write_fsm_rows(self, book: Any, dev: Any) -> None:
        """The device FSM slots' states, and the shared table when one of their
        constraints is not in it (kept, not emptied, when none is left: no new program)."""
        fsms = {id(seq.fsm): seq.fsm for _, seq in book.slot_owner.values() if seq.fsm is not None}
        if not fsms:
            return
        if not fsms.keys() <= self._fsm_offsets.keys():  # a constraint not in the table
            key = tuple(sorted(fsms))
            table, class_of, offsets = combine([fsms[k] for k in key])
            dev.set_fsm_tables(table, class_of)
            self._fsm_offsets = dict(zip(key, offsets, strict=True))
            self._fsm_held = list(fsms.values())  # held: their ids stay theirs
            self.fsm_version += 1
        for slot, (_, seq) in book.slot_owner.items():
            if seq.fsm is not None:
                state = seq.fsm_state  # -1 (in reasoning): no FSM row, unconstrained
                dev.set_sampling_value("fsm_state", slot, self._fsm_offsets[id(seq.fsm)]
                                       + state if state >= 0 else -1)  # fmt: skip


__all__ = ["LogitControls", "bad_words_token_ids", "clear_bits", "grammar_drafts", "needs_host",
           "token_mask"]  # fmt: skip
