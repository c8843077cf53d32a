"""llguidance (vLLM's "guidance" backend): constraints become llguidance grammar text,
validated at compile time; one LLMatcher per sequence fills the packed bitmask.

Kinds as vLLM's guidance backend serializes them: JSON schemas (json_object as
``{"type": "object"}``) with ``whitespace_flexible`` unless disable_any_whitespace,
regexes, choices, grammars (Lark, or GBNF / EBNF converted to Lark). Structural tags are
xgrammar's format: refused here (backend "auto" sends them to xgrammar).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pagedjax.sampling.params import StructuredOutputsParams
from pagedjax.structured import spec


class _ByteVocab:
    """The byte tokenizer as llguidance's TokenizerWrapper expects it."""

    def __init__(self, vocab_size: int, eos: int):
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [
            f"<|special_{i}|>".encode() for i in range(256, vocab_size)
        ]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


class GuidanceGuide:
    """One sequence's matcher state (the ``Guide`` protocol of manager.py)."""

    backend = "guidance"

    def __init__(self, matcher: Any, fill: Any):
        self._m = matcher
        self._fill = fill

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(int(token))) and not self._m.is_error()

    def fill_mask(self, out: np.ndarray) -> None:
        """out int32[W]: the tokens allowed next (written in place)."""
        self._fill(self._m, out.reshape(1, -1), 0)

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def jump_forward(self) -> list[int]:
        """Accept the tokens the grammar forces next (llguidance's ``compute_ff_tokens``:
        the forced bytes as tokens, a last token a longer one could extend left out) and
        return them in order; [] when nothing is forced. ``try_consume_tokens`` takes the
        prefix the matcher accepts (the matcher ends past it). The mask is not refilled."""
        m = self._m
        if m.is_stopped() or m.is_error():
            return []
        forced = [int(t) for t in m.compute_ff_tokens()]
        return forced[: m.try_consume_tokens(forced)] if forced else []


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int], max_rollback: int):
        import llguidance  # the manager turns an ImportError into its install hint
        import llguidance.numpy

        self._llg = llguidance
        self._fill = llguidance.numpy.fill_next_token_bitmask
        eos = eos_ids[0] if eos_ids else vocab_size - 1
        hf = getattr(tokenizer, "hf_tokenizer", None)
        if hf is not None:
            import llguidance.hf

            self._tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        elif type(tokenizer).__name__ == "ByteTokenizer":
            wrapper = llguidance.TokenizerWrapper(_ByteVocab(vocab_size, eos))
            self._tok = llguidance.LLTokenizer(wrapper)
        else:
            raise ValueError(
                "structured outputs need a Hugging Face or byte tokenizer, got"
                f" {type(tokenizer).__name__}"
            )

    def compile(self, p: StructuredOutputsParams, any_whitespace: bool,
                disable_additional: bool) -> str:  # fmt: skip
        """The validated llguidance grammar text; ValueError naming the problem."""
        llg = self._llg
        try:
            if p.json is not None or p.json_object:
                schema = spec.schema_dict(p, disable_additional)
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), defaults={"whitespace_flexible": any_whitespace}
                )
            elif p.regex is not None:
                grammar = llg.grammar_from("regex", p.regex)
            elif p.choice is not None:
                grammar = llg.grammar_from("choice", json.dumps(list(p.choice)))
            elif p.grammar is not None:
                grammar = llg.grammar_from("lark" if spec.looks_like_lark(p.grammar)
                                           else "grammar", p.grammar)  # fmt: skip
            else:
                raise ValueError("structural_tag is xgrammar's format (use backend 'xgrammar')")
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"invalid {p.kind} for guidance: {e}") from e
        err = llg.LLMatcher.validate_grammar(grammar, self._tok)
        if err and not err.startswith("WARNING"):
            raise ValueError(f"invalid {p.kind} for guidance: {err.strip().splitlines()[0]}")
        return grammar

    def guide(self, compiled: str) -> GuidanceGuide:
        m = self._llg.LLMatcher(self._tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(f"guidance matcher: {m.get_error()}")
        return GuidanceGuide(m, self._fill)


__all__ = ["GuidanceBackend", "GuidanceGuide"]
