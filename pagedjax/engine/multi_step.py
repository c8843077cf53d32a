"""Multi-step decoding: up to K engine iterations in one jitted program.

When nothing needs the host between iterations (docs/engine.md, "Multi-step decoding"),
``LLMEngine.step`` hands over to ``MultiStepDecoder.step``, which dispatches one
``lax.while_loop`` whose body is a whole engine iteration:

    schedule -> (pure decode of RUNNING sequences?) -> forward + sample + append ids
             -> stop-id / EOS check on device -> register filled prefix blocks -> update

and then reads the K x S sampled ids (and logprobs) back in one transfer (after two
scalars: how many iterations ran and why it stopped). The host
replays them in iteration order through the same ``SequenceState.record`` the one-step
path uses (detokenization, stop checks, logprobs), so the outputs are the ones K single
steps would give: the schedule is the same jitted function, the sampler's keys are
fold_in(seed, sample index, output position), and the stop rules run on device and host.

Exit rules (the loop stops before K iterations when):

- EXIT_SHAPE: the next ``schedule`` is not a pure decode of sequences that were already
  RUNNING (an admission or a prefill chunk, a preemption, a rejection, more rows than the
  compiled bucket S). That iteration is rolled back: its schedule is discarded (the state
  before it is kept, nothing ran), and the host's next one-step ``step`` schedules it
  again, identically.
- EXIT_IDLE: no sequence is RUNNING any more (all finished).
- EXIT_FINISH: a sequence finished while requests wait on the host for a slot
  (``stop_on_finish``), so the host can recycle the slot and admit them.
- EXIT_DONE: the K iterations ran (or the ``max_iters`` asked for).

The loop compiles once per loop bucket S (``loop_buckets``; T = S: one token per row);
K is static (the size of the output buffers), the number of iterations to run is a
traced argument.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pagedjax.engine import sharing
from pagedjax.engine.block_hashes import extend_hashes
from pagedjax.engine.buckets import pick
from pagedjax.engine.core import EngineCore
from pagedjax.engine.outputs import RequestOutput
from pagedjax.sampling.sampler import SamplerOutput
from pagedjax.scheduler import FINISHED, RUNNING, recycle, schedule, update

# Stop token ids (EOS + stop_token_ids) checked on device, per slot; a request with more
# runs one step at a time.
MAX_STOP_IDS = 16

# The loop pads S up to at least this many rows (or max_num_seqs when smaller): a decode
# step's cost hardly depends on S at small S (the weights are read once per step), and
# fewer buckets mean fewer loop programs to compile and warm up.
MIN_LOOP_SEQS = 8

# K for num_scheduler_steps="auto", by device platform. CPU: 1, because on the 2-core box
# the loop did not beat the one-step path (issue 13's run: 985 vs 1,014 tok/s at K = 8;
# docs/benchmarks.md "num_scheduler_steps"): there the host's work per step hides behind
# the device step's. Accelerators: 8, where each returned step costs a host round trip
# that the loop removes (vLLM's multi-step used 8 by default); not measured on a GPU yet.
AUTO_STEPS = {"cpu": 1, "gpu": 8, "tpu": 8}


def resolve_num_steps(num_steps: int | str, platform: str) -> int:
    """K for the engine: an int as given, "auto" from AUTO_STEPS (8 for other platforms)."""
    if num_steps == "auto":
        return AUTO_STEPS.get(platform, 8)
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_scheduler_steps must be 'auto' or >= 1, got {num_steps!r}")
    return num_steps

EXIT_DONE, EXIT_IDLE, EXIT_SHAPE, EXIT_FINISH = 0, 1, 2, 3
EXIT_NAMES = {EXIT_DONE: "done", EXIT_IDLE: "idle", EXIT_SHAPE: "shape", EXIT_FINISH: "finish"}
_GOING = -1


def loop_buckets(seq_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The sequence buckets the loop compiles for: the engine's, below MIN_LOOP_SEQS
    merged into one (e.g. (1, 2, 4, 8, 16) -> (8, 16); (1, 2) -> (2,))."""
    floor = min(MIN_LOOP_SEQS, seq_buckets[-1])
    return tuple(sorted({max(s, floor) for s in seq_buckets}))


class LoopOutput(NamedTuple):
    """What one loop returns (K = buffer size, S = sequence bucket, L = top logprobs).
    Entries at iterations >= num_iters are garbage.

    num_iters int32[]: iterations that ran. exit_reason int32[]: EXIT_*.
    seq_ids int32[K, S]: slot of each batch row (-1 padding). start_pos int32[K, S]:
    the row's position (its KV was written). token_ids, logprobs, ranks [K, S]; top_ids,
    top_logprobs [K, S, L]: the sampler's output. filled int32[K, S]: the block the
    row's step completed (prefix caching), -1 if none. used, unshared int32[K]: blocks
    referenced / blocks without sharing, after each schedule (stats).
    status int32[max_seqs]: the scheduler status after the loop (host cross-check).
    """

    num_iters: jax.Array
    exit_reason: jax.Array
    seq_ids: jax.Array
    start_pos: jax.Array
    token_ids: jax.Array
    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    filled: jax.Array
    used: jax.Array
    unshared: jax.Array
    status: jax.Array


def decode_loop(
    runner: Any,
    policy: Any,
    config: Any,
    num_steps: int,
    params: Any,
    state: Any,
    kv: Any,
    tokens: jax.Array,
    sampling: Any,
    stop_ids: jax.Array,
    max_iters: jax.Array,
    stop_on_finish: jax.Array,
    *,
    num_seqs: int,
) -> tuple[Any, Any, jax.Array, LoopOutput]:
    """Up to min(max_iters, num_steps) decode iterations (see the module docstring).

    runner: ModelRunner (its ``forward_sample``); policy, config: the scheduler's.
    stop_ids int32[max_seqs, MAX_STOP_IDS]: per slot, ids that finish it (EOS unless
    ignore_eos, and stop_token_ids), -1 padded. stop_on_finish bool[]: exit after an
    iteration in which a sequence finished. Returns (state', kv', tokens', LoopOutput).
    """
    s_b, k_b, n = num_seqs, num_steps, config.max_seqs
    bs = runner.block_size
    top_k = min(runner.max_logprobs, runner.arch.vocab_size)
    caching = getattr(state.mem, "prefix", None) is not None

    def iteration(state, kv, tokens):
        st1, batch = schedule(policy, config, state)
        rows = batch.seq_ids[:s_b]
        real = rows >= 0
        safe = jnp.maximum(rows, 0)
        decode_only = jnp.where(real, (state.status[safe] == RUNNING) & batch.emits[:s_b], True)
        ok = (
            (batch.num_seqs > 0)
            & (batch.num_seqs <= s_b)
            & (batch.num_tokens == batch.num_seqs)  # q_len 1 per row
            & ~jnp.any(batch.preempted)
            & ~jnp.any(batch.rejected)
            & ~jnp.any(batch.released)  # the host looks the released hits up again
            & jnp.all(decode_only)
            # Swap copies are host work between steps (DeviceState.swap_out / swap_in): a swap-in
            # (or swap-out) step is rolled back and redone by the one-step path.
            & (batch.swap.num_out == 0)
            & (batch.swap.num_in == 0)
        )
        used, unshared = sharing.sharing_usage(bs, st1)
        start = batch.start_pos[:s_b]

        def run(st1, kv, tokens):
            kv, tokens, out, _ = runner.forward_sample(
                params, kv, tokens, st1.mem, batch, sampling, st1.prompt_len, st1.output_len,
                num_tokens=s_b, num_seqs=s_b, all_logits=False,
            )  # fmt: skip
            hit = real & jnp.any(out.token_ids[:, None] == stop_ids[safe], axis=1)
            finished = jnp.zeros((n,), bool).at[:s_b].set(hit)
            filled = jnp.full((s_b,), -1, jnp.int32)
            if caching:  # the block holding position start is full: register it
                full = real & ((start + 1) % bs == 0)
                filled = jnp.where(full, st1.mem.tables.tables[safe, start // bs], -1)
                st1 = sharing.register_step(
                    bs, st1, tokens, batch.seq_ids, batch.start_pos, batch.q_lens
                )
            st2 = update(policy, config, st1, batch, finished)
            return st2, kv, tokens, out, filled

        def rollback(st1, kv, tokens):
            del st1  # the schedule is discarded: the state before it is kept
            zeros = runner_out_shapes(s_b, top_k)
            return state, kv, tokens, zeros, jnp.full((s_b,), -1, jnp.int32)

        st, kv, tokens, out, filled = lax.cond(ok, run, rollback, st1, kv, tokens)
        rec = (rows, start, out, filled, used, unshared)
        return ok, st, kv, tokens, rec

    def cond(c):
        i, code = c[0], c[1]
        return (i < jnp.minimum(max_iters, k_b)) & (code == _GOING)

    def body(c):
        i, code, state, kv, tokens, buf = c
        ok, st, kv, tokens, (rows, start, out, filled, used, unshared) = iteration(
            state, kv, tokens
        )
        real = rows >= 0
        ended = jnp.any(real & (st.status[jnp.maximum(rows, 0)] == FINISHED))
        running = jnp.any(st.status == RUNNING)
        code = jnp.where(
            ~ok,
            EXIT_SHAPE,
            jnp.where(stop_on_finish & ended, EXIT_FINISH, jnp.where(running, _GOING, EXIT_IDLE)),
        ).astype(jnp.int32)
        new = (rows, start, out.token_ids, out.logprobs, out.ranks, out.top_ids,
               out.top_logprobs, filled, used, unshared)  # fmt: skip
        buf = tuple(b.at[i].set(x) for b, x in zip(buf, new, strict=True))
        return i + ok.astype(jnp.int32), code, st, kv, tokens, buf

    f32, i32 = jnp.float32, jnp.int32
    buf = (
        jnp.full((k_b, s_b), -1, i32),
        jnp.zeros((k_b, s_b), i32),
        jnp.zeros((k_b, s_b), i32),
        jnp.zeros((k_b, s_b), f32),
        jnp.zeros((k_b, s_b), i32),
        jnp.zeros((k_b, s_b, top_k), i32),
        jnp.zeros((k_b, s_b, top_k), f32),
        jnp.full((k_b, s_b), -1, i32),
        jnp.zeros((k_b,), i32),
        jnp.zeros((k_b,), i32),
    )
    init = (jnp.int32(0), jnp.int32(_GOING), state, kv, tokens, buf)
    i, code, state, kv, tokens, buf = lax.while_loop(cond, body, init)
    code = jnp.where(code == _GOING, EXIT_DONE, code)
    return state, kv, tokens, LoopOutput(i, code, *buf, state.status)


def runner_out_shapes(s: int, top_k: int) -> tuple:
    """Zeros shaped like the sampler's output for S rows (the rollback branch's value)."""
    f32, i32 = jnp.float32, jnp.int32
    return SamplerOutput(
        jnp.zeros((s,), i32),
        jnp.zeros((s,), f32),
        jnp.zeros((s,), i32),
        jnp.zeros((s, top_k), i32),
        jnp.zeros((s, top_k), f32),
    )


class _Pending(NamedTuple):
    owners: dict  # slot -> (RequestState, SequenceState) at dispatch
    out: LoopOutput  # device arrays (top_* None unless a row wants logprobs)
    want_top: bool
    t0: float


@dataclass
class MultiStepStats:
    """Counters since the last reset (``LLMEngine.stats()`` reports them)."""

    loops: int = 0  # loop dispatches that ran >= 1 iteration
    iterations: int = 0  # engine iterations run inside loops
    rolled_back: int = 0  # dispatches whose first iteration was not a pure decode
    pipelined: int = 0  # loops dispatched before the host replayed the previous one
    exits: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # why the one-step path ran


class MultiStepDecoder:
    """Runs the decode loop for an engine (see the module docstring).

    num_steps: K, the most iterations per dispatch (static: the output buffers' size).
    ``steps_per_call`` (default K, at most K) is how many a dispatch asks for; changing
    it does not recompile. ``enabled = False`` makes ``step`` always decline.
    """

    def __init__(self, runner: Any, policy: Any, config: Any, num_steps: int):
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.num_steps = num_steps
        self.steps_per_call = num_steps
        self.enabled = num_steps > 1
        self.trace_count: dict[int, int] = {}
        self.stats = MultiStepStats()
        self._runner = runner
        self._loop_fn = functools.partial(decode_loop, runner, policy, config, num_steps)
        # Positional: (params, state, kv, tokens, sampling, stop_ids, max_iters,
        # stop_on_finish); the state, the KV pool and the token buffer are donated.
        self.loop = jax.jit(self._traced, static_argnames=("num_seqs",), donate_argnums=(1, 2, 3))
        n = config.max_seqs
        ids = np.arange(n, dtype=np.int32)
        self.recycle = jax.jit(lambda s, m: recycle(s, ids, m), donate_argnums=(0,))
        self._stop_cache: tuple[Any, jax.Array] | None = None
        self.pipeline = True
        self._last_pure_decode = False  # see note_step
        self._noted: dict[int, Any] = {}  # id -> the SequenceState (kept alive)
        self._inflight: _Pending | None = None  # a loop dispatched, not yet read
        self.last_loop_seconds = 0.0  # wall time of the last dispatch + transfer
        self.last_loop: tuple[Any, Any, int] | None = None  # seq_ids, start_pos, iterations

    def _traced(self, *args: Any, num_seqs: int) -> Any:
        self.trace_count[num_seqs] = self.trace_count.get(num_seqs, 0) + 1  # trace time only
        return self._loop_fn(*args, num_seqs=num_seqs)

    # ------------------------------------------------------------------ host side

    def ineligible(self, core: EngineCore) -> str | None:
        """Why the loop cannot run now (None: it can). Host events that need the host
        between iterations keep the one-step path."""
        if not self.enabled or self.steps_per_call <= 1:
            return "disabled"
        for req, seq in core.book.slot_owner.values():
            # No token yet: a prompt (or an n > 1 child's last prompt token) to compute,
            # unless the last one-step schedule saw it and still ran a pure decode (it
            # waits for memory or a running-sequence place: the loop can run meanwhile,
            # and exits, rolled back, when the schedule admits it).
            noted = self._noted.get(id(seq)) is seq
            if not seq.detok.ids and not (self._last_pure_decode and noted):
                return "prefill"
            if seq.params.stop:
                return "stop_strings"  # only the host detokenizer can see them
            if req.pending:
                return "fork"  # n > 1 samples still to fork from sample 0
            if req.host_driven:
                return "beam_search"  # the host picks each step's tokens
            if len(core.book.stop_ids(seq)) > MAX_STOP_IDS:
                return "many_stop_ids"
        return None

    def note_step(self, core: EngineCore, host: dict[str, Any]) -> None:
        """After a one-step schedule (its batch sizes read on the host): remember whether
        it was a pure decode, and which sequences held slots then."""
        n = int(host["num_seqs"])
        self._last_pure_decode = (
            n > 0 and int(host["num_tokens"]) == n and not host["preempted"].any()
        )
        self._noted = {id(seq): seq for _, seq in core.book.slot_owner.values()}

    def stop_ids(self, core: EngineCore) -> jax.Array:
        """int32[max_seqs, MAX_STOP_IDS] for the current slot owners (uploaded again only
        when some slot's stop ids change)."""
        owners = core.book.slot_owner.items()
        key = tuple(sorted((s, tuple(sorted(core.book.stop_ids(q)))) for s, (_, q) in owners))
        if self._stop_cache is None or self._stop_cache[0] != key:
            arr = np.full((core.max_seqs, MAX_STOP_IDS), -1, np.int32)
            for slot, ids in key:
                arr[slot, : min(len(ids), MAX_STOP_IDS)] = ids[:MAX_STOP_IDS]  # more: ineligible
            self._stop_cache = (key, jnp.asarray(arr))
        return self._stop_cache[1]

    def step(self, core: EngineCore) -> list[RequestOutput] | None:
        """Run (or finish) one loop; None means "take the one-step path" (not eligible,
        or the loop's first iteration was not a pure decode and was rolled back).

        Pipelining (``pipeline``, default on): when a loop ran all its iterations and the
        host has nothing to do in between (eligible, no queued request), the next loop is
        dispatched as soon as the previous one has finished on the device, before the
        host replays the previous one's tokens (detokenization, stops, outputs), so the
        two overlap. Its outputs are returned by the next ``step`` call.
        """
        if self._inflight is not None:
            pending, self._inflight = self._inflight, None
            return self._finish(core, pending)
        why = self.ineligible(core)
        if why is not None:
            self.stats.skipped[why] = self.stats.skipped.get(why, 0) + 1
            return None
        return self._finish(core, self._dispatch(core))

    def _dispatch(self, core: EngineCore) -> _Pending:
        dev = core.device
        owners = dict(core.book.slot_owner)
        s_b = pick(loop_buckets(core.seq_buckets), min(len(owners), core.max_seqs))
        sampling = dev.sampling()
        t0 = time.perf_counter()
        dev.state, dev.kv, dev.tokens, out = self.loop(
            core.params, dev.state, dev.kv, dev.tokens, sampling,
            self.stop_ids(core), np.int32(self.steps_per_call), np.bool_(bool(core.book.queue)),
            num_seqs=s_b,
        )  # fmt: skip
        want_top = any(seq.logprobs is not None for _, seq in owners.values())
        if not want_top:  # the [K, S, L] arrays stay on device
            out = out._replace(top_ids=None, top_logprobs=None)
        return _Pending(owners, out, want_top, t0)

    def _finish(self, core: EngineCore, pending: _Pending) -> list[RequestOutput] | None:
        """Wait for a dispatched loop, maybe dispatch the next (pipelining), then read
        its results (one transfer) and replay them on the host."""
        head = jax.device_get((pending.out.num_iters, pending.out.exit_reason))  # waits
        n_it, code = int(head[0]), int(head[1])
        if (
            code == EXIT_DONE
            and self.pipeline
            and not core.book.queue
            and self.ineligible(core) is None
        ):
            self._inflight = self._dispatch(core)
            self.stats.pipelined += 1
        got = jax.device_get(pending.out)  # one transfer of all K x S results
        self.last_loop_seconds = time.perf_counter() - pending.t0
        if n_it == 0:
            self.stats.rolled_back += 1
            return None
        self.stats.loops += 1
        self.stats.iterations += n_it
        self.last_loop = (got.seq_ids, got.start_pos, n_it)  # step observers (step_record.py)
        reason = EXIT_NAMES[code]
        self.stats.exits[reason] = self.stats.exits.get(reason, 0) + 1
        return self._emit(core, pending.owners, got, n_it, pending.want_top)

    def _emit(
        self, core: EngineCore, owners: dict, got: LoopOutput, n_it: int, want_top: bool
    ) -> list[RequestOutput]:
        """Replay the loop's iterations on the host, in order, as ``_run`` does for one.

        owners: the slot owners when the loop was dispatched. A request aborted since
        (possible with pipelining) is skipped; its slot may already serve another one."""
        touched: dict[str, Any] = {}
        finished: list[tuple[int, Any]] = []
        b = core.block_size
        book = core.book
        live = book.is_live

        for j in range(n_it):
            core.sharing.record_usage(int(got.used[j]), int(got.unshared[j]))
            for r in np.flatnonzero(got.seq_ids[j] >= 0):
                slot = int(got.seq_ids[j, r])
                req, seq = owners[slot]
                if not live(req):
                    continue
                if seq.finish_reason is not None:
                    raise RuntimeError(
                        f"multi-step: slot {slot} ran after the host saw it finish"
                        " (device and host stop rules disagree)"
                    )
                top = None
                if want_top:
                    top = (got.ranks[j, r], got.top_ids[j, r], got.top_logprobs[j, r])
                blk = int(got.filled[j, r])
                if blk >= 0:  # the block ending at position start_pos is now cached
                    hi = int(got.start_pos[j, r]) // b + 1
                    extend_hashes(seq.hashes, req.prompt_token_ids + seq.detok.ids, b, hi)
                    core.prefix_index.record(seq.hashes[hi - 1 : hi], [blk])
                if seq.record(
                    int(got.token_ids[j, r]), float(got.logprobs[j, r]), top, book.eos
                ):
                    finished.append((slot, seq))
                touched[req.request_id] = req
        core.num_steps += n_it
        recycle_mask = np.zeros(core.max_seqs, bool)
        for slot, _ in finished:
            recycle_mask[slot] = True
        for slot, (req, seq) in owners.items():
            # Cross-check: the device finished exactly the sequences the host did.
            current = book.slot_owner.get(slot)
            if live(req) and current is not None and current[1] is seq:
                if recycle_mask[slot] != (got.status[slot] == FINISHED):
                    raise RuntimeError(
                        f"multi-step: host and device disagree on whether slot {slot} finished"
                    )
        if recycle_mask.any():
            core.device.state = self.recycle(core.device.state, recycle_mask)
            for _, seq in finished:
                book.release_slot(seq)
        outputs = [req.output() for req in touched.values()]
        for o in outputs:
            if o.finished:
                book.retire(o.request_id)
        return outputs

    def reset_stats(self) -> None:
        self.stats = MultiStepStats()
