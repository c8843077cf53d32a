"""Start-up compilation (warm-up) of the programs an engine runs, and compile counting.

Every device program of a step is jitted over static shapes, so an engine runs a finite
set of executables: the runner step per (T, S) bucket pair (plus an ``all_logits``
variant per pair, compiled when a request first asks for prompt logprobs), the
multi-step decode loop per loop bucket (``multi_step.loop_buckets``), and a dozen small
state functions (schedule, update, admission, abort, prefix-cache and fork helpers).
``warm_up`` runs each of them once on inputs that change nothing (all-padding batches,
all-false masks, a zero-iteration loop), so later steps only hit compiled executables.

Modes (``EngineConfig.warmup`` / ``LLM(warmup=...)``):

- ``"decode"``: the decode pairs (smallest T >= S, S) for every S bucket, the largest
  prefill pair, the multi-step loops, the small functions. What a serving engine meets
  all the time; prefill pairs of other sizes compile on first use.
- ``"all"``: every (T, S) pair a step can produce (S buckets whose smallest member fits
  in T), the loops and the small functions: no compilation while serving, except the
  ``all_logits`` variants.
- ``"none"``: compile on first use.
- ``"auto"`` (default): ``"all"``, so the first ``generate`` never stalls on a
  compilation (as vLLM captures its CUDA graphs at start-up). Affordable since the layers
  run under one loop (a program's compile time does not grow with depth), the step
  compiles once per token bucket (about 14 programs, buckets.py) and programs come from the
  persistent compilation cache after the first start (compile_cache.py). The environment
  variable ``PAGEDJAX_WARMUP`` replaces what "auto" means (the test suite sets "none":
  it builds many short-lived engines).

Counting: ``engine_compilations`` sums the jit caches of the engine's own functions
(one entry per compiled signature); ``backend_compilations`` counts XLA backend
compilations in the whole process (a ``jax.monitoring`` listener), which also catches
eager ``jnp`` operations on the serving path.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.buckets import seqs_for_tokens
from pagedjax.engine.multi_step import loop_buckets
from pagedjax.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from pagedjax.engine.llm_engine import LLMEngine

MODES = ("auto", "all", "decode", "none")

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


WARMUP_ENV = "PAGEDJAX_WARMUP"


def resolve_mode(mode: str) -> str:
    """The concrete mode: "auto" is "all", or ``$PAGEDJAX_WARMUP`` when set."""
    if mode not in MODES:
        raise ValueError(f"warmup must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        env = os.environ.get(WARMUP_ENV, "all")
        if env not in MODES or env == "auto":
            raise ValueError(f"{WARMUP_ENV} must be one of {MODES[1:]}, got {env!r}")
        return env
    return mode


def bucket_pairs(
    token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...], mode: str
) -> list[tuple[int, int]]:
    """The (T, S) runner pairs a mode compiles (sorted): one per token bucket T, with
    S = seqs_for_tokens(seq_buckets, T) (buckets.py)."""
    every = [(t, seqs_for_tokens(seq_buckets, t)) for t in token_buckets]
    if mode == "decode":  # steps of one token per row (T <= the row cap), and the largest
        return sorted({(t, s) for t, s in every if t <= seq_buckets[-1]} | {every[-1]})
    if mode == "all":
        return sorted(every)
    if mode == "none":
        return []
    raise ValueError(f"mode must be 'all', 'decode' or 'none' here, got {mode!r}")


def engine_jits(engine: LLMEngine) -> dict[str, Any]:
    """The engine's jitted functions by name (each has ``_cache_size()``)."""
    return dict(
        runner_step=engine.runner.step,
        multi_step_loop=engine.multi_step.loop,
        multi_step_recycle=engine.multi_step.recycle,
        schedule=engine._schedule,
        update=engine._post,
        add_requests=engine._add,
        abort=engine._abort,
        set_row=engine._set_row,
        attach_hits=engine._attach,
        register_step=engine._register,
        fork=engine._fork,
        sharing_usage=engine._usage,
    )


def engine_compilations(engine: LLMEngine) -> int:
    """Executables compiled for this engine's jitted functions so far."""
    return sum(f._cache_size() for f in engine_jits(engine).values())


def warm_up(
    engine: LLMEngine,
    mode: str = "decode",
    pairs: Iterable[tuple[int, int]] | None = None,
    progress: bool = False,
) -> list[tuple[int, int]]:
    """Compile (by running on no-op inputs) the programs of ``mode``; ``pairs``
    overrides the runner pairs (and then only they are run). Returns the runner pairs.

    Safe at any time between steps: nothing it runs changes a request's state.
    """
    mode = resolve_mode(mode)
    only_pairs = pairs is not None
    if pairs is None:
        pairs = bucket_pairs(engine.token_buckets, engine.seq_buckets, mode)
    pairs = sorted(set(pairs))
    for t, s in pairs:
        if t not in engine.token_buckets or s not in engine.seq_buckets:
            raise ValueError(f"({t}, {s}) is not a bucket pair of this engine")
    jobs: list[tuple[str, Any]] = []
    if not only_pairs and mode != "none":
        # First: it also replaces a fresh state's shared zero arrays by distinct buffers,
        # which the donating functions below need.
        jobs.append(("state functions", (_small,)))
        if engine.multi_step.enabled:
            buckets = loop_buckets(engine.seq_buckets)
            jobs += [(f"decode loop S={s}", (_loop, s)) for s in buckets]
    jobs += [(f"step T={t} S={s}", (_runner, t, s)) for t, s in pairs]
    bar = None
    if progress and jobs:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc="Compiling (warm-up)", dynamic_ncols=True)
    try:
        for name, (fn, *args) in jobs:
            if bar is not None:
                bar.set_postfix_str(name, refresh=True)
            fn(engine, *args)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return pairs


def _padding_batch(engine: LLMEngine) -> ScheduledBatch:
    """A batch of padding rows with the pytree of ``schedule``'s batches (its SwapPlan
    included), of device arrays like them (jit's cache key tells device arrays from
    numpy ones, and a batch without the SwapPlan from one with it: either would compile
    another copy). The engine's own schedule gives the structure; its rows are zeroed
    (seq_ids -1), so nothing runs, whatever is queued."""
    _, batch = engine._schedule(engine.state)  # not donated: the state is unchanged
    batch = jax.tree.map(jnp.zeros_like, batch)
    return batch._replace(seq_ids=jnp.full_like(batch.seq_ids, -1))


def _runner(engine: LLMEngine, t: int, s: int) -> None:
    """The step on an all-padding batch: no KV write, no token appended, no copy."""
    n = engine.max_seqs
    f = np.zeros((n,), bool)
    mem = engine.state.mem
    mem = mem._replace(last_cow=mem.last_cow._replace(valid=jnp.asarray(f)))
    engine._upload_sampling()
    st = engine.state
    engine.kv, engine.tokens, out, _ = engine.runner.step(
        engine.params, engine.kv, engine.tokens, mem,
        _padding_batch(engine)._replace(swap=None),  # as LLMEngine.step passes it
        engine._slot_sampling_dev, st.prompt_len, st.output_len, num_tokens=t, num_seqs=s,
        all_logits=False,  # spelled out: jit caches by the keywords given
    )  # fmt: skip
    jax.block_until_ready(out)


def _loop(engine: LLMEngine, s: int) -> None:
    """The decode loop with max_iters = 0: compiled, zero iterations run."""
    ms = engine.multi_step
    engine._upload_sampling()
    engine.state, engine.kv, engine.tokens, out = ms.loop(
        engine.params, engine.state, engine.kv, engine.tokens, engine._slot_sampling_dev,
        ms._stop_ids(engine), np.int32(0), np.bool_(False), num_seqs=s,
    )  # fmt: skip
    jax.block_until_ready(out)


def _small(engine: LLMEngine) -> None:
    """Each small state function once, with masks that select nothing, each argument a
    numpy or a device array exactly as the engine passes it (jit caches by that too)."""
    n, m = engine.max_seqs, engine.max_blocks_per_seq
    i32 = np.zeros((n,), np.int32)
    ones = np.ones((n,), np.int32)
    f = np.zeros((n,), bool)
    ids = np.arange(n, dtype=np.int32)
    engine._schedule(engine.state)  # result dropped: not donated, the state is unchanged
    jax.block_until_ready(engine._usage(engine.state))
    # Not donated, returns fresh buffers (a new engine's state shares zero arrays).
    engine.state = engine._add(engine.state, i32, ones, ones, ones + ones, i32, f, i32)
    engine.state = engine._abort(engine.state, ids, f)
    engine.state = engine.multi_step.recycle(engine.state, f)
    # update on an all-padding batch only advances the state's step counter.
    engine.state = engine._post(engine.state, _padding_batch(engine), f, f)
    slot = engine.max_seqs - 1
    row = np.asarray(jax.device_get(engine.tokens[slot]), np.int32)
    engine.tokens = engine._set_row(engine.tokens, np.int32(slot), row)
    if engine.enable_prefix_caching:
        cand = np.zeros((n, m), np.int32)
        engine.state, verified, used = engine._attach(engine.state, engine.tokens, i32, cand, f)
        batch = _padding_batch(engine)  # the engine passes the batch's (device) rows
        engine.state = engine._register(
            engine.state, engine.tokens, batch.seq_ids, batch.start_pos, batch.q_lens
        )
        jax.device_get((verified, used))
    engine.state = engine._fork(engine.state, np.int32(0), i32, f, i32, i32)
    jax.block_until_ready(engine.state)
