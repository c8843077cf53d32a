"""Swap preemption and gang scheduling of sequence groups.

Engine level: an n > 1 group is swapped out as a group (shared prompt blocks copied
once), its device blocks are reused by another sequence while it is out, it comes back
into other block ids, and its samples equal those of runs without preemption; nothing is
admitted while it is out; both pools get every block back. A host pool too small for a
group falls back to recompute. Memory level (Hypothesis): ``move_rows`` there and back
keeps the rows' sharing and the refcounts of both pools. The scheduler's decisions are
checked against ``reference.py`` in tests/test_scheduler_reference.py (group cases).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import LLM
from pagedjax.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.memory import block_table as btm
from pagedjax.memory.block_pool import create_block_pool
from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.memory.swap import move_rows
from pagedjax.sampling import SamplingParams
from pagedjax.scheduler import FREE, RUNNING, SWAPPED, WAITING
from pagedjax.tokenizer import ByteTokenizer
from tests.test_engine import ARCH, _params

BLOCK, MAX_LEN, MAX_SEQS, BUDGET = 4, 64, 4, 16
NUM_BLOCKS = 12  # 11 usable: the two requests below cannot both finish on device
BYTES_PER_BLOCK = ARCH.kv_bytes_per_token(jnp.float32) * BLOCK
OUT = 12


def _engine(num_blocks: int, swap_blocks: int, mode: str | None) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=MAX_LEN, seed=0),
        cache=CacheConfig(
            block_size=BLOCK,
            num_gpu_blocks_override=num_blocks,
            swap_space=swap_blocks * BYTES_PER_BLOCK / (1 << 30),
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=BUDGET,
            max_num_seqs=MAX_SEQS,
            watermark=0.0,
            preemption_mode=mode,  # type: ignore[arg-type]
        ),
    )
    tok = ByteTokenizer(eos_token_id=ARCH.eos_token_id, bos_token_id=ARCH.bos_token_id)
    # NaN pages: a block read before it holds the sequence's KV poisons the logits.
    return LLMEngine(ARCH, _params(), tok, config, kv_fill_value=float("nan"))


@functools.cache
def _swap_engine() -> LLMEngine:
    return _engine(NUM_BLOCKS, 64, None)  # the paper's default: swap groups of several


PROMPT_A = np.random.default_rng(1).integers(3, ARCH.vocab_size, 8).tolist()
PROMPT_B = np.random.default_rng(2).integers(3, ARCH.vocab_size, 6).tolist()
PROMPT_C = np.random.default_rng(3).integers(3, ARCH.vocab_size, 5).tolist()
GREEDY = SamplingParams(temperature=0.0, max_tokens=OUT + 4, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=OUT, ignore_eos=True, n=2)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Token ids of each sample with the request alone in the engine (no preemption)."""
    engine.add_request("alone", prompt, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out is not None and out.finished
    return [c.token_ids for c in out.outputs]


def _assert_idle(engine: LLMEngine) -> None:
    """Every block back in both pools, refcounts zero, every slot free."""
    mem = engine.state.mem
    assert engine.num_free_blocks() == engine.num_usable_blocks()
    assert engine.num_free_host_blocks() == engine.num_host_blocks
    assert not np.asarray(mem.pool.refcount).any()
    if mem.host_pool is not None:
        assert not np.asarray(mem.host_pool.refcount).any()
        assert not np.asarray(mem.on_host).any()
    assert np.all(np.asarray(engine.state.status) == FREE)
    assert not engine.book.slot_owner and not engine.book.swapped_slots


def _check_refcounts(engine: LLMEngine) -> None:
    """Each pool's refcounts equal the references from the rows it owns."""
    mem = engine.state.mem
    tables = np.asarray(mem.tables.tables)
    on_host = np.asarray(mem.on_host)
    for pool, rows in ((mem.pool, tables[~on_host]), (mem.host_pool, tables[on_host])):
        rc = np.asarray(pool.refcount)
        refs = np.bincount(rows.reshape(-1), minlength=rc.shape[0])
        np.testing.assert_array_equal(rc[1:], refs[1:])


def test_group_swaps_out_and_back_with_identical_samples():
    engine = _swap_engine()
    want_a = _alone(engine, PROMPT_A, GREEDY)
    want_b = _alone(engine, PROMPT_B, SAMPLED)
    want_c = _alone(engine, PROMPT_C, SHORT)
    assert want_b[0] != want_b[1]  # two different samples
    engine.reset_stats()

    # A (one sequence) arrives first, B (n = 2, a group) next: when the pool runs out,
    # B is the latest group and is swapped out whole; C arrives while B is out.
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, SAMPLED)
    done: dict[str, list[list[int]]] = {}
    b_slots: list[int] = []
    b_rows_out: np.ndarray | None = None  # B's device rows just before the swap-out
    b_blocks_out: set[int] = set()
    reused = back_elsewhere = False
    out_blocks_at_swap = None
    c_added = False
    step = 0
    while engine.has_unfinished_requests():
        before = np.asarray(engine.state.status)
        tables = np.asarray(engine.state.mem.tables.tables)
        swapped_blocks = engine.num_swapped_out_blocks
        for o in engine.step():
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
        step += 1
        assert step < 500
        _check_refcounts(engine)
        status = np.asarray(engine.state.status)
        if b_rows_out is None and "b" in engine.book.requests:
            b_slots = [s.slot for s in engine.book.requests["b"].seqs if s.slot is not None]
        if (status == SWAPPED).any():
            # Nothing is admitted while a group is swapped out.
            assert not ((before == WAITING) & (status == RUNNING)).any()
            assert set(np.flatnonzero(status == SWAPPED)) == set(b_slots)
            if b_rows_out is None:
                b_rows_out = tables[b_slots]
                b_blocks_out = set(b_rows_out[b_rows_out > 0].tolist())
                # Shared prompt blocks are copied once.
                out_blocks_at_swap = engine.num_swapped_out_blocks - swapped_blocks
                refs = int((b_rows_out > 0).sum())
                assert out_blocks_at_swap == len(b_blocks_out) < refs
            if not c_added:
                engine.add_request("c", PROMPT_C, SHORT)
                c_added = True
            # While B is out, A writes its KV into blocks B held.
            a_slot = engine.book.requests["a"].seqs[0].slot if "a" in engine.book.requests else None
            if a_slot is not None:
                now = np.asarray(engine.state.mem.tables.tables)[a_slot]
                reused |= bool(b_blocks_out & set(now[now > 0].tolist()))
        elif b_rows_out is not None and not back_elsewhere and "b" in engine.book.requests:
            # Swapped in: other block ids, the same sharing between the two samples.
            rows = np.asarray(engine.state.mem.tables.tables)[b_slots]
            assert (rows > 0).sum() == (b_rows_out > 0).sum()
            assert len(set(rows[rows > 0].tolist())) == len(b_blocks_out)
            back_elsewhere = not np.array_equal(rows, b_rows_out)
            assert back_elsewhere
    stats = engine.stats()
    assert b_rows_out is not None and reused and back_elsewhere
    assert stats["preemptions_swap"] >= 2  # both samples of B, at least once
    assert stats["swapped_out_blocks"] == stats["swapped_in_blocks"] >= out_blocks_at_swap
    assert done["a"] == want_a and done["b"] == want_b and done["c"] == want_c
    _assert_idle(engine)


def test_abort_of_a_swapped_group_returns_its_host_blocks():
    engine = _swap_engine()
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, SAMPLED)
    for _ in range(200):
        engine.step()
        if (np.asarray(engine.state.status) == SWAPPED).any():
            break
    assert engine.num_free_host_blocks() < engine.num_host_blocks  # B is on the host
    engine.abort_request("b")
    assert engine.num_free_host_blocks() == engine.num_host_blocks
    assert not engine.book.swapped_slots
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(engine)


@pytest.mark.slow  # builds a second engine; the fallback is also checked at the scheduler level
def test_llm_swap_space_too_small_falls_back_to_recompute():
    """Through the LLM API: preemption_mode="swap" with a host pool of 2 blocks, which no
    group fits, recomputes instead (and does not raise, unlike vLLM v0.2)."""
    llm = LLM(
        model="tiny-llama",
        max_model_len=MAX_LEN,
        block_size=BLOCK,
        num_gpu_blocks_override=NUM_BLOCKS,
        swap_space=2 * BYTES_PER_BLOCK / (1 << 30),
        preemption_mode="swap",
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=BUDGET,
        watermark=0.0,
        dtype="float32",
    )
    engine = llm.llm_engine
    assert engine.num_host_blocks == 2
    prompts, params = [PROMPT_A, PROMPT_B], [GREEDY, SAMPLED]
    want = [
        [c.token_ids for c in llm.generate([p], [sp], use_tqdm=False)[0].outputs]
        for p, sp in zip(prompts, params, strict=True)
    ]
    engine.reset_stats()
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = engine.stats()
    assert stats["preemptions_recompute"] > 0 and stats["preemptions_swap"] == 0
    assert stats["swapped_out_blocks"] == 0
    assert got == want
    _assert_idle(engine)


def test_recompute_mode_has_no_host_pool():
    engine = _engine(NUM_BLOCKS, 64, "recompute")
    assert engine.num_host_blocks == 0 and engine.state.mem.host_pool is None


# ------------------------------------------------------------------ memory level

NB, NH, NS, M = 24, 6, 4, 5  # a 6-block host pool refuses some moves


@functools.cache
def _fns():
    """Jitted once: Hypothesis examples then reuse the compiled functions."""

    def build(lens, forks):
        pool, bt = create_block_pool(NB), btm.create_block_tables(NS, M)
        for s in range(NS):
            pool, bt, _, _, _ = btm.append_tokens(pool, bt, s, lens[s], 4, M * 4)
        for k in range(forks.shape[0]):  # an empty row takes the parent's blocks
            parent, child = forks[k, 0], forks[k, 1]
            pool, bt, _ = btm.fork(pool, bt, parent, child)
        return pool, bt

    out = jax.jit(lambda p, h, t, m: move_rows(p, h, t, m))
    back = jax.jit(lambda h, p, t, m: move_rows(h, p, t, m, 0))
    return jax.jit(build), out, back


@settings(max_examples=max(25, settings.default.max_examples // 8))  # 25 in CI, 625 long
@given(
    lens=st.lists(st.integers(0, M * 2), min_size=NS, max_size=NS),
    forks=st.lists(
        st.tuples(st.integers(0, NS - 1), st.integers(0, NS - 1)), min_size=3, max_size=3
    ),
    swap=st.lists(st.booleans(), min_size=NS, max_size=NS),
)
def test_move_rows_preserves_sharing_and_refcounts(lens, forks, swap):
    """Rows with shared blocks (forks) go to the host and back: each distinct block is
    copied once, the sharing pattern survives, refcounts equal references in both
    pools, and a host pool too small refuses the whole move."""
    build, out, back = _fns()
    pool, bt = build(jnp.asarray(lens, jnp.int32), jnp.asarray(forks, jnp.int32))
    want = list(lens)  # fork takes only an empty row, and copies the parent's length
    for parent, child in forks:
        if parent != child and want[child] == 0:
            want[child] = want[parent]
    assert np.asarray(bt.lengths).tolist() == want
    mask = jnp.asarray(swap)
    rows0 = np.asarray(bt.tables)
    sel = rows0[np.asarray(swap)]
    distinct = len(set(sel[sel > 0].tolist()))
    host = create_block_pool(NH + 1)
    p1, h1, bt1, src, dst, count, ok = out(pool, host, bt, mask)
    if distinct > NH:
        assert not bool(ok) and int(count) == 0
        np.testing.assert_array_equal(np.asarray(bt1.tables), rows0)
        return
    assert bool(ok) and int(count) == distinct
    # Pairs map each distinct device block to one host block; rows follow the map.
    pairs = zip(
        np.asarray(src)[:distinct].tolist(), np.asarray(dst)[:distinct].tolist(), strict=True
    )
    m = dict(pairs)
    rows1 = np.asarray(bt1.tables)
    for s in range(NS):
        expect = [m.get(b, b) if swap[s] else b for b in rows0[s]]
        assert rows1[s].tolist() == [b if b > 0 else 0 for b in expect]
    for p, rows in ((p1, rows1[~np.asarray(swap)]), (h1, rows1[np.asarray(swap)])):
        refs = np.bincount(rows.reshape(-1), minlength=p.num_blocks)
        np.testing.assert_array_equal(np.asarray(p.refcount)[1:], refs[1:])
    # And back: the same sharing pattern in fresh device blocks.
    h2, p2, bt2, _, _, count2, ok2 = back(h1, p1, bt1, mask)
    assert bool(ok2) and int(count2) == distinct
    rows2 = np.asarray(bt2.tables)
    moved = [a for a in range(NS) if swap[a]]
    for a in range(NS):  # rows not moved are untouched
        if not swap[a]:
            assert rows2[a].tolist() == rows0[a].tolist()
    for a in moved:  # among moved rows the same sharing (a block shared with an unmoved
        for b in moved:  # row was copied: the moved rows have their own copy now)
            same0 = rows0[a][:, None] == rows0[b][None, :]
            np.testing.assert_array_equal(rows2[a][:, None] == rows2[b][None, :], same0)
        assert ((rows2[a] > 0) == (rows0[a] > 0)).all()
    assert int(h2.num_free) == NH and not np.asarray(h2.refcount).any()
    refs = np.bincount(rows2.reshape(-1), minlength=NB)
    np.testing.assert_array_equal(np.asarray(p2.refcount)[1:], refs[1:])


def test_policy_release_of_a_swapped_row_frees_host_blocks():
    policy = PagedPolicy(12, 4, 2, 4, num_host_blocks=6)
    ids, one = jnp.arange(2, dtype=jnp.int32), jnp.ones(2, bool)

    @jax.jit
    def run():
        state = policy.init_state()
        state, ok = policy.grow(state, ids, jnp.array([9, 5]), ids, ids, one, ~one)
        state, ok2 = policy.swap_out(state, jnp.array([True, False]))
        mid = (state.host_pool.num_free, state.pool.num_free)
        state = policy.release(state, ids, one)
        return ok, ok2, mid, state

    ok, ok2, mid, state = run()
    assert bool(ok.all()) and bool(ok2)
    assert (int(mid[0]), int(mid[1])) == (3, 9)  # 3 blocks on host, 2 still on device
    assert int(state.host_pool.num_free) == 6 and int(state.pool.num_free) == 11
    assert not np.asarray(state.on_host).any()


@pytest.mark.tier2  # second tier (docs/testing.md): 12 s cold
def test_simulator_runs_swap_preemption():
    """The simulator drives the same scheduler: with a host pool and mode "swap" a tight
    pool preempts (by swap: single sequences, mode "swap") and every request still
    finishes (the cost model does not charge copy time yet). Swap decisions themselves
    are checked against the reference in tests/test_scheduler_reference.py."""
    from pagedjax.scheduler import SchedulerLimits as SC
    from pagedjax.simulator.cost_model import FittedCostModel
    from pagedjax.simulator.simulate import make_trace, simulate

    rng = np.random.default_rng(0)
    n = 8
    trace = make_trace(np.zeros(16), rng.integers(4, 20, 16), rng.integers(10, 40, 16), 16)
    cost = FittedCostModel((0.01, 0.001, 0.0, 0.0, 0.0))
    policy = PagedPolicy(25, 4, n, 16, num_host_blocks=40)
    cfg = SC(n, 64, max_num_seqs=n, max_model_len=64, preemption_mode="swap")
    r = simulate(policy, cfg, cost, trace)
    assert np.isfinite(np.asarray(r.finish_time)[:16]).all()
    assert not np.asarray(r.rejected)[:16].any()
    assert int(np.sum(r.num_preemptions)) > 0
