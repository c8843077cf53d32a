"""What ``LLMEngine.stats()`` reports: sharing, prefix-cache, preemption, compile counts.

Counting compilations: ``engine_compilations`` sums the jit caches of one engine's own
functions (``engine_jits``: one entry per compiled signature); ``backend_compilations``
counts XLA backend compilations in the whole process (a ``jax.monitoring`` listener,
registered when this module is imported), which also catches eager ``jnp`` operations
on the serving path.
"""

from __future__ import annotations

from typing import Any

import jax

from pagedjax.engine.core import EngineCore

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_counter = {"count": 0, "seconds": 0.0}


def _on_event_duration(event: str, duration: float, **_: Any) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        _counter["count"] += 1
        _counter["seconds"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


def backend_compilations() -> tuple[int, float]:
    """(XLA backend compilations in this process since pagedjax.engine was imported,
    their total seconds)."""
    return _counter["count"], _counter["seconds"]


def engine_jits(core: EngineCore, decoder: Any) -> dict[str, Any]:
    """The engine's jitted functions by name (each has ``_cache_size()``): the runner
    step, the decode loop (``decoder``: the engine's MultiStepDecoder) and the device
    state's small functions."""
    return dict(
        runner_step=core.runner.step,
        multi_step_loop=decoder.loop,
        **core.device.jits(),
    )


def compilations_by_function(core: EngineCore, decoder: Any) -> dict[str, int]:
    """Executables compiled so far per jitted function of this engine (``engine_jits``).

    The step and the decode loop count their traces (``trace_count``: one per compiled
    program): warm-up compiles them ahead of time (``lower(...).compile()``), which jit's
    call cache (``_cache_size()``) records only at the first call, although that call
    neither traces nor compiles again. The small functions run at warm-up: their jit
    caches count. A model that takes images adds ``image_encoder`` (its traces; the image
    step programs are the runner step's)."""
    traced = {"runner_step": core.runner.trace_count, "multi_step_loop": decoder.trace_count}
    counts = {
        name: sum(traced[name].values()) if name in traced else f._cache_size()
        for name, f in engine_jits(core, decoder).items()
    }
    if core.admit_gate is not None:  # multimodal.MultiModalRunner: the image encoder's
        counts["image_encoder"] = core.admit_gate.encoder_compilations
    return counts


def engine_compilations(core: EngineCore, decoder: Any) -> int:
    """Executables compiled for this engine's jitted functions so far."""
    return sum(compilations_by_function(core, decoder).values())


def engine_stats(core: EngineCore, decoder: Any, **counts: int) -> dict[str, float | int]:
    """``LLMEngine.stats()`` (since its last ``reset_stats``; docs/engine.md); ``counts``:
    the engine's own counters (forked samples, preemptions, swapped blocks), in order.

    prefix_cache_queries: lookups (admissions and re-admissions after preemption).
    prefix_cache_query_tokens: tokens looked up (prompt, or prompt + output to redo).
    prefix_cache_hit_tokens: tokens whose KV was reused = prefill tokens saved.
    prefix_cache_hit_rate: hit tokens / query tokens.
    blocks_saved_by_sharing: 1 - blocks in use / blocks without sharing, averaged over
        steps holding blocks; the ratio of the sums: ``blocks_saved_by_sharing_total``.
    preemptions_recompute / preemptions_swap: sequences preempted by each kind.
    swapped_out_blocks / swapped_in_blocks: KV blocks copied device -> host and back
        (a block shared within a group counts once).
    compilations, xla_compilations: ``engine_compilations``, ``backend_compilations``;
    multi_step_*: the K-step decoder's ``MultiStepStats``.
    engine_steps: engine iterations since the engine started (not reset by
        ``reset_stats``: a gauge, read as a difference).
    """
    c, index = core.sharing, core.prefix_index
    q = c.lookup_tokens
    ms = decoder.stats
    return dict(
        prefix_cache_queries=index.queries,
        prefix_cache_query_tokens=q,
        prefix_cache_hit_tokens=c.hit_tokens,
        prefill_tokens_saved=c.hit_tokens,
        prefix_cache_hit_rate=c.hit_tokens / q if q else 0.0,
        blocks_saved_by_sharing=c.saved_frac_sum / c.steps if c.steps else 0.0,
        blocks_saved_by_sharing_total=(1.0 - c.used_sum / c.unshared_sum if c.unshared_sum
                                       else 0.0),  # fmt: skip
        sharing_steps=c.steps,
        **counts,
        compilations=engine_compilations(core, decoder),
        engine_steps=core.num_steps,
        xla_compilations=backend_compilations()[0],
        multi_step_loops=ms.loops,
        multi_step_iterations=ms.iterations,
        multi_step_rolled_back=ms.rolled_back,
        multi_step_pipelined=ms.pipelined,
    )


__all__ = ["backend_compilations", "engine_compilations", "engine_jits", "engine_stats"]
