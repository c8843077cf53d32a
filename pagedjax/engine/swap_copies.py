"""One step's host-side block copies, in the order the step's KV needs them.

``apply_swap_copies(core, speculator, batch, host)`` runs after ``schedule`` and before
the step's forward: out (device -> host) first, while the freed device blocks still hold
the swapped group's KV (this step's forward and copy-on-write may overwrite them), then in
(host -> device) into the fresh blocks before any forward reads them, then the host
tier's copies of the prefix blocks the scheduler evicted (read before the swaps, stored
after them: kv_offload.py), then the same swaps on a separate draft's pool
(spec/draft_pool.py). It updates the book's set of swapped-out slots and returns the
counts the engine's stats keep.

host: the batch's host copy (``num_out``, ``num_in``, ``swapped_out``, ``swapped_in``,
``preempted``, ``evicted``: numpy, read in the step's one sync).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pagedjax.engine.device_state import padding_bucket


class SwapCounts(NamedTuple):
    """This step's preemptions by kind (sequences) and blocks moved by direction."""

    preempted_swap: int
    preempted_recompute: int
    blocks_out: int
    blocks_in: int


def apply_swap_copies(core: Any, speculator: Any, batch: Any, host: dict) -> SwapCounts:
    n_out, n_in = int(host["num_out"]), int(host["num_in"])
    out_slots = np.flatnonzero(host["swapped_out"])
    in_slots = np.flatnonzero(host["swapped_in"])
    swapped = core.book.swapped_slots
    swapped.update(int(x) for x in out_slots)
    swapped.difference_update(int(x) for x in in_slots)
    sw, tier = batch.swap, core.host_tier
    pending = tier.gather(core, np.flatnonzero(host["evicted"])) if tier else None
    if n_out:
        core.device.swap_out(sw, n_out, padding_bucket(n_out, sw.out_src.shape[0]))
    if n_in:
        core.device.swap_in(sw, n_in, padding_bucket(n_in, sw.in_src.shape[0]))
    if tier is not None:
        tier.store(core, pending)
    if speculator is not None:
        speculator.apply_swaps(sw, host)
    recomputed = int(host["preempted"].sum()) - len(out_slots)
    return SwapCounts(len(out_slots), recomputed, n_out, n_in)
