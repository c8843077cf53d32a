"""Beam search (``LLM.beam_search``) against transformers' ``generate(num_beams=k)``.

One tiny random Llama checkpoint (save_pretrained) serves both sides. The returned
hypotheses (tokens, scores, order) must equal transformers' ``sequences`` and
``sequences_scores`` for beam widths 1 / 2 / 4, several length penalties and every
early_stopping value, with EOS reachable (an eos id the random model likes) and with
ignore_eos. During every run the block pool's refcounts equal the block tables'
references, beams of a group share blocks (refcount > 1, copy-on-write seen, the
engine's blocks_saved_by_sharing > 0) and carry one scheduler group id; afterwards
every block is back in the pool. Bad input raises a clear error and leaves the engine
idle; a beam preempted by another request's growth aborts its group with
BeamSearchOutOfStep.

Block size 4 (not 16) so that 10-20-token sequences cross blocks and copy on write.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedjax import LLM, BeamSearchParams, SamplingParams
from pagedjax.engine.beams import BeamSearchOutOfStep
from pagedjax.scheduler import FREE
from tests.model_helpers import save_tiny_hf_model

torch = pytest.importorskip("torch")

VOCAB = 384  # tests/model_helpers.py's tiny Llama
MAX_LEN, BLOCK, SEQS, BLOCKS = 64, 4, 8, 64
SCORE_TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("beam_llama")
    model = save_tiny_hf_model("llama", d, seed=1)
    llm = LLM(
        model=str(d),
        dtype="float32",
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_num_seqs=SEQS,
        max_num_batched_tokens=16,  # one token bucket: fewer compilations
        num_gpu_blocks_override=BLOCKS,
        watermark=0.0,
        seed=0,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 11)]
    return model, llm, prompts


class _Temperature:
    """transformers applies processors to log-probs; log_softmax(logprobs / T) equals
    log_softmax(logits / T), the ranking vLLM's beam search uses."""

    def __init__(self, t: float):
        self.t = t

    def __call__(self, ids, scores):
        return torch.log_softmax(scores / self.t, dim=-1)


def _hf(model, prompt, k, n_new, *, lp=1.0, es=False, eos=None, r=None, temperature=0.0):
    """transformers' beam search: [(generated ids, sequences_score)] best first."""
    from transformers import LogitsProcessorList

    procs = LogitsProcessorList([_Temperature(temperature)] if temperature > 0 else [])
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=k,
            num_return_sequences=r or k,
            max_new_tokens=n_new,
            min_new_tokens=0,
            length_penalty=lp,
            early_stopping=es,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            logits_processor=procs,
            output_scores=True,
            return_dict_in_generate=True,
        )
    p = len(prompt)
    if k == 1:  # transformers runs greedy search for num_beams=1: no sequences_scores
        ids = out.sequences[0, p:].tolist()
        if eos is not None and eos in ids:
            ids = ids[: ids.index(eos) + 1]
        lps = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, ids, strict=False)]
        return [(ids, sum(lps) / len(ids) ** lp)]
    lens = (out.beam_indices >= 0).sum(1).tolist()
    return [
        (out.sequences[i, p : p + lens[i]].tolist(), float(out.sequences_scores[i]))
        for i in range(out.sequences.shape[0])
    ]


def _check_pool(engine) -> None:
    mem = engine.state.mem
    rc = np.asarray(mem.pool.refcount)
    refs = np.bincount(np.asarray(mem.tables.tables).reshape(-1), minlength=rc.shape[0])
    np.testing.assert_array_equal(rc[1:], refs[1:])


def _assert_idle(engine) -> None:
    assert engine.num_free_blocks() == engine.num_usable_blocks()
    assert not np.asarray(engine.state.mem.pool.refcount).any()
    assert np.all(np.asarray(engine.state.status) == FREE)
    assert len(engine.book.free_slots) == engine.max_seqs and not engine.book.requests


@pytest.fixture
def watched(setup, monkeypatch):
    """The LLM with its engine's step wrapped: refcounts == table references before and
    after each step; records the largest refcount, copy-on-write copies and whether all
    live slots of a request carry one group id."""
    _, llm, _ = setup
    engine = llm.llm_engine
    seen = dict(max_rc=0, cow=0, groups_ok=True, multi=0, loop_blocked=True)
    step = engine.step

    def wrapped():
        _check_pool(engine)
        seen["max_rc"] = max(seen["max_rc"], int(np.asarray(engine.state.mem.pool.refcount).max()))
        group = np.asarray(engine.state.group)
        for req in engine.book.requests.values():
            slots = [s.slot for s in req.seqs if s.slot is not None]
            if len(slots) > 1:
                seen["multi"] += 1
                seen["groups_ok"] &= len({int(group[s]) for s in slots}) == 1
        # The K-step decode loop must stay out while beams hold slots (the host picks
        # every step's tokens); asked as if the engine had num_scheduler_steps=4.
        if any(r.host_driven and r.seqs[0].slot is not None for r in engine.book.requests.values()):
            ms = engine.multi_step
            saved = ms.enabled, ms.steps_per_call
            ms.enabled, ms.steps_per_call = True, 4
            try:
                seen["loop_blocked"] &= ms.ineligible(engine.core) is not None
            finally:
                ms.enabled, ms.steps_per_call = saved
        out = step()
        _check_pool(engine)
        seen["cow"] += int(np.asarray(engine.state.mem.last_cow.valid).sum())
        return out

    monkeypatch.setattr(engine, "step", wrapped)
    engine.reset_stats()
    yield llm, seen
    _assert_idle(engine)
    assert seen["loop_blocked"]


def _compare(model, prompts, outs, k, n_new, **kw) -> list:
    r = kw.pop("r", None)
    got_all = []
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _hf(model, prompt, k, n_new, r=r, **kw)
        got = out.sequences[: len(ref)]
        assert len(out.sequences) == k
        for rank, (seq, (ids, score)) in enumerate(zip(got, ref, strict=True)):
            assert seq.tokens[: len(prompt)] == prompt
            assert seq.tokens[len(prompt) :] == ids, f"hypothesis {rank}"
            assert math.isclose(seq.score, score, rel_tol=SCORE_TOL, abs_tol=SCORE_TOL)
            n = len(ids)
            lp = kw.get("lp", 1.0)
            assert math.isclose(seq.score, seq.cum_logprob / n**lp, rel_tol=1e-6, abs_tol=1e-6)
            assert len(seq.logprobs) == n
            assert all(seq.tokens[len(prompt) + i] in e for i, e in enumerate(seq.logprobs))
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        got_all += out.sequences
    return got_all


@pytest.mark.parametrize(
    ("k", "lp", "r"),
    # (4, 0.0, 4): 19 s cold, its own beam width; second tier (docs/testing.md)
    [(2, 1.0, 2), (4, 1.0, 3), pytest.param(4, 0.0, 4, marks=pytest.mark.tier2)],
)
def test_ignore_eos_matches_transformers(watched, setup, k, lp, r):
    model, _, prompts = setup
    llm, seen = watched
    n_new = 14
    params = BeamSearchParams(beam_width=k, max_tokens=n_new, ignore_eos=True, length_penalty=lp)
    outs = llm.beam_search(prompts, params)
    seqs = _compare(model, prompts, outs, k, n_new, lp=lp, r=r)
    owners = [p for p in prompts for _ in range(k)]
    assert all(len(s.tokens) == len(p) + n_new for s, p in zip(seqs, owners, strict=True))
    assert all(s.finish_reason == "length" for s in seqs)
    # The beams shared blocks: refcounts above 1, copy-on-write, saving measured.
    assert seen["max_rc"] > 1 and seen["cow"] > 0
    assert seen["multi"] > 0 and seen["groups_ok"]
    assert llm.llm_engine.stats()["blocks_saved_by_sharing"] > 0


@pytest.fixture(scope="module")
def liked_eos(setup):
    """A token the random model likes: the first token of transformers' best beam for
    prompt 0 with EOS off. As EOS it ends short hypotheses that compete with long ones."""
    model, _, prompts = setup
    return _hf(model, prompts[0], 2, 4)[0][0][0]


ES_CASES = [
    (2, 1.0, False),
    (2, 1.0, True),
    (4, 1.0, "never"),
    (4, 0.5, "never"),
    (2, 2.0, True),
    (4, -0.5, False),
    (4, 0.0, True),
]


@pytest.mark.parametrize(("k", "lp", "es"), ES_CASES)
def test_reachable_eos_matches_transformers(watched, setup, liked_eos, monkeypatch, k, lp, es):
    model, _, prompts = setup
    llm, _ = watched
    # The engine's EOS ids, as a checkpoint whose config says eos_token_id=liked_eos.
    monkeypatch.setattr(llm.llm_engine.book, "eos", {liked_eos})
    n_new = 14
    params = BeamSearchParams(beam_width=k, max_tokens=n_new, length_penalty=lp, early_stopping=es)
    outs = llm.beam_search(prompts, params)
    seqs = _compare(model, prompts, outs, k, n_new, lp=lp, es=es, eos=liked_eos)
    stopped = [s for s in seqs if s.finish_reason == "stop"]
    assert stopped and all(s.tokens[-1] == liked_eos for s in stopped)
    owners = [p for p in prompts for _ in range(k)]
    assert all(liked_eos not in s.tokens[len(p) : -1] for s, p in zip(seqs, owners, strict=True))


def test_beam_width_1_is_transformers_greedy(watched, setup, liked_eos, monkeypatch):
    model, _, prompts = setup
    llm, _ = watched
    monkeypatch.setattr(llm.llm_engine.book, "eos", {liked_eos})
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=14))
    _compare(model, prompts, outs, 1, 14, eos=liked_eos)


def test_temperature_ranks_by_scaled_logprobs(watched, setup):
    model, _, prompts = setup
    llm, _ = watched
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True, temperature=1.7)
    outs = llm.beam_search(prompts, params)
    _compare(model, prompts, outs, 2, 10, temperature=1.7)


def test_bad_input_raises_clearly(setup):
    _, llm, prompts = setup
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    cases = [
        (prompts, SamplingParams(), TypeError, "BeamSearchParams"),
        (prompts, BeamSearchParams(beam_width=11, max_tokens=4), ValueError, "max_logprobs"),
        (
            prompts,
            BeamSearchParams(beam_width=SEQS + 1, max_tokens=4, ignore_eos=True),
            ValueError,
            "max_logprobs|max_num_seqs",
        ),  # fmt: skip
        (
            [prompts[0], [VOCAB]],
            BeamSearchParams(beam_width=2, max_tokens=4),
            ValueError,
            "vocabulary",
        ),  # fmt: skip
        (
            [list(range(3, 3 + MAX_LEN))],
            BeamSearchParams(beam_width=2, max_tokens=4),
            ValueError,
            "no room",
        ),  # fmt: skip
        ([[]], BeamSearchParams(beam_width=2, max_tokens=4), ValueError, "empty"),
        (
            [prompts[0]],
            BeamSearchParams(beam_width=8, max_tokens=60, ignore_eos=True),
            ValueError,
            "KV blocks",
        ),  # fmt: skip
    ]
    for ps, params, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            llm.beam_search(ps, params)
        _assert_idle(engine)
    with pytest.raises(TypeError, match="beam_search"):
        llm.generate(prompts, BeamSearchParams(beam_width=2, max_tokens=4), use_tqdm=False)
    _assert_idle(engine)


def test_beam_preempted_by_recompute_aborts_group(setup, request):
    """Under preemption_mode="recompute" a preempted group's beams come back one at a
    time: the group falls out of step and is aborted with a clear error, and the other
    requests still finish. (The engine's schedule is re-jitted with that mode: the model
    programs stay compiled.)"""
    import dataclasses

    _, llm, _ = setup
    engine = llm.llm_engine
    cfg = dataclasses.replace(engine.sched_limits, preemption_mode="recompute")
    engine.core.device.use_schedule_limits(cfg)
    request.addfinalizer(lambda: engine.core.device.use_schedule_limits(None))  # module-wide
    rng = np.random.default_rng(5)
    for i in range(3):  # 3 x 64 tokens = 48 of the 63 blocks
        hog = rng.integers(3, VOCAB, size=20).tolist()
        engine.add_request(f"hog{i}", hog, SamplingParams(temperature=0.0, max_tokens=44,
                                                          ignore_eos=True))  # fmt: skip
    for _ in range(4):
        engine.step()
    prompt = rng.integers(3, VOCAB, size=12).tolist()
    params = BeamSearchParams(beam_width=4, max_tokens=52, ignore_eos=True)
    preempted = engine.num_preemptions
    with pytest.raises(BeamSearchOutOfStep, match="out of step"):
        llm.beam_search([prompt], params)
    assert engine.num_preemptions > preempted
    assert all(r.startswith("hog") for r in engine.book.requests)  # the group is gone
    while engine.has_unfinished_requests():
        engine.step()
        _check_pool(engine)
    _assert_idle(engine)


def test_beam_group_is_swapped_whole_and_resumes_in_lockstep(setup):
    """Requests admitted before the beams grow with them until the pool runs out; the
    scheduler preempts the latest arrival, the beam group, whole: a group of several
    sequences is swapped to the host pool (the default preemption mode), comes back when
    the others finish, and its beams resume in lockstep: the results equal an unpressured
    run. The other requests finish too; both pools end empty."""
    _, llm, _ = setup
    engine = llm.llm_engine
    rng = np.random.default_rng(5)
    hogs = [rng.integers(3, VOCAB, size=20).tolist() for _ in range(3)]
    prompt = rng.integers(3, VOCAB, size=12).tolist()
    # 4 beams of 64 tokens hold >= 16 blocks even fully shared: 48 + 16 > 63.
    params = BeamSearchParams(beam_width=4, max_tokens=52, ignore_eos=True)
    (ref,) = llm.beam_search([prompt], params)
    _assert_idle(engine)
    engine.reset_stats()
    for i, hog in enumerate(hogs):  # 3 x 64 tokens = 48 of the 63 blocks
        engine.add_request(f"hog{i}", hog, SamplingParams(temperature=0.0, max_tokens=44,
                                                          ignore_eos=True))  # fmt: skip
    for _ in range(4):  # the hogs' prompts (chunked over the 16-token budget) run first
        engine.step()
    (out,) = llm.beam_search([prompt], params)
    st = engine.stats()
    assert st["preemptions_swap"] > 0 and st["swapped_in_blocks"] > 0, st
    assert st["preemptions_recompute"] == 0, st
    assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
    for a, b in zip(out.sequences, ref.sequences, strict=True):
        assert math.isclose(a.score, b.score, rel_tol=1e-5, abs_tol=1e-5)
    while engine.has_unfinished_requests():
        engine.step()
        _check_pool(engine)
    _assert_idle(engine)
