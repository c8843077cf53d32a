"""The fused K-step decode program: up to K engine iterations in one ``lax.while_loop``.

Each iteration is a whole engine iteration on device (``multi_step.py`` decides when
the host may hand over, and replays the results through the output processor):

    (speculative slots and n-gram drafts, when speculating) -> schedule
    -> (pure decode of RUNNING rows?) -> forward + sample (or verify the drafts)
    -> stop-id / EOS check on device -> register filled prefix blocks -> update

Exit rules (the loop stops before K iterations when):

- EXIT_SHAPE: the next ``schedule`` is not a pure decode of sequences that were already
  RUNNING (an admission or a prefill chunk, a preemption, a rejection, more rows than the
  compiled bucket S, with the host tier on an eviction of a cached block). That iteration
  is rolled back: its schedule is discarded (the state before it is kept, nothing ran),
  and the host's next one-step ``step`` schedules it again, identically.
- EXIT_IDLE: no sequence is RUNNING any more (all finished).
- EXIT_FINISH: a sequence finished while requests wait on the host for a slot
  (``stop_on_finish``), so the host can recycle the slot and admit them.
- EXIT_DONE: the K iterations ran (or the ``max_iters`` asked for).

The loop compiles once per loop bucket S (``loop_buckets``; T = S: one token per row,
S * (1 + k) when speculating);
K is static (the size of the output buffers), the number of iterations to run is a
traced argument.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pagedjax.engine import sharing
from pagedjax.engine.spec.ngram_device import propose_ngram
from pagedjax.engine.spec.verify import sampled_rows, write_drafts
from pagedjax.sampling.sampler import SamplerOutput, fsm_walk
from pagedjax.sampling.tensors import take_rows
from pagedjax.scheduler import FINISHED, RUNNING, output_target, schedule, update

EXIT_DONE, EXIT_IDLE, EXIT_SHAPE, EXIT_FINISH = 0, 1, 2, 3
EXIT_NAMES = {EXIT_DONE: "done", EXIT_IDLE: "idle", EXIT_SHAPE: "shape", EXIT_FINISH: "finish"}
_GOING = -1


class LoopSpec(NamedTuple):
    """Speculation inside the loop (static): the n-gram proposer's knobs and the
    verification program. k: num_speculative_tokens; min_n, max_n: the n-gram range."""

    verifier: Any  # spec.verify.SpecVerifier
    k: int
    min_n: int
    max_n: int


class LoopOutput(NamedTuple):
    """What one loop returns (K = buffer size, S = sequence bucket, P = sampled rows per
    iteration: S, or min(T, S * (1 + k)) when speculating, L = top logprobs, F = blocks a
    row can fill in one iteration). Entries at iterations >= num_iters are garbage.

    num_iters int32[]: iterations that ran. exit_reason int32[]: EXIT_*.
    seq_ids int32[K, S]: slot of each batch row (-1 padding). start_pos int32[K, S]:
    the row's first position (its KV was written). spec_lens, accepted int32[K, S]: the
    row's drafts and how many were accepted (0 without speculation). token_ids,
    logprobs, ranks [K, P]; top_ids, top_logprobs [K, P, L]: the sampler's output, row
    r's 1 + accepted tokens packed from ``verify.sampled_offsets(spec_lens)[r]`` (row r
    is entry r without speculation). filled int32[K, S, F]: blocks the row's step
    completed (prefix caching), -1 if none; filled_end int32[K, S, F]: the last position
    of each. used, unshared int32[K]: blocks referenced / blocks without sharing, after
    each schedule (stats). status int32[max_seqs]: the scheduler status after the loop.
    fsm_state int32[max_seqs]: the slots' device FSM states after the loop (-1: none;
    a pipelined next loop starts from them, multi_step.py).
    """

    num_iters: jax.Array
    exit_reason: jax.Array
    seq_ids: jax.Array
    start_pos: jax.Array
    spec_lens: jax.Array
    accepted: jax.Array
    token_ids: jax.Array
    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    filled: jax.Array
    filled_end: jax.Array
    used: jax.Array
    unshared: jax.Array
    status: jax.Array
    fsm_state: jax.Array


def decode_loop(
    runner: Any,
    policy: Any,
    config: Any,
    num_steps: int,
    spec: LoopSpec | None,
    params: Any,
    state: Any,
    kv: Any,
    tokens: jax.Array,
    sampling: Any,
    stop_ids: jax.Array,
    max_iters: jax.Array,
    stop_on_finish: jax.Array,
    spec_k: jax.Array,
    *,
    num_seqs: int,
) -> tuple[Any, Any, jax.Array, LoopOutput]:
    """Up to min(max_iters, num_steps) decode iterations (see the module docstring).

    runner: ModelRunner (its ``forward_sample``); policy, config: the scheduler's.
    spec: speculation in the loop (None: none): each iteration plans the decoding rows'
    speculative slots and their n-gram drafts on device, schedules them, and verifies
    them in the iteration's program, as the one-step path does over several programs.
    stop_ids int32[max_seqs, MAX_STOP_IDS]: per slot, ids that finish it (EOS unless
    ignore_eos, and stop_token_ids), -1 padded. stop_on_finish bool[]: exit after an
    iteration in which a sequence finished. spec_k int32[]: drafts per row at most in
    this dispatch, 0 = none (the host's conditions and the batch-size table,
    ``SpeculativeDecoder.loop_k``; a traced value: no program per k). Returns (state', kv', tokens',
    LoopOutput).
    """
    s_b, k_b, n = num_seqs, num_steps, config.max_seqs
    bs = runner.block_size
    top_k = min(runner.max_logprobs, runner.arch.vocab_size)
    caching = getattr(state.mem, "prefix", None) is not None
    ks = 0 if spec is None else spec.k
    t_b = s_b * (1 + ks)  # every row may verify k drafts
    p_b = s_b if spec is None else sampled_rows(t_b, s_b, ks)
    f_b = (ks + bs) // bs  # blocks one row can complete in an iteration

    fsm = sampling.fsm_table.shape[0] > 0  # a device FSM table (static)

    def plan(state, tokens, sampling):
        total = state.prompt_len + state.output_len
        target = output_target(state, config.max_model_len)
        decoding = (
            (spec_k > 0) & (state.status == RUNNING) & (total - state.num_computed == 1)
            & (state.output_len >= 1)
        )  # fmt: skip
        cap = jnp.minimum(spec_k, ks)
        want = jnp.where(decoding, jnp.clip(target - state.output_len - 1, 0, cap), 0)
        # Search only the decoding slots, compacted to the batch's s_b rows: the search
        # costs O(rows * max_model_len), and over all max_seqs slots it cost ~49 ms an
        # iteration at 256 x 8192 (more than SmolLM2's batch-1 decode step), ~0.1 ms at
        # one row. A decoding slot past the first s_b (the loop exits on such a shape
        # anyway) just gets no drafts this iteration: speculation is lossless.
        idx = jnp.nonzero(decoding, size=s_b, fill_value=n)[0]  # [s_b], n = padding
        gather = jnp.minimum(idx, n - 1)
        d, c = propose_ngram(
            tokens[gather], total[gather], jnp.where(idx < n, want[gather], 0),
            min_n=spec.min_n, max_n=spec.max_n, k=ks,
        )  # fmt: skip
        drafts = jnp.full((n, ks), -1, jnp.int32).at[idx].set(d, mode="drop")
        counts = jnp.zeros((n,), jnp.int32).at[idx].set(c, mode="drop")
        return drafts, counts

    def iteration(state, kv, tokens, sampling):
        drafts = lookahead = None
        if spec is not None:
            drafts, lookahead = plan(state, tokens, sampling)
        st1, batch = schedule(policy, config, state, lookahead)
        rows = batch.seq_ids[:s_b]
        real = rows >= 0
        safe = jnp.maximum(rows, 0)
        spec_lens = jnp.where(real, batch.spec_lens[:s_b], 0)
        decode_only = jnp.where(real, (state.status[safe] == RUNNING) & batch.emits[:s_b], True)
        ok = (
            (batch.num_seqs > 0)
            & (batch.num_seqs <= s_b)
            & jnp.all(jnp.where(real, batch.q_lens[:s_b] == 1 + spec_lens, True))
            & (batch.num_tokens == batch.num_seqs + jnp.sum(spec_lens))  # no row past S
            & ~jnp.any(batch.preempted)
            & ~jnp.any(batch.rejected)
            & ~jnp.any(batch.released)  # the host looks the released hits up again
            & jnp.all(decode_only)
            # Swap copies are host work between steps (DeviceState.swap_out / swap_in): a swap-in
            # (or swap-out) step is rolled back and redone by the one-step path.
            & (batch.swap.num_out == 0)
            & (batch.swap.num_in == 0)
        )
        evicted = getattr(st1.mem, "evicted", None)
        if evicted is not None:  # host tier: evicted prefix blocks are copied by the host
            ok = ok & ~jnp.any(evicted)  # between steps (kv_offload.py), so roll back too
        used, unshared = sharing.sharing_usage(bs, st1)
        start = batch.start_pos[:s_b]

        def run(st1, kv, tokens, sampling):
            if spec is None:
                kv, tokens, out, _ = runner.forward_sample(
                    params, kv, tokens, st1.mem, batch, sampling, st1.prompt_len,
                    st1.output_len, num_tokens=s_b, num_seqs=s_b, all_logits=False,
                )  # fmt: skip
                acc = jnp.zeros((s_b,), jnp.int32)
                hit = real & jnp.any(out.token_ids[:, None] == stop_ids[safe], axis=1)
                kept = jnp.ones((s_b,), jnp.int32)
                tok = out.token_ids[:, None]  # [S, 1]: each row's recorded token
            else:
                j = jnp.arange(ks)[None, :]
                row_drafts = jnp.where(j < spec_lens[:, None], drafts[safe], -1)
                tokens = write_drafts(tokens, rows, start + 1, row_drafts)
                kv, tokens, out, acc, _ = spec.verifier.verify(
                    params, kv, tokens, st1.mem, batch, batch.spec_lens, sampling,
                    st1.prompt_len, st1.output_len, num_tokens=t_b, num_seqs=s_b,
                )  # fmt: skip
                acc = jnp.where(real, acc, 0)
                # The first stop id inside each row's run of 1 + accepted tokens.
                offset = jnp.cumsum(1 + spec_lens) - (1 + spec_lens)
                jj = jnp.arange(ks + 1)[None, :]
                idx = jnp.minimum(offset[:, None] + jj, p_b - 1)
                tok = out.token_ids[idx]  # [S, k + 1]
                is_stop = jnp.any(tok[:, :, None] == stop_ids[safe][:, None, :], axis=2)
                is_stop = is_stop & (jj <= acc[:, None]) & real[:, None]
                first = jnp.min(jnp.where(is_stop, jj, ks + 1), axis=1)
                hit = first <= acc
                kept = jnp.minimum(first, acc) + 1  # tokens the host records
            finished = jnp.zeros((n,), bool).at[:s_b].set(hit)
            # The positions whose KV stays: the last token and the accepted drafts, cut
            # after a stop as the host's record is (output_processor.register_blocks).
            q_acc = jnp.where(spec_lens > 0, jnp.minimum(1 + acc, kept + 1), 1)
            filled = jnp.full((s_b, f_b), -1, jnp.int32)
            ends = jnp.zeros((s_b, f_b), jnp.int32)
            if caching:  # the blocks completed in [start, start + q_acc): register them
                f = jnp.arange(f_b)[None, :]
                ends = (start[:, None] // bs + f + 1) * bs - 1
                full = real[:, None] & (ends <= (start + q_acc - 1)[:, None])
                col = jnp.clip(start[:, None] // bs + f, 0, st1.mem.tables.tables.shape[1] - 1)
                filled = jnp.where(full, st1.mem.tables.tables[safe[:, None], col], -1)
                q_reg = jnp.zeros_like(batch.q_lens).at[:s_b].set(jnp.where(real, q_acc, 0))
                st1 = sharing.register_step(
                    bs, st1, tokens, batch.seq_ids, batch.start_pos, q_reg
                )
            accepted = None
            if spec is not None:
                accepted = jnp.zeros((n,), jnp.int32).at[:s_b].set(acc)
            st2 = update(policy, config, st1, batch, finished, accepted)
            if fsm:  # device FSM rows advance by their accepted drafts and sampled token
                walk = fsm_walk(take_rows(sampling, safe), tok)  # [S, 1 + accepted at most]
                nxt = walk[jnp.arange(s_b), acc]
                new = sampling.fsm_state.at[jnp.where(real, rows, n)].set(nxt, mode="drop")
                sampling = sampling._replace(fsm_state=new)
            return st2, kv, tokens, sampling, out, acc, filled, ends

        def rollback(st1, kv, tokens, sampling):
            del st1  # the schedule is discarded: the state before it is kept
            zeros = runner_out_shapes(p_b, top_k)
            z = jnp.zeros((s_b,), jnp.int32)
            f = jnp.full((s_b, f_b), -1, jnp.int32)
            return state, kv, tokens, sampling, zeros, z, f, jnp.zeros((s_b, f_b), jnp.int32)

        st, kv, tokens, sampling, out, acc, filled, ends = lax.cond(
            ok, run, rollback, st1, kv, tokens, sampling
        )
        rec = (rows, start, spec_lens, acc, out, filled, ends, used, unshared)
        return ok, st, kv, tokens, sampling, rec

    def cond(c):
        i, code = c[0], c[1]
        return (i < jnp.minimum(max_iters, k_b)) & (code == _GOING)

    def body(c):
        i, code, state, kv, tokens, sampling, buf = c
        ok, st, kv, tokens, sampling, rec = iteration(state, kv, tokens, sampling)
        rows, start, spec_lens, acc, out, filled, ends, used, unshared = rec
        real = rows >= 0
        ended = jnp.any(real & (st.status[jnp.maximum(rows, 0)] == FINISHED))
        running = jnp.any(st.status == RUNNING)
        code = jnp.where(
            ~ok,
            EXIT_SHAPE,
            jnp.where(stop_on_finish & ended, EXIT_FINISH, jnp.where(running, _GOING, EXIT_IDLE)),
        ).astype(jnp.int32)
        new = (rows, start, spec_lens, acc, out.token_ids, out.logprobs, out.ranks,
               out.top_ids, out.top_logprobs, filled, ends, used, unshared)  # fmt: skip
        buf = tuple(b.at[i].set(x) for b, x in zip(buf, new, strict=True))
        return i + ok.astype(jnp.int32), code, st, kv, tokens, sampling, buf

    f32, i32 = jnp.float32, jnp.int32
    buf = (
        jnp.full((k_b, s_b), -1, i32),
        jnp.zeros((k_b, s_b), i32),
        jnp.zeros((k_b, s_b), i32),
        jnp.zeros((k_b, s_b), i32),
        jnp.zeros((k_b, p_b), i32),
        jnp.zeros((k_b, p_b), f32),
        jnp.zeros((k_b, p_b), i32),
        jnp.zeros((k_b, p_b, top_k), i32),
        jnp.zeros((k_b, p_b, top_k), f32),
        jnp.full((k_b, s_b, f_b), -1, i32),
        jnp.zeros((k_b, s_b, f_b), i32),
        jnp.zeros((k_b,), i32),
        jnp.zeros((k_b,), i32),
    )
    init = (jnp.int32(0), jnp.int32(_GOING), state, kv, tokens, sampling, buf)
    i, code, state, kv, tokens, sampling, buf = lax.while_loop(cond, body, init)
    code = jnp.where(code == _GOING, EXIT_DONE, code)
    return state, kv, tokens, LoopOutput(i, code, *buf, state.status, sampling.fsm_state)


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


__all__ = ["EXIT_NAMES", "LoopOutput", "LoopSpec", "decode_loop", "runner_out_shapes"]
