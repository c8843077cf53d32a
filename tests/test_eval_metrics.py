"""The quality metrics on synthetic distributions (no model): binned KL is a lower bound
of the exact KL, tight when the bins hold everything; top-1 agreement counts."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.eval.metrics import binned_kl, quality_report, top1_agreement
from pagedjax.eval.scoring import TokenScores, windows


def scores_from_logits(logits: np.ndarray, targets: np.ndarray, k: int) -> TokenScores:
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    top = np.argsort(-logp, axis=-1)[:, :k]
    return TokenScores(
        targets, logp[np.arange(len(targets)), targets], top, np.take_along_axis(logp, top, -1)
    )


def exact_kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    la = a - np.log(np.exp(a).sum(-1, keepdims=True))
    lb = b - np.log(np.exp(b).sum(-1, keepdims=True))
    return (np.exp(la) * (la - lb)).sum(-1)


@pytest.mark.parametrize("k", [1, 5, 50])
def test_binned_kl_is_a_lower_bound_and_exact_at_full_k(k):
    rng = np.random.default_rng(0)
    m, v = 40, 50
    a = rng.normal(size=(m, v)) * 2
    b = a + rng.normal(size=(m, v)) * 0.3
    t = rng.integers(0, v, m)
    kl, mass = binned_kl(scores_from_logits(a, t, k), scores_from_logits(b, t, k))
    exact = exact_kl(a, b)
    assert np.all(kl <= exact + 1e-12) and np.all(kl >= -1e-12)
    assert np.all((mass > 0) & (mass <= 1 + 1e-12))
    if k == v:
        np.testing.assert_allclose(kl, exact, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(mass, 1.0)


def test_report_of_identical_and_of_different_models():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(30, 20))
    t = rng.integers(0, 20, 30)
    same = quality_report(scores_from_logits(a, t, 5), scores_from_logits(a, t, 5))
    assert same["top1_agreement"] == 1.0 and same["kl"] == pytest.approx(0, abs=1e-12)
    assert same["ppl_rel_diff"] == 0.0
    flipped = scores_from_logits(-a, t, 5)
    assert top1_agreement(scores_from_logits(a, t, 5), flipped) == 0.0
    assert quality_report(scores_from_logits(a, t, 5), flipped)["kl"] > 0.01
    with pytest.raises(ValueError, match="different tokens"):
        quality_report(scores_from_logits(a, t, 5), scores_from_logits(a, (t + 1) % 20, 5))


def test_windows():
    assert windows(range(7), 3) == [[0, 1, 2], [3, 4, 5]]  # a 1-token tail scores nothing
    assert windows(range(8), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError):
        windows(range(8), 1)
