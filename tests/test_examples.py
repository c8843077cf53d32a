"""The README's ablation examples run (tiny sizes), and the package-level simulator API.

examples/ is not a package: each script is loaded from its path, as a reader runs it.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

import pagedjax as pj
from pagedjax.simulator import systems

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _consistent(m: dict) -> None:
    assert m["finished"] + m["unfinished"] + m["rejected"] == m["requests"] > 0
    assert m["finished"] > 0 and math.isfinite(m["norm_latency_s_per_token"])


@pytest.mark.tier2  # second tier (docs/testing.md): among the slowest of the default tier
def test_orca_vs_paged_example(capsys):
    out = _load("orca_vs_paged").main(tiny=True, block_size=32)
    assert set(out) == {"orca_max", "orca_oracle", "paged"}
    for m in out.values():
        _consistent(m)
    assert len({m["requests"] for m in out.values()}) == 1  # the same trace for all
    assert "simulated" in capsys.readouterr().out


@pytest.mark.tier2  # second tier (docs/testing.md): among the slowest of the default tier
def test_custom_priority_example():
    out = _load("custom_priority").main(tiny=True)
    assert set(out) == {"fcfs", "shortest_prompt"}
    for m in out.values():
        _consistent(m)


@pytest.mark.tier2  # second tier (docs/testing.md): among the slowest of the default tier
def test_custom_memory_policy_example():
    src = (EXAMPLES / "custom_memory_policy.py").read_text()
    assert len(src.splitlines()) < 60  # the bound for this example
    out = _load("custom_memory_policy").main(tiny=True)
    assert set(out) == {"paged", "lookahead"}
    for m in out.values():
        _consistent(m)


def test_load_trace_reads_the_azure_datasets_columns(tmp_path):
    csv = tmp_path / "conv.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:48.1805900,396,109\n"
        "2023-11-16 18:15:46.1805900,10,5\n"
    )
    w = pj.load_trace(csv)
    np.testing.assert_allclose(w.arrival_time, [0.0, 0.5, 2.0], atol=1e-6)
    assert w.prompt_len.tolist() == [10, 374, 396] and w.output_len.tolist() == [5, 44, 109]
    assert w.name == "conv" and w.source_len == 505
    w2 = pj.load_trace(csv, start_s=0.25, rate_scale=2.0)
    np.testing.assert_allclose(w2.arrival_time, [0.125, 0.875], atol=1e-6)
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="lacks"):
        pj.load_trace(tmp_path / "bad.csv")


def test_build_system_names_and_refusals():
    assert pj.SYSTEMS == ("paged", "orca_max", "orca_pow2", "orca_oracle", "ft_static")
    policy, cfg = pj.build_system("paged", block_size=32, kv_slots=4096)
    assert policy.block_size == 32 and policy.capacity_tokens == 4096 and cfg.mode == "paper"
    _, static = pj.build_system("ft_static")
    assert static.mode == "static" and static.static_batch_size == 7  # 15728 // 2048
    with pytest.raises(ValueError, match="unknown system"):
        pj.build_system("vllm")
    with pytest.raises(ValueError, match="swap"):
        pj.build_system("orca_max", swap_space_gib=4)
    with pytest.raises(ValueError, match="named system"):
        pj.simulate_system((policy, cfg), pj.make_workload("alpaca", 1.0, num_requests=2),
                           block_size=8)  # fmt: skip
    assert systems.make_cost_model("H200", "opt-13b") != systems.make_cost_model()
