"""Speculative drafts under a grammar: check them and give the verification its masks.

A constrained sample may draft (n-gram chains on the host-mask path; engine/spec/
decoder.py). Before verification, ``check_drafts`` walks the sample's matcher through
its draft tokens: a draft the matcher refuses truncates the drafts there (it could never
be sampled under the mask), and after each accepted draft the mask of the tokens allowed
next is filled, one packed row per draft (row j: the mask after drafts[: j + 1], i.e. the
mask of verified position j + 1; position 0 uses the sample's current mask). Then the
matcher is rolled back to where it was: the output processor feeds it the tokens that
are actually accepted (``SequenceState.record``), so after the step it sits at the
accepted prefix, exactly as without speculation.

So each verified position is sampled under the mask of the grammar state after the
drafts before it; where those drafts are accepted (they equal the target's own tokens)
that is the state plain decoding would have there, so outputs (tokens, logprobs, seeded
samples) equal those without speculation.

A draft after which nothing is allowed (the grammar's end, after EOS) is dropped too: the
position after it would have an empty mask; so is any draft once the matcher has stopped.
Cost per drafting row and step: k accepts, k mask fills and one rollback on the host
(~3-8 us per token with xgrammar on SmolLM2's vocabulary, docs/structured_outputs.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The most drafts a constrained row gets per step (the reasoning gate's rollback depth,
# manager.py).
MAX_DRAFTS = 64


def check_drafts(guide: Any, drafts: list[int] | np.ndarray, current: np.ndarray,
                 out: np.ndarray) -> int:
    """How many leading ``drafts`` the guide (a manager.Guide, at the sample's current
    state) accepts, their masks in ``out`` int32[>= len(drafts), W] (row j: the mask after
    drafts[: j + 1]). current int32[W]: the guide's mask now (``SequenceState.
    grammar_mask``). A draft is tried only where the mask before it allows it (llguidance
    turns a refused token into an error state rollback cannot undo). The guide is rolled
    back to its state on entry."""
    n, before = 0, current
    for tok in map(int, drafts):
        # A stopped matcher takes no more tokens: llguidance "accepts" EOS there without
        # a rollback entry (so it could not be undone); nothing follows the end anyway.
        if not (int(before[tok >> 5]) >> (tok & 31)) & 1 or guide.is_terminated():
            break
        if not guide.accept(tok):
            break
        row = out[n]
        row.fill(0)
        guide.fill_mask(row)
        if not row.any():  # nothing allowed after it: the row would sample from nothing
            guide.rollback(1)
            break
        n, before = n + 1, row
    if n:
        guide.rollback(n)
    return n


__all__ = ["MAX_DRAFTS", "check_drafts"]
