"""The pure helpers of benchmarks/serve_vs_vllm.py (issue 30): reading vLLM's benchmark
result JSON, the per-round cells, medians and ratios, the table, the round order. No
server, no vLLM, no model: the script's own runs are in docs/serving.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def svv() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # its sibling import (vs_vllm_cpu)
    try:
        spec = importlib.util.spec_from_file_location("serve_vs_vllm", BENCH / "serve_vs_vllm.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def _result(tok_s: float, ttft: float, tpot: float, completed: int = 64) -> dict:
    """The keys vllm.benchmarks.serve saves (a subset, as written by vLLM 0.32)."""
    return {
        "duration": 40.0, "completed": completed, "failed": 64 - completed,
        "total_input_tokens": 8192, "total_output_tokens": completed * 64,
        "request_throughput": 1.6, "output_throughput": tok_s, "total_token_throughput": 300.0,
        "mean_ttft_ms": ttft, "median_ttft_ms": ttft - 1, "mean_tpot_ms": tpot,
        "errors": [""] * completed + ["boom"] * (64 - completed),
    }  # fmt: skip


def test_parse_bench_result(svv: ModuleType) -> None:
    got = svv.parse_bench_result(_result(93.9, 2000.0, 505.0, completed=63))
    assert got["output_tok_s"] == 93.9
    assert (got["mean_ttft_ms"], got["median_ttft_ms"], got["mean_tpot_ms"]) == (2000, 1999, 505)
    assert (got["completed"], got["failed"], got["output_tokens"]) == (63, 1, 63 * 64)
    assert got["first_error"] == "boom"
    assert svv.parse_bench_result(_result(1.0, 1.0, 1.0))["first_error"] is None
    with pytest.raises(KeyError):
        svv.parse_bench_result({"completed": 0})


def test_ratio_and_median(svv: ModuleType) -> None:
    assert svv.ratio(93.9, 106.2) == pytest.approx(0.884, abs=1e-3)
    assert svv.ratio(None, 1.0) is None and svv.ratio(1.0, None) is None
    assert svv.ratio(1.0, 0.0) is None
    assert svv.median([3.0, None, 1.0, 2.0]) == 2.0
    assert svv.median([1.0, 2.0]) == 1.5
    assert svv.median([None, None]) is None


def test_round_row_and_table(svv: ModuleType) -> None:
    pj = svv.parse_bench_result(_result(90.0, 2000.0, 500.0)) | {"startup_s": 30.0}
    vl = svv.parse_bench_result(_result(100.0, 1500.0, 400.0)) | {"startup_s": 95.0}
    off = {"output_tok_s": 120.0}
    r1 = svv.round_row({"pagedjax": pj, "vllm": vl, "offline": off})
    assert r1["ratio_pj_vllm"] == pytest.approx(0.9)
    assert r1["ratio_pj_offline"] == pytest.approx(0.75)
    assert (r1["pj_tpot_ms"], r1["vllm_tpot_ms"], r1["vllm_startup_s"]) == (500, 400, 95)
    pj2 = svv.parse_bench_result(_result(80.0, 2100.0, 520.0)) | {"startup_s": 10.0}
    vl2 = svv.parse_bench_result(_result(100.0, 1400.0, 410.0)) | {"startup_s": 20.0}
    r2 = svv.round_row({"pagedjax": pj2, "vllm": vl2, "offline": {"output_tok_s": 100.0}})
    lines = svv.format_table([r1, r2]).splitlines()
    assert lines[0] == "|  | round 1 | round 2 | median |"
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in lines[2:]}
    assert rows["pagedjax server: output tok/s"] == ["90.0", "80.0", "85.0 |"]
    # The ratio's median is the median of the per-round ratios (0.9, 0.8), not 85 / 100.
    assert rows["ratio pagedjax / vLLM (output tok/s)"] == ["0.90", "0.80", "0.85 |"]
    assert rows["ratio pagedjax server / LLM.generate"] == ["0.75", "0.80", "0.78 |"]
    assert rows["vLLM-CPU server: mean TPOT (ms)"] == ["400", "410", "405 |"]
    assert rows["vLLM-CPU server: requests completed"] == ["64", "64", "64 |"]


def test_table_without_vllm_or_offline(svv: ModuleType) -> None:
    pj = svv.parse_bench_result(_result(90.0, 2000.0, 500.0)) | {"startup_s": 30.0}
    table = svv.format_table([svv.round_row({"pagedjax": pj, "vllm": None})])
    assert "pagedjax server: output tok/s | 90.0 | 90.0 |" in table
    assert "vLLM" not in table and "LLM.generate" not in table  # rows with no value go


def test_round_order(svv: ModuleType) -> None:
    names = ["pagedjax", "vllm", "offline"]
    assert svv.round_order(0, names) == names
    assert svv.round_order(1, names) == ["offline", "vllm", "pagedjax"]
    assert svv.round_order(2, names) == names
