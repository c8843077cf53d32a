"""Start-up compilation (warm-up) of the programs an engine runs.

Every device program of a step is jitted over static shapes, so an engine runs a finite
set of executables: the runner step per (T, S) bucket pair (plus an ``all_logits``
variant per pair, compiled when a request first asks for prompt logprobs), the
multi-step decode loop per loop bucket (``multi_step.loop_buckets``), and a dozen small
state functions (schedule, update, admission, abort, prefix-cache and fork helpers).
``warm_up`` compiles the step and loop programs ahead of time (``jit(...).lower(args)
.compile()`` with exactly the engine's argument types, which fills jit's cache without
running them) and runs each small state function once on inputs that change nothing
(all-false masks), so later steps only hit compiled executables.

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

With ``overlap_mask_fill`` on (structured outputs; an accelerator by default) each
runner pair also compiles the step's two halves (forward, sampling), which a step with
grammar masks to fill runs instead of the fused step.

A model that takes images (``warm_up``'s ``images``, docs/multimodal.md) adds two kinds
of program: the image step (the runner step with image inputs, per (T, S) pair: "all"
every pair, "decode" the largest) and the image encoder (per tile-count bucket and tile
shape, ``image_encoder_counts``); "none" compiles neither. They show in the progress bar
and the engine's start-up count, and a log line gives their share.

Compile counting lives in ``engine_stats.py``. Warm-up works on the engine core
(``core.EngineCore``) and its decode loop (``multi_step.MultiStepDecoder``) through their
public methods, so it runs exactly the calls (and argument types) the engine makes.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from pagedjax import compile_cache
from pagedjax.attention import native_cpu
from pagedjax.engine.buckets import seqs_for_tokens
from pagedjax.engine.core import EngineCore
from pagedjax.engine.host_arrays import filled_like, zeros_like_tree
from pagedjax.engine.multi_step import MultiStepDecoder, loop_buckets
from pagedjax.engine.program_store import ProgramStore, describe_function
from pagedjax.model import native_lora, native_matmul
from pagedjax.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

MODES = ("auto", "all", "decode", "none")

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


def image_encoder_counts(capacity: int, mode: str) -> list[int]:
    """The tile counts (powers of two) the warm-up compiles the image encoder for. One
    encoder call takes the missing tiles of one step (or of one admission under the
    encoder budget), at most the encoder cache's ``capacity`` C (more grow the cache,
    logged, and compile then), the count padded to a power of two: 1, 2, ..., the first
    power >= C in "all"; 1 (a lone image) in "decode"; none in "none"."""
    if mode == "none":
        return []
    top = 1 if mode == "decode" else 1 << max(0, (capacity - 1).bit_length())
    return [1 << i for i in range(top.bit_length())]


def warm_up(
    core: EngineCore,
    decoder: MultiStepDecoder,
    mode: str = "decode",
    pairs: Iterable[tuple[int, int]] | None = None,
    progress: bool = False,
    images: Any = None,
) -> list[tuple[int, int]]:
    """Compile (by running on no-op inputs) the programs of ``mode``; ``pairs``
    overrides the runner pairs (and then only they are run). Returns the runner pairs.

    images: the engine's ``multimodal.MultiModalRunner`` (a model that takes images; None
    otherwise): the image step program (``ModelRunner.step`` with ``mm``, a jit
    specialization of its own) for the runner pairs ("decode": only the largest, the
    prefill pair; with ``pairs``: those), and, unless ``pairs`` is given, the encoder for
    ``image_encoder_counts`` tiles of each of ``vision.warm_shapes`` (Qwen2-VL: one grid).

    Safe at any time between steps: nothing it runs changes a request's state.
    """
    mode = resolve_mode(mode)
    only_pairs = pairs is not None
    if pairs is None:
        pairs = bucket_pairs(core.token_buckets, core.seq_buckets, mode)
    pairs = sorted(set(pairs))
    for t, s in pairs:
        if t not in core.token_buckets or s not in core.seq_buckets:
            raise ValueError(f"({t}, {s}) is not a bucket pair of this engine")
    jobs: list[tuple[str, Any]] = []
    store = ProgramStore.for_current_cache(len(jax.tree.leaves(core.params)[0].devices()))
    if not only_pairs and mode != "none":
        # First: it also replaces a fresh state's shared zero arrays by distinct buffers,
        # which the donating functions below need.
        jobs.append(("state functions", (_small, store)))
        if decoder.enabled:
            buckets = loop_buckets(core.seq_buckets)
            jobs += [(f"decode loop S={s}", (_loop, s)) for s in buckets]
    if store is not None:  # the native kernels' FFI targets, before a loaded program runs
        native_cpu.available(), native_matmul.available(), native_lora.available()
    jobs += [(f"step T={t} S={s}", (_runner, t, s, store)) for t, s in pairs]
    if core.controls is not None and core.controls.overlap_mask_fill:
        # The step's two halves too (grammar masks filled while the forward runs).
        jobs += [(f"split step T={t} S={s}", (_split_halves, t, s)) for t, s in pairs]
    if images is not None and (only_pairs or mode != "none"):
        image_pairs = pairs if only_pairs or mode == "all" else pairs[-1:]
        jobs += [(f"image step T={t} S={s}", (_runner, t, s, store, images))
                 for t, s in image_pairs]  # fmt: skip
        counts = [] if only_pairs else image_encoder_counts(images.encoder_cache.capacity, mode)
        jobs += [(f"encoder {n} x {shape}", (_encoder, images, n, shape))
                 for shape in images.vision.warm_shapes for n in counts]  # fmt: skip
    bar = None
    if progress and jobs:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc="Compiling (warm-up)", dynamic_ncols=True)
    image_seconds, image_jobs = 0.0, 0
    try:
        for name, (fn, *args) in jobs:
            if bar is not None:
                bar.set_postfix_str(name, refresh=True)
            t0 = time.perf_counter()
            fn(core, decoder, *args)
            if name.startswith(("image step", "encoder")):
                image_seconds += time.perf_counter() - t0
                image_jobs += 1
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if image_jobs:  # the image path's share of the start-up, visible on its own
        log.info("warm-up: %d image programs (encoder and image steps) in %.1f s",
                 image_jobs, image_seconds)  # fmt: skip
    return pairs


def _padding_batch(core: EngineCore) -> ScheduledBatch:
    """A batch of padding rows with the pytree of ``schedule``'s batches (its SwapPlan
    included), of device arrays like them (jit's cache key tells device arrays from
    numpy ones, and a batch without the SwapPlan from one with it: either would compile
    another copy). The engine's own schedule gives the structure; its rows are zeroed
    (seq_ids -1), so nothing runs, whatever is queued."""
    _, batch = core.device.preview_schedule()  # not donated: the state is unchanged
    batch = zeros_like_tree(batch)  # host-built (host_arrays.py), same placement
    return batch._replace(seq_ids=filled_like(batch.seq_ids, -1))


def _without_cow(mem: Any) -> Any:
    """The paged state with no copy-on-write pending; zeros_like keeps the state's
    placement (a tensor-parallel mesh commits it there), so a step compiled on it has the
    signature real steps use."""
    return mem._replace(last_cow=mem.last_cow._replace(valid=filled_like(mem.last_cow.valid, 0)))


def _runner(
    core: EngineCore, decoder: MultiStepDecoder, t: int, s: int, store: ProgramStore | None = None,
    images: Any = None,
) -> None:
    """Compile the step of bucket (t, s) ahead of time on an all-padding batch, or load it
    from the program store (no tracing), and hand it to the runner (``ModelRunner.run``);
    with ``images`` (the MultiModalRunner), the image step's variant, on image inputs
    that gather nothing (``padding_inputs``).

    Compiled, not run: a run at the 2,048-token bucket costs as much as a real prefill, and
    it bought nothing (measured: warm start, see docs/startup.md)."""
    dev = core.device
    mem = _without_cow(dev.state.mem)
    st = dev.state
    args = (core.params, dev.kv, dev.tokens, mem,
            _padding_batch(core)._replace(swap=None),  # as LLMEngine.step passes it
            dev.sampling(), st.prompt_len, st.output_len)  # fmt: skip
    statics = dict(num_tokens=t, num_seqs=s, all_logits=False)
    extra = {} if images is None else {"mm": images.padding_inputs(t)}
    # (A text step's key is what it was before images: its stored programs stay valid.)
    name, keyed = ("step", args) if images is None else ("image step", (*args, extra["mm"]))
    key = store.key(name, core.runner.describe(), keyed, statics) if store else ""
    program = store.load(key) if store else None
    if program is None and store is None:
        program = core.runner.step.lower(*args, **extra, **statics).compile()
    elif program is None:
        with compile_cache.bypassed():  # a cache-loaded program would not serialize whole
            program = core.runner.step.lower(*args, **extra, **statics).compile()
        store.save(key, program)
    core.runner.programs[core.runner.program_key(t, s, False, extra.get("mm"))] = program


def _split_halves(core: EngineCore, decoder: MultiStepDecoder, t: int, s: int) -> None:
    """Compile the forward and sampling programs of bucket (t, s) ahead of time (not
    run), into jit's cache and the persistent compilation cache: with overlap_mask_fill
    on, a step with grammar masks to fill runs them instead of the fused step
    (``DeviceState.run_step``), with these argument types."""
    dev, runner = core.device, core.runner
    st = dev.state
    mem = _without_cow(st.mem)
    batch = _padding_batch(core)._replace(swap=None)
    fwd_args = (core.params, dev.kv, dev.tokens, mem, batch, st.prompt_len)
    statics = dict(num_tokens=t, num_seqs=s, all_logits=False, mm=None)
    runner.forward_step.lower(*fwd_args, **statics).compile()
    logits = jax.eval_shape(functools.partial(runner.forward_step, **statics), *fwd_args)[1]
    runner.sample_step.lower(logits, dev.tokens, batch, dev.sampling(), st.prompt_len,
                             st.output_len, num_seqs=s).compile()  # fmt: skip


def _encoder(core: EngineCore, decoder: MultiStepDecoder, images: Any, n: int,
             shape: tuple[int, ...]) -> None:  # fmt: skip
    """Compile the image encoder for ``n`` tiles of ``shape`` into the engine's encoder
    cache ahead of time (``VisionModel.compile_encoder``: jit's cache and the persistent
    compilation cache, not the program store)."""
    images.vision.compile_encoder(images.encoder_cache.cache, n, shape)


def _loop(core: EngineCore, decoder: MultiStepDecoder, s: int) -> None:
    """Compile the decode loop of ``s`` rows ahead of time (not run; see ``_runner``) and
    hand it to the decoder (``MultiStepDecoder.run_loop``)."""
    dev = core.device
    decoder.programs[s] = decoder.loop.lower(
        core.params, dev.state, dev.kv, dev.tokens, dev.sampling(),
        decoder.stop_ids(core), np.int32(0), np.bool_(False), np.int32(0), num_seqs=s,
    ).compile()  # fmt: skip


def _schedule_program(core: EngineCore, store: ProgramStore) -> None:
    """``schedule`` compiled for the engine's state, from the program store when it holds
    it (no tracing) or compiled and saved, handed to ``DeviceState.schedule_program``."""
    dev = core.device
    args = (dev.state, np.zeros(core.max_seqs, np.int32))  # (state, lookahead)
    key = store.key("schedule", describe_function(dev.schedule_partial), args, {})
    program = store.load(key)
    if program is None:
        with compile_cache.bypassed():  # a cache-loaded program would not serialize whole
            program = jax.jit(dev.schedule_partial).lower(*args).compile()
        store.save(key, program)
    dev.schedule_program = program


def _small(core: EngineCore, decoder: MultiStepDecoder, store: ProgramStore | None = None) -> None:
    """Each small state function once, with masks that select nothing, each argument a
    numpy or a device array exactly as the engine passes it (jit caches by that too);
    ``schedule`` through the program store when there is one."""
    dev = core.device
    if store is not None:
        _schedule_program(core, store)
    n, m = core.max_seqs, core.max_blocks_per_seq
    i32 = np.zeros((n,), np.int32)
    ones = np.ones((n,), np.int32)
    f = np.zeros((n,), bool)
    ids = np.arange(n, dtype=np.int32)
    dev.preview_schedule()  # result dropped: not donated, the state is unchanged
    jax.block_until_ready(dev.usage())
    # Not donated, returns fresh buffers (a new engine's state shares zero arrays).
    dev.add_requests(i32, ones, ones, ones + ones, i32, f, i32)
    dev.abort(ids, f)
    dev.recycle(f)
    # update on an all-padding batch only advances the state's step counter.
    dev.update(_padding_batch(core), f, f)
    slot = n - 1
    row = np.asarray(jax.device_get(dev.tokens[slot]), np.int32)
    dev.set_token_row(np.int32(slot), row)
    if core.enable_prefix_caching:
        cand = np.zeros((n, m), np.int32)
        verified, used = dev.attach_hits(i32, cand, f)
        batch = _padding_batch(core)  # the engine passes the batch's (device) rows
        dev.register_step(batch.seq_ids, batch.start_pos, batch.q_lens)
        jax.device_get((verified, used))
        if core.host_tier is not None:  # kv_offload.py's reload: a no-op attach
            jax.device_get(dev.attach_reloaded(i32, cand, cand, f))
    dev.fork(np.int32(0), i32, f, i32, i32)
    jax.block_until_ready(dev.state)
