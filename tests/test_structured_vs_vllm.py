"""The comparison logic of benchmarks/structured_vs_vllm.py (issue 33): where two engines'
greedy outputs first differ and whether that is a logit tie. No engine, no vLLM, no
model: the script's own run is in docs/structured_outputs.md."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
pytestmark = pytest.mark.tier2


@pytest.fixture(scope="module")
def svv() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # its sibling imports (structured_outputs, vs_vllm_cpu)
    try:
        spec = importlib.util.spec_from_file_location(
            "structured_vs_vllm", BENCH / "structured_vs_vllm.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


_TOKENS = st.lists(st.integers(0, 3), max_size=8)


@given(a=_TOKENS, b=_TOKENS)
def test_first_difference_is_the_common_prefix_length(svv: ModuleType, a, b) -> None:
    # Reference: os.path.commonprefix works on any sequences, lists included.
    want = None if a == b else len(os.path.commonprefix([a, b]))
    assert svv.first_difference(a, b) == want


def _out(tokens: list[int], tops: list[list[tuple[int, float]]]) -> dict:
    return dict(prompt_token_ids=[1, 2], token_ids=tokens, text="", finish_reason="stop",
                top=[[[t, lp, f"t{t}"] for t, lp in pos] for pos in tops])  # fmt: skip


def test_compare_classifies_ties_and_measures_agreement(svv: ModuleType) -> None:
    same = [[(4, -0.1), (9, -2.5)], [(2, -0.2), (3, -1.9)]]
    pj = [
        _out([4, 2], same),  # equal
        _out([4, 5], [same[0], [(5, -0.69310), (7, -0.69320)]]),  # tie: gap 1e-4
        _out([4, 5], [same[0], [(5, -0.3), (7, -1.3)]]),  # not a tie: gap 1.0
        _out([4, 5], [same[0], [(5, -0.69310), (6, -0.69311)]]),  # vLLM's 7 is not 2nd
        _out([4], [same[0]]),  # a prefix of vLLM's output
    ]
    vl = [
        _out([4, 2], [[(4, -0.1 + 3e-5), (9, -2.5)], same[1]]),
        _out([4, 7], [same[0], [(7, -0.69312), (5, -0.69318)]]),
        _out([4, 7], [same[0], [(7, -0.5), (5, -0.9)]]),
        _out([4, 7], [same[0], [(7, -0.5), (5, -0.9)]]),
        _out([4, 8], [same[0], [(8, -0.1), (2, -3.0)]]),
    ]
    got = svv.compare(pj, vl, tie_tol=1e-3)
    assert (got["equal"], got["total"]) == (1, 5)
    assert [d["index"] for d in got["diffs"]] == [1, 2, 3, 4]
    assert [d["position"] for d in got["diffs"]] == [1, 1, 1, 1]
    assert [d["tie"] for d in got["diffs"]] == [True, False, False, False]
    tie = got["diffs"][0]
    assert tie["pj_gap"] == pytest.approx(1e-4) and tie["vllm_gap"] == pytest.approx(6e-5)
    assert (tie["pj_token"], tie["vllm_token"]) == ("t5", "t7")
    assert got["diffs"][3]["note"] == "one output is a prefix of the other"
    # The only chosen-token disagreement on shared prefixes: request 0's first token.
    assert got["noise"] == pytest.approx(3e-5)
    assert not math.isnan(got["noise"])


def test_step_times_use_the_chosen_constraint(svv: ModuleType) -> None:
    """--timing-constraint json reaches the constrained rows (and only them); the
    unconstrained ones get none; the default stays the regex."""
    from types import SimpleNamespace

    seen: list = []

    class LLM:
        def generate(self, prompts, p, use_tqdm=False):
            seen.append(p.structured_outputs)
            out = SimpleNamespace(token_ids=[0] * p.max_tokens)
            return [SimpleNamespace(outputs=[out]) for _ in prompts]

    def sp(**kw):
        return SimpleNamespace(**kw)

    def so(**kw):
        return kw

    spec = dict(timing_rows=2, timing_tokens=3, rounds=1, prompt="p")
    json_spec = dict(spec, timing_constraint=svv.structured_outputs.STEP_CONSTRAINTS["json"])
    res = svv._step_times(LLM(), sp, so, json_spec)
    assert set(res) == {"unconstrained_s", "constrained_s", "pairs"}
    assert {str(s) for s in seen} == {"None", str(svv.structured_outputs.STEP_CONSTRAINTS["json"])}
    seen.clear()
    svv._step_times(LLM(), sp, so, spec)
    assert [s for s in seen if s is not None][0] == {"regex": svv.TIMING_REGEX}
