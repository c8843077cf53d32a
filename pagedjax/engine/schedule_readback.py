"""The step's one device-to-host read after ``schedule``: what the host needs of the batch.

``read_schedule(core, batch)`` fetches, in one ``jax.device_get``, the batch's sizes and
rows (``num_tokens``, ``num_seqs``, ``seq_ids``, ``q_lens``, ``start_pos``, ``emits``,
``spec_lens``), its per-slot masks (``rejected``, ``preempted``, ``released``), the finish
reasons, the pool's use (``used``, ``unshared``: ``sharing.sharing_usage``), the block
tables when prefix caching registers blocks, the swap decisions (``num_out``, ``num_in``,
``swapped_out``, ``swapped_in``) and the blocks the device pool evicted when a host tier
keeps them. Arrays are numpy (int32 / bool, [max_seqs] unless scalar); ``tables`` and
``evicted`` are None when not needed. One transfer, because each sync stalls the step:
the bucket (T, S) is picked from these sizes before the model program runs.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def read_schedule(core: Any, batch: Any) -> dict[str, np.ndarray | None]:
    """The host's copy of ``batch`` and the state around it (the module docstring)."""
    dev = core.device
    host = jax.device_get(
        dict(
            num_tokens=batch.num_tokens, num_seqs=batch.num_seqs, seq_ids=batch.seq_ids,
            q_lens=batch.q_lens, start_pos=batch.start_pos, emits=batch.emits,
            spec_lens=batch.spec_lens,
            rejected=batch.rejected, preempted=batch.preempted, released=batch.released,
            reason=dev.state.finish_reason,
            usage=dev.usage(),
            tables=dev.state.mem.tables.tables if core.enable_prefix_caching else None,
            num_out=batch.swap.num_out,
            num_in=batch.swap.num_in,
            swapped_out=batch.swap.swapped_out,
            swapped_in=batch.swap.swapped_in,
            evicted=dev.state.mem.evicted if core.host_tier is not None else None,
        )
    )  # fmt: skip
    host["used"], host["unshared"] = host.pop("usage")
    return host
