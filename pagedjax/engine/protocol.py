"""EngineClient: what a front (the server's AsyncLLMEngine, LLM) needs of an engine.

vLLM v1 separates the API process from the engine core behind an engine-client
interface; this is pagedjax's. It is the request interface of ``LLMEngine`` (requests in,
one iteration per ``step()``, cumulative ``RequestOutput``s out) plus the few read-only
facts a server needs (tokenizer, max_model_len, max_logprobs, the model's ``arch``:
its vocab_size...) and the load
numbers /metrics reports. Four classes implement it:

- ``LLMEngine`` (one engine in this process);
- ``DataParallelEngine`` (replicas in this process, stepped one after another);
- ``MultiHostEngine`` (one engine over several hosts, this process leading);
- ``MPEngineClient`` (``core_client.py``): one engine core process per data-parallel
  replica; ``step()`` returns what the cores stepped meanwhile.

``request_counts()`` is cheap in every implementation (the server reads it after each
step); ``stats()``, ``num_free_blocks()``, ``num_usable_blocks()`` and
``num_preemptions`` may be a round trip to another process (metrics scrapes, tests).
``metrics_snapshot(engine)`` reads all of /metrics' numbers at once (one round trip per
core process with ``MPEngineClient``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from pagedjax.engine.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine stopped (a step raised, its process died, or shutdown); nothing more is
    served. The message names the cause (the exception, or the process' exit code)."""


@runtime_checkable
class EngineClient(Protocol):
    """See the module docstring. ``add_request`` raises (ValueError / TypeError) on a
    request the engine can never run, changing nothing."""

    tokenizer: Any
    max_model_len: int
    max_logprobs: int
    arch: Any  # the model's ModelArch (vocab_size, ...)
    num_preemptions: int

    def add_request(
        self, request_id: str, prompt: str | Sequence[int] | dict, params: Any = None
    ) -> Any: ...

    def abort_request(self, request_id: str | Iterable[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def request_counts(self) -> dict[str, int]: ...

    def stats(self) -> dict[str, float | int]: ...

    def num_free_blocks(self) -> int: ...

    def num_usable_blocks(self) -> int: ...


ENGINE_CLIENT_MEMBERS = (
    "tokenizer", "max_model_len", "max_logprobs", "arch", "num_preemptions",
    "add_request", "abort_request", "step", "has_unfinished_requests",
    "get_num_unfinished_requests", "request_counts", "stats", "num_free_blocks",
    "num_usable_blocks",
)  # fmt: skip


def metrics_snapshot(engine: EngineClient) -> dict[str, Any]:
    """/metrics' engine numbers: request counts, free / usable KV blocks, preemptions and
    ``stats()``. An engine with its own ``snapshot()`` (``MPEngineClient``: one round trip
    per core) answers it itself."""
    own = getattr(engine, "snapshot", None)
    if own is not None:
        return own()
    return dict(
        counts=engine.request_counts(),
        free=engine.num_free_blocks(),
        usable=engine.num_usable_blocks(),
        preemptions=int(engine.num_preemptions),
        stats=engine.stats(),
    )


__all__ = ["ENGINE_CLIENT_MEMBERS", "EngineClient", "EngineDeadError", "metrics_snapshot"]
