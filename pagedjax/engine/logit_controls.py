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
- structured outputs: the sequence's Guide (pagedjax/structured) fills its grammar mask
  after each accepted token (``SequenceState.record``).

While a slot needs the host, the engine runs one-step programs (the K-step loop reports
"structured_output" in its skipped reasons) and the slot does not speculate, so outputs
equal those of plain decoding (docs/structured_outputs.md says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedjax.config import StructuredOutputsConfig
from pagedjax.engine.jump_forward import JumpForward
from pagedjax.sampling import SamplingParams
from pagedjax.sampling.tensors import mask_words, static_token_mask
from pagedjax.structured import StructuredOutputManager


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
    """True while the sequence's mask changes between steps (see the module docstring)."""
    if seq.guide is not None or req.bad_words_ids:
        return True
    return len(seq.detok.ids) < seq.params.min_tokens and bool(book.stop_ids(seq))


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
                 eos_ids: set[int]):  # fmt: skip
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._all = np.full(mask_words(vocab_size), -1, np.int32)
        self.structured = StructuredOutputManager(config, tokenizer, vocab_size, sorted(eos_ids))
        self.host_steps = 0  # iterations run with a host-masked slot (stats)
        # Jump-forward decoding (engine/jump_forward.py): None when off, so the output
        # processor does no work for it.
        self.jump_forward = JumpForward() if config.jump_forward else None

    def prepare(self, params: SamplingParams) -> tuple[list[list[int]], Any]:
        """(bad words' token ids, compiled constraint or None) of a request's params."""
        words = []
        if params.bad_words:
            words = bad_words_token_ids(self._tokenizer, params.bad_words, self.vocab_size)
        so = params.structured_outputs
        return words, (self.structured.compile(so) if so is not None else None)

    def attach(self, req: Any, prepared: tuple[list[list[int]], Any]) -> None:
        """Give a new request its prepared controls: every sample its own matcher."""
        req.bad_words_ids, compiled = prepared
        if compiled is not None:
            req.structured_backend = compiled.backend
            for seq in req.seqs:
                seq.start_guide(self.structured.guide(compiled), len(self._all))

    def stats(self) -> dict[str, float | int]:
        """structured_host_steps: iterations in which some slot needed host masks (they
        ran as one-step programs, without speculation for those slots);
        structured_compiles, structured_cache_hits, structured_compile_s: compilation;
        jump_forward_jumps, jump_forward_tokens: forced runs appended and their tokens
        (0 with jump_forward off). Counted since the engine started (reset_stats leaves
        them)."""
        s = self.structured.stats
        jf = self.jump_forward.stats() if self.jump_forward is not None else {}
        return dict(jump_forward_jumps=0, jump_forward_tokens=0) | jf | dict(
            structured_host_steps=self.host_steps,
            structured_compiles=s.compiles,
            structured_cache_hits=s.cache_hits,
            structured_compile_s=s.compile_s,
        )

    def write_rows(self, core: Any) -> bool:
        """Before an iteration: each slot with a dynamic control gets its current masks
        (a row whose value did not change is not uploaded again). Returns True when some
        slot needs the host this iteration."""
        book, dev = core.book, core.device
        any_host = False
        for slot, (req, seq) in book.slot_owner.items():
            p = seq.params
            if not (p.min_tokens or req.bad_words_ids or seq.guide is not None):
                continue
            mask = token_mask(book, req, seq, self.vocab_size)
            grammar = seq.grammar_mask if seq.guide is not None else self._all
            if seq.guide is not None and not np.any(mask & grammar):
                # The grammar allows only what min_tokens masks (its end, EOS): the
                # grammar wins, rather than sampling from an empty distribution.
                mask = token_mask(book, req, seq, self.vocab_size, min_tokens=False)
            dev.set_sampling_value("token_mask", slot, mask)
            dev.set_sampling_value("grammar_mask", slot, grammar)
            any_host |= needs_host(book, req, seq)
        self.host_steps += any_host
        return any_host


__all__ = ["LogitControls", "bad_words_token_ids", "clear_bits", "needs_host", "token_mask"]
