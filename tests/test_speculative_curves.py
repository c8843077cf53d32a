"""experiments/speculative_curves.py: Fig. 12 curves with simulated speculation.

Properties that follow from the simulator's model (pagedjax/simulator/speculative.py),
not numbers: with k > 0 drafts and nothing accepted a step costs more and emits the
same tokens, so speculation is never faster than none; with every draft accepted at
low load (small batches, a memory-bound step) a step costs little more and emits k + 1
tokens, so it is faster. Every curve shares one compiled loop (~15 s on the loaded
2-core box); the runs are 5-s traces at two rates.
"""

import csv

import pytest

from experiments import speculative_curves as sc
from experiments.config import ServerSettings

SERVER = ServerSettings(model="opt-13b", gpu="A100-40GB", slots=32, horizon_factor=20.0)
RATES = [0.5, 4.0]
NONE = sc.Setting("none", "none", 0, 1.0, None, "none", "-")
NOTHING = sc.Setting("nothing", "k=4, nothing accepted", 4, 1.0, 0.0, "ngram", "test")
ALL = sc.Setting("all", "k=4, all accepted", 4, 5.0, 1.0, "ngram", "test")


@pytest.mark.tier2  # second tier (docs/testing.md): 13 s cold
def test_nothing_accepted_is_never_faster_and_all_accepted_is_faster_at_low_load():
    rows = sc.curves(SERVER, "sharegpt", RATES, 5.0, 0, [NONE, NOTHING, ALL], [0.5])
    lat = {(r["setting"], r["rate"]): r["norm_latency_s_per_token"] for r in rows}
    assert set(lat) == {(s, r) for s in ("none", "nothing", "all") for r in RATES}
    assert all(r["unfinished"] == 0 for r in rows)  # low rates: every request drained
    for rate in RATES:
        assert lat["nothing", rate] >= lat["none", rate]
    assert lat["all", 0.5] < lat["none", 0.5]
    # The model's means are the inputs.
    by = {r["setting"]: r for r in rows}
    assert by["nothing"]["model_mean_accepted_len"] == pytest.approx(1.0)
    assert by["all"]["model_mean_accepted_len"] == pytest.approx(5.0)


def test_script_writes_table_csv_and_figure(tmp_path, capsys):
    out = tmp_path / "o"
    args = ["--config", "tiny", "--rates", *map(str, RATES), "--duration", "5", "--out", str(out)]
    assert sc.main(args) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "knee@0.5" in text
    rows = list(csv.DictReader((out / "speculative_curves.csv").open()))
    assert {r["setting"] for r in rows} == {s.name for s in sc.SETTINGS}
    assert all(r["executor"] == "simulated" for r in rows)
    assert (out / "speculative_curves.png").stat().st_size > 0
    assert sc.main(["--config", "tiny", "--rates", "-1", "--out", str(out)]) == 2
    assert sc.main(["--config", "tiny", "--gpu", "Z80", "--out", str(out)]) == 2


def test_eagle_cost_fraction_is_the_heads_weight_share():
    f = sc.eagle_cost_fraction("llama-2-7b")
    assert 1 / 32 < f < 0.1  # more than one of 32 layers (it adds fc and the LM head)


def test_step_gain_follows_the_cost_model():
    """Per step (no queueing): nothing accepted never gains; everything accepted at one
    row gains nearly k + 1 (verification is almost free when the step is memory-bound);
    the gain never grows with the batch (verification tokens take compute)."""
    server = ServerSettings(model="llama-2-7b", gpu="A100-40GB", slots=64)
    b = [1, 8, 64, 256]
    assert all(g <= 1.0 for g in sc.step_gain(server, NOTHING, b, 64))
    full = sc.step_gain(server, ALL, b, 64)
    assert 4.5 < full[0] <= 5.0
    assert all(x >= y - 1e-6 for x, y in zip(full[:-1], full[1:], strict=True))
    assert full[-1] < full[0]
