"""M-RoPE positions in the paged engine (Qwen2-VL): a per-slot rotary offset for the steps
that carry no image positions.

A Qwen2-VL prompt with images has 3-D rotary positions (model/vision/qwen2_vl.py's
``mrope_positions``): image tokens take (t, row, col) grid positions and the text after
an image resumes at the image's start + max(rows, cols), so from the image on a token's
rotary position is not its index. Two cases, two mechanisms:

* Steps that hold prompt tokens of a request with images (its prefill, any chunk of
  it, a recompute after preemption) are image steps already (multimodal.py's
  ``step_inputs`` returns ``mm``); the host writes every token's [3] position into an
  int32[3, T] array that rides in ``mm`` (``ModelInput.rope_positions``). A chunk
  sliced anywhere is a slice of the request's host array; tokens past the prompt (a
  recompute's generated tokens) get index + delta.
* Every other step (decode, the fused K-step loop, text-only requests): the three rows
  are equal, index + delta(request), delta = last prompt position + 1 - prompt length
  (transformers' ``rope_deltas``; 0 without images). Equal rows make M-RoPE plain RoPE,
  so this is a per-row offset of the 1-D positions: ``RopeDeltas`` keeps int32
  [max_seqs] on the device, one delta per scheduler slot, set when a request takes a
  slot (``EngineCore.take_slot``), and the step reads it from the parameter tree under
  ``ROPE_DELTAS`` (as LoRA's per-slot adapter ids ride there), so the one-step and the
  K-step programs need no new argument.

Why this way: text models' programs are untouched (no key, no ``rope_positions``: the
same jit signature and trace), and Qwen2-VL's decode steps stay the warmed-up programs
(no per-step host positions). Not built with it: LoRA (both would own the parameter
tree's extras), beam search (its beams take slots outside ``take_slot``), speculative
decoding and tensor parallelism (refused for every image model).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pagedjax.engine.host_arrays import upload

# The parameter tree's key of the per-slot rotary offsets (int32 [max_seqs]).
ROPE_DELTAS = "mrope_seq_deltas"


def split_rope_deltas(params: Any) -> tuple[Any, jax.Array | None]:
    """(the model's parameters, the per-slot M-RoPE deltas or None): the tree without
    ``ROPE_DELTAS``, so the model never sees a key it has no module for."""
    if isinstance(params, dict) and ROPE_DELTAS in params:
        return {k: v for k, v in params.items() if k != ROPE_DELTAS}, params[ROPE_DELTAS]
    return params, None


class RopeDeltas:
    """Each scheduler slot's M-RoPE delta (module docstring). ``bind(slot, request)`` on
    slot assignment; ``params(tree)`` puts the deltas into a step parameter tree (one
    small upload after a change)."""

    def __init__(self, max_seqs: int):
        self.deltas = np.zeros(max_seqs, np.int32)
        self._dev: jax.Array | None = None

    def bind(self, slot: int, request: Any) -> None:
        """Scheduler slot ``slot`` now runs ``request`` (its multi_modal prompt's delta, 0
        for a text request)."""
        mm = request.multi_modal
        value = 0 if mm is None else mm.rope_delta
        if self.deltas[slot] != value:
            self.deltas[slot] = value
            self._dev = None

    def params(self, params: Any) -> Any:
        """``params`` (with or without deltas) carrying the current ones."""
        if self._dev is None:
            self._dev = upload(self.deltas.copy())  # a copy: the mirror changes in place
        return {**split_rope_deltas(params)[0], ROPE_DELTAS: self._dev}


def step_positions(owners: list, host: dict, num_tokens: int) -> np.ndarray:
    """int32[3, T] rotary positions of a step's tokens (rows as the step's batch: owners[r]
    = (request, sequence), host["start_pos"] / host["q_lens"] per row; padding 0): a
    request's prompt positions from its ``multi_modal.rope_positions``, later tokens (and
    text requests') at index + delta."""
    out = np.zeros((3, num_tokens), np.int32)
    cu = 0
    for r, (req, _) in enumerate(owners):
        start, q = int(host["start_pos"][r]), int(host["q_lens"][r])
        idx = np.arange(start, start + q)
        mm = req.multi_modal
        pos = getattr(mm, "rope_positions", None)
        if pos is None:
            out[:, cu : cu + q] = idx
        else:
            n = pos.shape[1]
            inside = idx[idx < n]
            out[:, cu : cu + len(inside)] = pos[:, inside]
            out[:, cu + len(inside) : cu + q] = idx[len(inside) :] + mm.rope_delta
        cu += q
    return out


__all__ = ["ROPE_DELTAS", "RopeDeltas", "split_rope_deltas", "step_positions"]
