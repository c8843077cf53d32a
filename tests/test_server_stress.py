"""The flood and the soak of benchmarks/server_stress.py (issue 32), slow tier (by hand):
each starts the server in a subprocess and checks its own numbers (see that module)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "server_stress.py"
_spec = importlib.util.spec_from_file_location("server_stress", _PATH)
server_stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_stress)


def test_flood_1000_at_once_queue_256():
    out = server_stress.flood(1000, 256)
    print(out)
    assert out["status"].get("503", 0) > 0 and out["served_in_full"], out
    assert out["status"].get("200", 0) + out["status"].get("503", 0) == 1000, out
    assert out["retry_after"] == ["1"] and out["rss_ratio"] <= 1.5, out
    assert out["ok"], out


def test_soak_2000_mixed_requests():
    out = server_stress.soak(2000, 600.0)
    print(out)
    assert out["running"] == 0 and out["waiting"] == 0 and out["kv_usage"] == 0, out
    assert out["rss_growth"] < 0.05, out
    assert out["ok"], out
