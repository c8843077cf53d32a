"""Rejection sampling (sampling/rejection.py) leaves the target distribution unchanged.

On a 5-token vocabulary, 40 000 rows each verify 2 drafts sampled from a deliberately
bad draft distribution and from a perfect one (q = p). The first emitted token, and the
second where the first draft was accepted, must follow the target's p (a chi-square
test at alpha = 0.001, critical value 18.467 for 4 degrees of freedom); the acceptance
rate of the first draft must be sum_x min(p(x), q(x)); seeded keys reproduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.sampling.rejection import position_keys, rejection_sample

V, K, N = 5, 2, 40_000
CHI2_CRIT_DF4_ALPHA_001 = 18.467  # chi-square table: df = 4, alpha = 0.001
P0 = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
P1 = np.array([0.1, 0.2, 0.4, 0.2, 0.1])
P2 = np.array([0.2, 0.2, 0.2, 0.2, 0.2])
BAD = np.array([[0.02, 0.03, 0.05, 0.1, 0.8], [0.6, 0.1, 0.05, 0.05, 0.2]])


def _chi2(samples: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=V)
    expected = p * len(samples)
    return float(np.sum((counts - expected) ** 2 / expected))


def _run(q: np.ndarray, seed: int = 0):
    rng = np.random.default_rng(seed)
    drafts = np.stack([rng.choice(V, size=N, p=q[j]) for j in range(K)], axis=1)
    target = jnp.broadcast_to(jnp.asarray(np.stack([P0, P1, P2]), jnp.float32), (N, K + 1, V))
    draft_probs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (N, K, V))
    keys = position_keys(
        jnp.full((N,), seed, jnp.uint32), jnp.zeros((N,), jnp.int32),
        jnp.arange(N, dtype=jnp.int32) * 8, K + 1,
    )  # fmt: skip
    out = rejection_sample(
        target, draft_probs, jnp.asarray(drafts, jnp.int32), jnp.full((N,), K, jnp.int32), keys
    )
    return jax.device_get(out), drafts


@pytest.mark.parametrize("name", ["bad", "perfect"])
def test_emitted_tokens_follow_the_target(name):
    q = BAD if name == "bad" else np.stack([P0, P1])
    out, drafts = _run(q)
    first = out.token_ids[:, 0]
    assert _chi2(first, P0) < CHI2_CRIT_DF4_ALPHA_001
    second = out.token_ids[out.accepted >= 1, 1]
    assert _chi2(second, P1) < CHI2_CRIT_DF4_ALPHA_001
    # The first draft is accepted with probability sum_x min(p, q).
    rate = float(np.mean(out.accepted >= 1))
    assert rate == pytest.approx(np.minimum(P0, q[0]).sum(), abs=0.01)
    if name == "perfect":
        assert rate > 0.99  # q = p: every draft is accepted (up to float rounding)
    # Accepted positions keep the drafts.
    for j in range(K):
        kept = out.accepted > j
        np.testing.assert_array_equal(out.token_ids[kept, j], drafts[kept, j])


def test_wrong_rule_is_caught():
    """The test has power: emitting the draft itself (no rejection) fails it."""
    _, drafts = _run(BAD)
    assert _chi2(drafts[:, 0], P0) > CHI2_CRIT_DF4_ALPHA_001


def test_seeded_reproducible_and_fewer_drafts():
    a, _ = _run(BAD, seed=3)
    b, _ = _run(BAD, seed=3)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    # Rows with no drafts emit one token from p at position 0.
    keys = position_keys(jnp.arange(N, dtype=jnp.uint32), jnp.zeros((N,), jnp.int32),
                         jnp.zeros((N,), jnp.int32), K + 1)  # fmt: skip
    target = jnp.broadcast_to(jnp.asarray(np.stack([P0, P1, P2]), jnp.float32), (N, K + 1, V))
    out = rejection_sample(
        target, jnp.full((N, K, V), 1.0 / V), jnp.zeros((N, K), jnp.int32),
        jnp.zeros((N,), jnp.int32), keys,
    )  # fmt: skip
    assert np.all(np.asarray(out.accepted) == 0)
    assert _chi2(np.asarray(out.token_ids[:, 0]), P0) < CHI2_CRIT_DF4_ALPHA_001
