"""FasterTransformer-like static (request-level) batching: the memory side.

The paper's FasterTransformer baseline manages memory "like Orca (Max)": every request
reserves ``max_model_len`` slots, so the batch size B is the number of such chunks the
pool fits. The batching rule itself (admit up to B of the earliest requests, then admit
nothing until the whole batch finishes) is scheduler behaviour, not memory policy.
"""

from __future__ import annotations

from pagedjax.memory.buddy import buddy_top_blocks
from pagedjax.memory.reservation import ReservationPolicy


def static_batch_size(capacity_tokens: int, max_model_len: int, min_block: int = 1) -> int:
    """Largest B such that B chunks of ``max_model_len`` slots fit the buddy pool at once.

    Each chunk takes the power of two at or above ``max_model_len`` (in ``min_block`` units),
    so for a power-of-two ``max_model_len`` this is ``capacity_tokens // max_model_len``
    (OPT-13B on an A100-40GB: 15,728 // 2048 = 7).
    """
    if not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
    if not isinstance(min_block, int) or min_block < 1 or min_block & (min_block - 1):
        raise ValueError(f"min_block must be a positive power of two, got {min_block!r}")
    if not isinstance(capacity_tokens, int) or capacity_tokens < min_block:
        raise ValueError(f"capacity_tokens must be an int >= min_block, got {capacity_tokens!r}")
    units = -(-max_model_len // min_block)
    chunk = min_block << (units - 1).bit_length()
    # Aligned chunks tile each maximal free block; none straddles two of them.
    return sum(size // chunk for _, size in buddy_top_blocks(capacity_tokens, min_block))


def static_batching_policy(
    max_seqs: int, capacity_tokens: int, max_model_len: int, watermark_frac: float = 0.0
) -> ReservationPolicy:
    """The memory policy of the static-batching baseline: Orca (Max) reservations."""
    return ReservationPolicy(
        kind="max",
        max_seqs=max_seqs,
        capacity_tokens=capacity_tokens,
        max_model_len=max_model_len,
        watermark_frac=watermark_frac,
    )
