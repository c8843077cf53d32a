"""Jump-forward decoding (SGLang's; ``StructuredOutputsConfig.jump_forward``, off by default).

Where a constrained sample's grammar admits exactly one continuation (the fixed keys and
punctuation of a JSON schema, e.g. ``", "name": "``), its tokens are appended to the
output at once instead of being decoded one step each:

1. host, in the output processor, right after a sample's sampled token is recorded and
   its matcher advanced: ``Guide.jump_forward()`` accepts the forced tokens (xgrammar's
   ``find_jump_forward_tokens``, llguidance's ``compute_ff_tokens``: the forced text as
   the vocabulary's tokens, a last token that a longer one could extend left out) and
   ``SequenceState.record_forced`` appends them as output tokens (text, stop strings,
   stop ids and ``max_tokens`` checked after each; logprob 0.0) and refills the mask.
2. device, after the step's ``update`` (``OutputProcessor.finish``): one
   ``DeviceState.append_outputs`` writes them into the slots' token-buffer rows and adds
   them to ``output_len``, their KV not computed, so the next ``schedule`` gives the slot
   ``1 + k`` tokens (its sampled token and the k forced ones) as one chunk, exactly as a
   prefill chunk or a preempted sequence's recompute is scheduled; the chunk's last
   position is sampled under the mask that follows the forced tokens. The budget may
   split the chunk over steps like any prefill.

A forced run that finishes the sample (a stop string, ``max_tokens``) finishes it in the
same step: the row goes into update's stop mask and nothing is written to the device.

Cost: nothing when off (the processor holds None). On: one matcher query per recorded
constrained token, and one small jitted write in steps where some sample jumped.

Composes with n > 1 (each sample has its own matcher), prefix caching, preemption (the
forced tokens are output tokens: a recompute prefills them, a swap keeps them) and
speculative decoding (constrained rows never get drafts; a jumping row's chunk runs in
whichever program the step runs, as a prefill chunk does); tests/test_structured_outputs.py
checks each against decoding without jump-forward. Beam search takes no constraint. The first output
token is always sampled (a jump is looked for after each sampled token only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedjax.engine.device_state import padding_bucket


@dataclass
class PendingJump:
    """Forced tokens appended on the host in this step, for the device: ``tokens`` go at
    buffer positions ``position`` .. of ``slot``'s row."""

    slot: int
    position: int
    tokens: list[int]


class JumpForward:
    """Per engine (held by ``LogitControls`` when the config turns it on). Counters:
    ``jumps`` (times a sample was extended), ``tokens`` (forced tokens appended)."""

    def __init__(self) -> None:
        self.jumps = 0
        self.tokens = 0

    def extend(self, pending: list[PendingJump], req: Any, seq: Any, eos_ids: set[int]) -> bool:
        """After ``seq``'s sampled token was recorded (it did not finish, seq.guide is set):
        append what its grammar forces. Returns True when that finished the sample (then
        nothing is pending for the device); else the tokens, if any, join ``pending``."""
        forced = seq.guide.jump_forward()
        if not forced:
            return False
        before = len(seq.detok.ids)
        n = seq.record_forced(forced, eos_ids)
        self.jumps += 1
        self.tokens += n
        if seq.finish_reason is not None:
            return True
        pending.append(PendingJump(seq.slot, len(req.prompt_token_ids) + before, forced[:n]))
        return False

    def write(self, device: Any, pending: list[PendingJump]) -> None:
        """Write this step's forced tokens to the device (after its ``update``): one
        ``append_outputs`` over [max_seqs] rows, the token width padded to a power of two
        >= 16 (a few compiled sizes)."""
        n = device.max_seqs
        width = padding_bucket(max(16, max(len(p.tokens) for p in pending)), 1 << 30)
        slots = np.zeros(n, np.int32)
        positions = np.zeros(n, np.int32)
        counts = np.zeros(n, np.int32)
        tokens = np.zeros((n, width), np.int32)
        for i, p in enumerate(pending):
            slots[i], positions[i], counts[i] = p.slot, p.position, len(p.tokens)
            tokens[i, : len(p.tokens)] = p.tokens
        device.append_outputs(slots, positions, tokens, counts)

    def stats(self) -> dict[str, int]:
        return dict(jump_forward_jumps=self.jumps, jump_forward_tokens=self.tokens)


__all__ = ["JumpForward", "PendingJump"]
