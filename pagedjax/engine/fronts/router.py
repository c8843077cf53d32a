"""Which data-parallel replica gets a request: least outstanding tokens, or prefix affinity.

Pure host bookkeeping (no JAX): the data-parallel front (``data_parallel.py``) asks
``route`` once per request and tells ``finish`` when it ends.

- ``least_tokens`` (default): the replica with the fewest outstanding tokens, where a
  request counts prompt + max_tokens x n until it finishes (the work and the KV it may
  still need; vLLM's DP load balancing counts waiting + running requests, tokens weigh
  long prompts properly). Ties go to the lowest index.
- ``prefix_affinity``: requests whose prompts share leading full blocks go to the replica
  that saw that prefix first, so they meet its cached blocks (each replica has its own
  prefix cache; a prefix hit on another replica is impossible). The key is the longest
  known chain of whole ``block_size``-token blocks (up to ``max_prefix_blocks``), the unit
  the prefix cache reuses; a prompt with no known prefix falls back to least tokens and
  registers its blocks. The table forgets nothing (bounded by ``max_entries``, oldest
  dropped first): a stale entry only costs balance, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

RoutingPolicy = Literal["least_tokens", "prefix_affinity"]
ROUTING_POLICIES = ("least_tokens", "prefix_affinity")


class Router:
    """Routes requests over ``num_replicas`` replicas (see the module docstring)."""

    def __init__(
        self,
        num_replicas: int,
        policy: RoutingPolicy = "least_tokens",
        *,
        block_size: int = 16,
        max_prefix_blocks: int = 64,
        max_entries: int = 1 << 16,
    ):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.num_replicas = num_replicas
        self.policy = policy
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.max_entries = max_entries
        self.outstanding = [0] * num_replicas  # tokens per replica
        self.requests: dict[str, tuple[int, int]] = {}  # id -> (replica, tokens)
        self.prefix_owner: OrderedDict[int, int] = OrderedDict()

    def least_loaded(self) -> int:
        return min(range(self.num_replicas), key=lambda r: (self.outstanding[r], r))

    def _prefix_keys(self, prompt_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the whole-block prefixes of the prompt, longest first (as the
        prefix cache keys blocks: one int per prefix, not the tokens; a collision only
        costs balance)."""
        bs = self.block_size
        n = min(len(prompt_ids) // bs, self.max_prefix_blocks)
        keys, h = [], 0
        for k in range(n):
            h = hash((h, tuple(prompt_ids[k * bs:(k + 1) * bs])))
            keys.append(h)
        return keys[::-1]

    def route(self, request_id: str, prompt_ids: Sequence[int], tokens: int) -> int:
        """The replica for a new request of ``tokens`` outstanding tokens; recorded."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already routed")
        replica = None
        keys = self._prefix_keys(prompt_ids) if self.policy == "prefix_affinity" else []
        for key in keys:
            if key in self.prefix_owner:
                replica = self.prefix_owner[key]
                break
        if replica is None:
            replica = self.least_loaded()
        for key in keys:
            if key not in self.prefix_owner:
                self.prefix_owner[key] = replica
        while len(self.prefix_owner) > self.max_entries:
            self.prefix_owner.popitem(last=False)
        self.requests[request_id] = (replica, tokens)
        self.outstanding[replica] += tokens
        return replica

    def replica_of(self, request_id: str) -> int | None:
        entry = self.requests.get(request_id)
        return None if entry is None else entry[0]

    def finish(self, request_id: str) -> None:
        """The request ended (finished or aborted): its tokens stop counting."""
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            self.outstanding[entry[0]] -= entry[1]


__all__ = ["ROUTING_POLICIES", "Router", "RoutingPolicy"]
