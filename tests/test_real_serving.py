"""experiments/real_serving.py: the real engine served in wall time, as the simulator's
validation fits it."""

import numpy as np
import pytest

from experiments.config import EngineSettings
from experiments.real_serving import make_llm, serve
from pagedjax.workloads import Workload

# Second tier (docs/testing.md): an engine compile (~6 s).
pytestmark = [pytest.mark.tier2]


def test_the_serving_loop_marks_the_step_after_an_idle_wait():
    """real_serving.serve's sixth step column (the wake cost's feature): 1 on the step
    that admits a request after the loop waited with nothing unfinished, else 0."""
    s = EngineSettings(
        model="tiny-llama", max_model_len=64, num_gpu_blocks=16, max_num_seqs=2,
        max_num_batched_tokens=64,
    )  # fmt: skip
    llm = make_llm(s)
    serve(llm, Workload(np.zeros(1), np.array([8]), np.array([2])))  # compiles
    # Two requests at once, then one 0.5 s later: the first two finish long before it.
    w = Workload(np.array([0.0, 0.0, 0.5]), np.array([8, 8, 8]), np.array([3, 3, 3]))
    r = serve(llm, w)
    steps = r["steps"]
    assert steps.shape[1] == 6 and np.isfinite(r["finish"]).all()
    woke = np.flatnonzero(steps[:, 5])
    assert woke.size == 1  # the first step admits without waiting; one idle gap
    assert steps[woke[0], 0] == 8  # it is the third request's prefill
    assert r["finish"][1] < 0.5 <= r["first"][2]
