"""Data parallelism: M engine replicas in one process behind one request front.

``DataParallelEngine`` has ``LLMEngine``'s request interface (``add_request``,
``abort_request``, ``step``, ``has_unfinished_requests``...), so ``LLM`` drives it the
same way. Replica r is a whole ``LLMEngine`` (its own KV pool, block manager, scheduler
and prefix cache) on devices ``[r * N, (r + 1) * N)`` of ``jax.devices()``, N =
tensor_parallel_size (M x N devices in all). A ``Router`` (``router.py``) picks each
request's replica: least outstanding tokens by default, or prefix affinity.

Why replicas and not one engine over a ``dp`` mesh axis: the scheduler and its block
pool are per replica by nature (a request's blocks live on its replica's devices), and
separate engines need no change to the engine; the weights are loaded once and placed on
each replica's devices. ``step()`` steps every replica that has work, in turn, on this
thread: JAX dispatches asynchronously, but each step reads its sampled ids back, so the
replicas' host work is serialized (the server instead runs each replica in an engine
core process of its own, ``core_client.py``, with this module's router and merges; the
correctness of the routing and of each replica's outputs does not depend on it).
Outputs stream per request exactly as with one replica (request ids are global).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from pagedjax.config import EngineConfig
from pagedjax.engine.fronts.router import Router
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.loading import load_model
from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.parallel import check_device_count
from pagedjax.sampling import SamplingParams


class DataParallelEngine:
    """``config.parallel.data_parallel_size`` replicas of ``LLMEngine`` and a router.

    arch, params, tokenizer, config: as ``LLMEngine``; each replica gets ``config`` with
    data_parallel_size 1 and its own devices. devices: the devices to split (default
    ``jax.devices()``); ValueError if fewer than M x N.
    """

    def __init__(
        self,
        arch: Any,
        params: Any,
        tokenizer: Any,
        config: EngineConfig,
        *,
        devices: Sequence[Any] | None = None,
        **engine_kwargs: Any,
    ):
        par = config.parallel
        m, n = par.data_parallel_size, par.tensor_parallel_size
        if par.pipeline_parallel_size > 1:  # replicas split tensor_parallel_size devices
            raise ValueError(f"data_parallel_size={m} with pipeline_parallel_size="
                             f"{par.pipeline_parallel_size}: not built (docs/parallelism.md)")
        devices = list(devices) if devices is not None else jax.devices()
        if len(devices) < m * n:
            raise ValueError(
                f"data_parallel_size={m} x tensor_parallel_size={n} needs {m * n} devices;"
                f" jax sees {len(devices)}"
            )
        replica_config = dataclasses.replace(
            config, parallel=dataclasses.replace(par, data_parallel_size=1)
        )
        self.config = config
        self.replicas = [
            LLMEngine(arch, params, tokenizer, replica_config,
                      devices=devices[r * n:(r + 1) * n], **engine_kwargs)
            for r in range(m)
        ]  # fmt: skip
        first = self.replicas[0]
        self.arch, self.tokenizer = arch, tokenizer
        self.max_model_len = first.max_model_len
        self.router = Router(m, par.data_parallel_routing, block_size=first.block_size)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> DataParallelEngine:
        """Load config.model once, build the replicas."""
        par = config.parallel
        check_device_count(par.tensor_parallel_size, par.data_parallel_size)  # before loading
        arch, params, tokenizer, _ = load_model(config.model)
        return cls(arch, params, tokenizer, config, **kwargs)

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: str | Sequence[int] | dict,
        params: SamplingParams | None = None,
    ) -> int:  # fmt: skip
        """Route and queue a request; returns its replica. Raises as ``LLMEngine`` does
        (nothing is left routed then)."""
        params = SamplingParams() if params is None else params
        first = self.replicas[0]
        if isinstance(params, SamplingParams):
            _, ids = first.tokenize_prompt(prompt)
            out = params.max_tokens or max(self.max_model_len - len(ids), 1)
            tokens = len(ids) + out * max(params.n, 1)
        else:  # LLMEngine.add_request raises the right TypeError below
            ids, tokens = [], 0
        if request_id in self.router.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = self.router.route(request_id, ids, tokens)
        try:
            self.replicas[replica].add_request(request_id, prompt, params)
        except BaseException:
            self.router.finish(request_id)
            raise
        return replica

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            replica = self.router.replica_of(rid)
            if replica is not None:
                self.replicas[replica].abort_request(rid)
                self.router.finish(rid)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(e.get_num_unfinished_requests() for e in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One iteration of every replica that has work; their outputs, concatenated."""
        outputs: list[RequestOutput] = []
        for engine in self.replicas:
            if engine.has_unfinished_requests():
                outputs.extend(engine.step())
        for out in outputs:
            if out.finished:
                self.router.finish(out.request_id)
        return outputs

    def least_loaded_replica(self) -> LLMEngine:
        """The replica with the fewest outstanding tokens (beam search runs there)."""
        return self.replicas[self.router.least_loaded()]

    # What the server's front and metrics read (async_engine.py, openai/metrics.py): sums
    # over replicas, or the replicas' common value.

    @property
    def max_logprobs(self) -> int:
        return self.replicas[0].max_logprobs

    @property
    def num_preemptions(self) -> int:
        return sum(e.num_preemptions for e in self.replicas)

    def request_counts(self) -> dict[str, int]:
        return merge_counts([e.request_counts() for e in self.replicas])

    def num_usable_blocks(self) -> int:
        return sum(e.num_usable_blocks() for e in self.replicas)

    def num_free_blocks(self) -> int:
        return sum(e.num_free_blocks() for e in self.replicas)

    def replica_stats(self) -> list[dict[str, float | int]]:
        """Each replica's ``LLMEngine.stats()``."""
        return [e.stats() for e in self.replicas]

    def stats(self) -> dict[str, float | int]:
        """``LLMEngine.stats()`` summed over replicas, except the ratios (the replicas'
        unweighted mean) and the process-wide XLA compilation count (once)."""
        return merge_stats(self.replica_stats())


def merge_stats(per: Sequence[dict[str, float | int]]) -> dict[str, float | int]:
    """Replicas' ``LLMEngine.stats()`` as one: sums, except the ratios (unweighted mean)
    and the process-wide XLA compilation count (the first replica's: with replicas in
    processes of their own, core_client.py, that process's count)."""
    out: dict[str, float | int] = {}
    for key in per[0]:
        vals = [s[key] for s in per]
        if key in _MEAN_KEYS:
            out[key] = sum(vals) / len(vals)
        elif key in _PROCESS_KEYS:
            out[key] = vals[0]
        else:
            out[key] = sum(vals)
    return out


def merge_counts(per: Sequence[dict[str, int]]) -> dict[str, int]:
    """Replicas' ``request_counts()`` summed."""
    counts: dict[str, int] = {}
    for c in per:
        for k, v in c.items():
            counts[k] = counts.get(k, 0) + v
    return counts


_MEAN_KEYS = ("prefix_cache_hit_rate", "blocks_saved_by_sharing", "blocks_saved_by_sharing_total")
_PROCESS_KEYS = ("xla_compilations",)


__all__ = ["DataParallelEngine", "merge_counts", "merge_stats"]
