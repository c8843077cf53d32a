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

The program itself, its exit rules and its output: ``decode_loop.py``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from pagedjax.engine.buckets import pick
from pagedjax.engine.core import EngineCore
from pagedjax.engine.decode_loop import EXIT_DONE, EXIT_NAMES, LoopOutput, LoopSpec, decode_loop
from pagedjax.engine.host_arrays import upload
from pagedjax.engine.logit_controls import needs_host
from pagedjax.engine.model_runner import has_fsm_table
from pagedjax.engine.output_processor import OutputProcessor, SampledRows
from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.spec.verify import sampled_offsets
from pagedjax.scheduler import FINISHED

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

def loop_buckets(seq_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The sequence buckets the loop compiles for: the engine's, below MIN_LOOP_SEQS
    merged into one (e.g. (1, 2, 4, 8, 16) -> (8, 16); (1, 2) -> (2,))."""
    floor = min(MIN_LOOP_SEQS, seq_buckets[-1])
    return tuple(sorted({max(s, floor) for s in seq_buckets}))


class _Pending(NamedTuple):
    owners: dict  # slot -> (RequestState, SequenceState) at dispatch
    out: LoopOutput  # device arrays (top_* None unless a row wants logprobs)
    want_top: bool
    t0: float
    fsm_version: int  # LogitControls.fsm_version at dispatch (the table it ran with)


@dataclass
class MultiStepStats:
    """Counters since the last reset (``LLMEngine.stats()`` reports them)."""

    loops: int = 0  # loop dispatches that ran >= 1 iteration
    iterations: int = 0  # engine iterations run inside loops
    rolled_back: int = 0  # dispatches whose first iteration was not a pure decode
    pipelined: int = 0  # loops dispatched before the host replayed the previous one
    exits: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # why the one-step path ran


def _fsm_version(core: EngineCore) -> int:
    """The device FSM table's version (LogitControls.fsm_version; 0 without controls)."""
    return core.controls.fsm_version if core.controls is not None else 0


class MultiStepDecoder:
    """Runs the decode loop for an engine (see the module docstring).

    num_steps: K, the most iterations per dispatch (static: the output buffers' size).
    ``steps_per_call`` (default K, at most K) is how many a dispatch asks for; changing
    it does not recompile. ``enabled = False`` makes ``step`` always decline.
    """

    def __init__(self, runner: Any, policy: Any, config: Any, num_steps: int,
                 speculator: Any = None):  # fmt: skip
        """speculator: the engine's SpeculativeDecoder when its drafts can be made on
        device (``fusable``: the n-gram method): the loop then plans, drafts and verifies
        in each iteration and counts into its counters."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.speculator = speculator
        spec = None
        if speculator is not None:
            c = speculator.config
            spec = LoopSpec(speculator.verifier, speculator.k, c.prompt_lookup_min,
                            c.prompt_lookup_max)  # fmt: skip
        self.num_steps = num_steps
        self.steps_per_call = num_steps
        self.enabled = num_steps > 1
        self.trace_count: dict[int, int] = {}
        self.stats = MultiStepStats()
        self._runner = runner
        self._loop_fn = functools.partial(decode_loop, runner, policy, config, num_steps, spec)
        # Positional: (params, state, kv, tokens, sampling, stop_ids, max_iters,
        # stop_on_finish, spec_k); the state, the KV pool and the token buffer are donated.
        self.loop = jax.jit(self._traced, static_argnames=("num_seqs",), donate_argnums=(1, 2, 3))
        # Compiled loops by bucket S, called by ``run_loop`` instead of ``loop``: the warm-up
        # fills it, so a warmed-up engine never traces the loop again, even when a process
        # with many jitted functions evicts it from jit's cache (measured: 9,000 other
        # jitted signatures in one process retraced it).
        self.programs: dict[int, Any] = {}
        self._stop_cache: tuple[Any, jax.Array] | None = None
        self.pipeline = True
        self._last_pure_decode = False  # see note_step
        self._noted: dict[int, Any] = {}  # id -> the SequenceState (kept alive)
        self._inflight: _Pending | None = None  # a loop dispatched, not yet read
        self.last_loop_seconds = 0.0  # wall time of the last dispatch + transfer
        # seq_ids, start_pos, iterations, spec_lens of the last loop (step observers)
        self.last_loop: tuple[Any, Any, int, Any] | None = None

    def run_loop(self, *args: Any, num_seqs: int) -> Any:
        """``loop(*args, num_seqs=...)`` through the compiled program of ``programs`` when
        there is one for that bucket (the same executable ``loop`` would run)."""
        program = self.programs.get(num_seqs)
        if program is not None and not has_fsm_table(args):  # see ModelRunner.run
            return program(*args)
        return self.loop(*args, num_seqs=num_seqs)

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
            if seq.detok.matches_stop_strings:
                # Only the host detokenizer can see them. Without detokenization here (the
                # engine core process) the client cuts the tokens run past a stop string.
                return "stop_strings"
            if req.pending:
                return "fork"  # n > 1 samples still to fork from sample 0
            if req.host_driven:
                return "beam_search"  # the host picks each step's tokens
            if len(core.book.stop_ids(seq)) > MAX_STOP_IDS:
                return "many_stop_ids"
            if core.controls is not None and needs_host(core.book, req, seq):
                return "structured_output"  # grammar, bad_words or min_tokens masks
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
            self._stop_cache = (key, upload(arr))
        return self._stop_cache[1]

    def step(self, core: EngineCore, outputs: OutputProcessor) -> list[RequestOutput] | None:
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
            return self._finish(core, outputs, pending)
        why = self.ineligible(core)
        if why is not None:
            self.stats.skipped[why] = self.stats.skipped.get(why, 0) + 1
            return None
        return self._finish(core, outputs, self._dispatch(core))

    def _dispatch(self, core: EngineCore, fsm_state: Any = None) -> _Pending:
        dev = core.device
        owners = dict(core.book.slot_owner)
        s_b = pick(loop_buckets(core.seq_buckets), min(len(owners), core.max_seqs))
        sampling = dev.sampling()
        if fsm_state is not None and sampling.fsm_table.shape[0]:
            sampling = sampling._replace(fsm_state=fsm_state)
        t0 = time.perf_counter()
        out = dev.run_loop(
            self.run_loop, core.params, sampling,
            self.stop_ids(core), np.int32(self.steps_per_call), np.bool_(bool(core.book.queue)),
            np.int32(0 if self.speculator is None else self.speculator.loop_k(core)),
            num_seqs=s_b,
        )  # fmt: skip
        want_top = any(seq.logprobs is not None for _, seq in owners.values())
        if not want_top:  # the [K, S, L] arrays stay on device
            out = out._replace(top_ids=None, top_logprobs=None)
        return _Pending(owners, out, want_top, t0, _fsm_version(core))

    def _finish(self, core: EngineCore, outputs: OutputProcessor,
                pending: _Pending) -> list[RequestOutput] | None:  # fmt: skip
        """Wait for a dispatched loop, maybe dispatch the next (pipelining), then read
        its results (one transfer) and replay them on the host."""
        head = jax.device_get((pending.out.num_iters, pending.out.exit_reason))  # waits
        n_it, code = int(head[0]), int(head[1])
        if (
            code == EXIT_DONE
            and self.pipeline
            and not core.book.queue
            and self.ineligible(core) is None
            and _fsm_version(core) == pending.fsm_version
        ):
            # Device FSM states advanced in the loop: the host's rows get them only after
            # replaying it, so the next loop starts from the loop's own (no queue: the
            # slots' owners are the same, or finished; the same table: same version).
            self._inflight = self._dispatch(core, pending.out.fsm_state)
            self.stats.pipelined += 1
        got = jax.device_get(pending.out)  # one transfer of all K x S results
        self.last_loop_seconds = time.perf_counter() - pending.t0
        if n_it == 0:
            self.stats.rolled_back += 1
            return None
        self.stats.loops += 1
        self.stats.iterations += n_it
        self.last_loop = (got.seq_ids, got.start_pos, n_it, got.spec_lens)  # step_record.py
        reason = EXIT_NAMES[code]
        self.stats.exits[reason] = self.stats.exits.get(reason, 0) + 1
        return self._emit(core, outputs, pending.owners, got, n_it, pending.want_top)

    def _emit(self, core: EngineCore, outputs: OutputProcessor, owners: dict,
              got: LoopOutput, n_it: int, want_top: bool) -> list[RequestOutput]:  # fmt: skip
        """Replay the loop's iterations through the output processor, in order, as the
        one-step path does for one iteration.

        owners: the slot owners when the loop was dispatched. A request aborted since
        (possible with pipelining) is skipped; its slot may already serve another one."""
        out = outputs.begin()
        live = core.book.is_live
        for j in range(n_it):
            core.sharing.record_usage(int(got.used[j]), int(got.unshared[j]))
            rows = [int(r) for r in np.flatnonzero(got.seq_ids[j] >= 0)]
            row_owners = [owners[int(got.seq_ids[j, r])] for r in rows]
            kept = [i for i, (req, _) in enumerate(row_owners) if live(req)]
            for i in kept:
                if row_owners[i][1].finish_reason is not None:
                    raise RuntimeError(
                        f"multi-step: slot {row_owners[i][1].slot} ran after the host saw it"
                        " finish (device and host stop rules disagree)"
                    )
            spec_lens = got.spec_lens[j, rows].astype(np.int64)
            acc = got.accepted[j, rows].astype(np.int64)
            top = (got.ranks[j], got.top_ids[j], got.top_logprobs[j]) if want_top else None
            sampled = SampledRows(got.token_ids[j], got.logprobs[j], top,
                                  sampled_offsets(spec_lens, len(rows)), 1 + acc)  # fmt: skip
            recorded = outputs.record(out, row_owners, kept, sampled)
            for i in kept:  # after the record: a block may end in accepted drafts
                req, seq = row_owners[i]
                for blk, end in zip(got.filled[j, rows[i]], got.filled_end[j, rows[i]],
                                    strict=True):  # fmt: skip
                    if blk >= 0:
                        outputs.record_filled(req, seq, int(end), int(blk))
            if self.speculator is not None and spec_lens.any():
                live_rows = np.zeros(len(rows), bool)
                live_rows[kept] = True
                self.speculator.count(np.where(live_rows, spec_lens, 0), acc, recorded)
                self.speculator.counters.fused_steps += 1
        core.num_steps += n_it
        book = core.book
        for slot, (req, seq) in owners.items():
            # Cross-check: the device finished exactly the sequences the host did.
            current = book.slot_owner.get(slot)
            if live(req) and current is not None and current[1] is seq:
                if out.recycle[slot] != (got.status[slot] == FINISHED):
                    raise RuntimeError(
                        f"multi-step: host and device disagree on whether slot {slot} finished"
                    )
        if out.recycle.any():
            core.device.recycle(out.recycle)
        return outputs.finish(out)

    def reset_stats(self) -> None:
        self.stats = MultiStepStats()
