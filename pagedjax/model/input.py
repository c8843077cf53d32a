"""The ragged batch one forward step consumes."""

from __future__ import annotations

from typing import NamedTuple

import jax


class ModelInput(NamedTuple):
    """One step's flattened batch (a pytree; all int32; padded to static bucket sizes).

    tokens [T]: token ids; padding tokens are arbitrary valid ids (e.g. 0).
    positions [T]: position of each token in its sequence (padding: 0).
    slot_mapping [T]: KV slot of each token, block * block_size + offset; padding: PAD_SLOT.
    block_tables [S, M]: pages of each scheduled sequence; unused entries 0 (null block).
    kv_lens [S]: context length including this step's tokens; padding sequences 0.
    cu_q_lens [S+1]: cumulative token counts; padding sequences repeat the last value.
    logits_indices [L]: token indices whose logits are returned (last token of each
      sequence by default, every prompt token for prompt logprobs); padding entries may
      repeat any valid index and their rows are to be ignored.
    lora_slots [T] or None: each token's LoRA adapter slot (pagedjax/lora/slots.py; 0 = no
      adapter). None, the default, runs the base model even when adapters are attached.
    rope_positions int32[T] or int32[3, T] or None: the rotary positions when they are not
      ``positions`` (Qwen2-VL's M-RoPE, model/rope.py): [3, T] rows (temporal, height,
      width) for a prompt with images, [T] a per-request offset of ``positions`` for
      text after them (engine/mrope.py). None, the default: RoPE turns by ``positions``.
    tree_mask uint32[T] or None: draft-tree verification (the attention backends'
      ``tree_mask``, ``pallas_kernels.reference.tree_visible``): bit d of a token's word
      lets it see the key d slots back, keys 32 or more back always. A tree's nodes sit in
      consecutive slots, parents first, with ``positions`` their depths past the prefix.
      None, the default: the causal rule.
    """

    tokens: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    logits_indices: jax.Array
    lora_slots: jax.Array | None = None
    rope_positions: jax.Array | None = None
    tree_mask: jax.Array | None = None
