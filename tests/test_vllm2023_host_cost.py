"""experiments/vllm2023_host_cost.py's stand-in for torch 2.0.1's multinomial (the harness
itself needs vLLM 0.1.2's sdist and runs by hand; docs/experiments.md)."""

import pytest

torch = pytest.importorskip("torch")

from experiments.vllm2023_host_cost import multinomial_2023  # noqa: E402


def test_multinomial_2023_draws_what_torch_draws_and_reads_the_input_twice():
    probs = torch.softmax(torch.randn(3, 50), dim=-1)
    draw = multinomial_2023(torch)
    for seed in range(5):
        ours = draw(probs, 1, True, generator=torch.Generator().manual_seed(seed))
        own = torch.multinomial(probs, 1, True, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(ours, own)  # the same argmax(p / Exp(1)) on the same stream
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        draw(probs, 1, True)
    reads = [e for e in prof.events() if e.name == "aten::_local_scalar_dense"]
    assert len(reads) == 2  # torch 2.0.1's two checks: each a sync on a GPU


def test_multinomial_2023_refuses_what_torch_refused():
    draw = multinomial_2023(torch)
    with pytest.raises(RuntimeError, match="element < 0"):
        draw(torch.tensor([[0.5, -0.1, 0.6]]), 1, True)
    with pytest.raises(RuntimeError, match="sum of probabilities"):
        draw(torch.zeros(2, 4), 1, True)
    assert draw(torch.tensor([[0.0, 1.0]]), 2, True).shape == (1, 2)  # torch's own path
