"""The jitted sampler: seeded invariance, filters and penalties against a NumPy spec,
empirical frequencies, greedy, logprobs.

Shapes are fixed (S rows, V vocabulary, history lengths) so examples reuse one compile.
"""

from collections import Counter

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedjax.sampling import (
    SamplingParams,
    SamplingTensors,
    TokenHistory,
    processed_probs,
    prompt_logprobs,
    sample,
    token_counts,
)
from pagedjax.sampling.sampler import first_argmax

S, V, LP, LO = 8, 16, 6, 6
NO_HISTORY = TokenHistory.from_lists([], [], S, LP, LO)


def logits_from(seed: int, s: int = S, scale: float = 2.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal((s, V))).astype(np.float32)


def tensors(rows: list, s: int = S) -> SamplingTensors:
    return SamplingTensors.from_params(rows, pad_to=s)


# ----------------------------------------------------------------------------- spec


def reference_probs(
    x: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]
) -> tuple[np.ndarray, float]:
    """vLLM's processing of one row in float64, written as plainly as possible.

    Returns the probabilities and the smallest distance of a top-p / min-p decision
    from its boundary (callers skip cases that float32 rounding could flip).
    """
    x = x.astype(np.float64).copy()
    counts = Counter(output)
    for tok in set(prompt) | set(output):
        rp = p.repetition_penalty
        x[tok] = x[tok] / rp if x[tok] > 0 else x[tok] * rp
    for tok, c in counts.items():
        x[tok] -= p.frequency_penalty * c + p.presence_penalty
    if p.greedy:
        return np.eye(V)[int(np.argmax(x))], np.inf
    x = x / p.temperature
    keep = np.ones(V, bool)
    margin = np.inf
    if 0 < p.top_k < V:
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    if p.top_p < 1.0:
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        before = 0.0
        for tok in np.argsort(-x, kind="stable"):
            margin = min(margin, abs(before - p.top_p))
            if before >= p.top_p:
                keep[tok] = False
            before += probs[tok]
    if p.min_p > 0.0:
        full = np.exp(x - x.max())
        margin = min(margin, float(np.min(np.abs(full - p.min_p))))
        keep &= full >= p.min_p
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    return probs / probs.sum(), margin


sampled_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 3, 8, V, V + 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.4, -0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.7]),
    seed=st.integers(0, 2**32 - 1),
)
token_lists = st.lists(st.integers(0, V - 1), max_size=LO)


@settings(deadline=None)  # the first example compiles
@given(
    params=st.lists(sampled_params, min_size=1, max_size=S),
    prompts=st.lists(token_lists, min_size=S, max_size=S),
    outputs=st.lists(token_lists, min_size=S, max_size=S),
    logits_seed=st.integers(0, 2**16),
)
def test_processed_probs_match_spec(params, prompts, outputs, logits_seed) -> None:
    n = len(params)
    logits = logits_from(logits_seed)
    history = TokenHistory.from_lists(prompts[:n], outputs[:n], S, LP, LO)
    got = np.asarray(processed_probs(logits, tensors([(p, 0, 0) for p in params]), history))
    for r, p in enumerate(params):
        want, margin = reference_probs(logits[r], p, prompts[r], outputs[r])
        assume(margin > 1e-4)  # float32 may legitimately flip a decision this close
        np.testing.assert_allclose(got[r], want, atol=2e-5, err_msg=f"row {r}: {p}")
    assert np.all(got[n:].max(axis=-1) == 1.0)  # padding rows are greedy


def test_filters_support_on_fixed_logits() -> None:
    x = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02] + [0.0] * (V - 7)) + 1e-30)
    logits = np.tile(x.astype(np.float32), (S, 1))
    rows = [
        (SamplingParams(top_k=2, seed=0), 0, 0),
        (SamplingParams(top_p=0.6, seed=0), 0, 0),  # 0.4 before token 1 < 0.6: keep 2
        (SamplingParams(top_p=0.66, seed=0), 0, 0),  # 0.65 before token 2 < 0.66: keep 3
        (SamplingParams(min_p=0.3, seed=0), 0, 0),  # >= 0.12: tokens 0, 1, 2
        (SamplingParams(top_k=3, top_p=0.7, seed=0), 0, 0),  # within top 3: 0.4/0.8 ...
    ]
    probs = np.asarray(processed_probs(logits, tensors(rows)))
    supports = [set(np.flatnonzero(probs[r] > 0)) for r in range(len(rows))]
    assert supports == [{0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2}, {0, 1}]
    np.testing.assert_allclose(probs[0, :2], [0.4 / 0.65, 0.25 / 0.65], rtol=1e-5)
    np.testing.assert_allclose(probs[3, :3], np.array([0.4, 0.25, 0.15]) / 0.8, rtol=1e-5)


def test_penalties_on_fixed_logits() -> None:
    logits = np.zeros((S, V), np.float32)
    logits[0, :4] = [2.0, -2.0, 1.0, 3.0]
    logits[1] = logits[0]
    p_rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    p_freq = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0)
    history = TokenHistory.from_lists([[0, 1], [0]], [[3], [3, 3, 2]], S, LP, LO)
    t = tensors([(p_rep, 0, 0), (p_freq, 0, 0)])
    from pagedjax.sampling import apply_penalties

    out = np.asarray(apply_penalties(logits, t, history))
    # Repetition over prompt + output: 2 / 2, -2 * 2, untouched, 3 / 2.
    np.testing.assert_allclose(out[0, :4], [1.0, -4.0, 1.0, 1.5])
    # Output tokens only (prompt token 0 is not penalised): 3 - 0.5*2 - 1, 1 - 0.5 - 1.
    np.testing.assert_allclose(out[1, :4], [2.0, -2.0, -0.5, 1.0])
    ids = np.asarray(sample(logits, t, history).token_ids)
    assert ids[0] == 3 and ids[1] == 0  # greedy follows the penalised logits


def test_token_counts_ignore_padding() -> None:
    ids = np.array([[1, 1, -1, -1], [V - 1, -1, -1, -1]], np.int32)
    counts = np.asarray(token_counts(ids, V))
    assert counts[0, 1] == 2 and counts[0].sum() == 2
    assert counts[1, V - 1] == 1 and counts[1].sum() == 1  # -1 must not wrap to V - 1


# ------------------------------------------------------------ seeded invariance


@settings(deadline=None)  # the first example compiles
@given(
    target=sampled_params,
    neighbours=st.lists(sampled_params, max_size=S - 1),
    slot=st.integers(0, S - 1),
    sample_index=st.integers(0, 3),
    position=st.integers(0, 1000),
    logits_seed=st.integers(0, 2**16),
)
def test_seeded_sample_independent_of_batch(
    target, neighbours, slot, sample_index, position, logits_seed
) -> None:
    target = SamplingParams(**{**target.__dict__, "n": 4})
    row = logits_from(logits_seed)[0]
    prompt, output = [1, 2, 2], [5, 5, 7]
    alone_logits = np.zeros((S, V), np.float32)
    alone_logits[0] = row
    alone = sample(
        alone_logits,
        tensors([(target, sample_index, position)]),
        TokenHistory.from_lists([prompt], [output], S, LP, LO),
    )
    slot = min(slot, len(neighbours))
    rows = [(p, 0, i) for i, p in enumerate(neighbours)]
    rows.insert(slot, (target, sample_index, position))
    prompts = [[3, 4]] * len(rows)
    outputs = [[9, 10, 11]] * len(rows)
    prompts[slot], outputs[slot] = prompt, output
    batch_logits = logits_from(logits_seed + 1)
    batch_logits[slot] = row
    batch = sample(
        batch_logits, tensors(rows), TokenHistory.from_lists(prompts, outputs, S, LP, LO)
    )
    for field in alone._fields:
        np.testing.assert_array_equal(
            np.asarray(getattr(batch, field))[slot], np.asarray(getattr(alone, field))[0]
        )


def test_seeded_sample_same_for_other_padded_size() -> None:
    p = SamplingParams(temperature=1.5, seed=1234, n=2)
    rows = [(p, i % 2, i) for i in range(S)]
    logits = np.tile(logits_from(7)[:1], (S, 1))
    small = sample(logits, tensors(rows))
    big_logits = np.concatenate([logits_from(8, s=3 * S), logits], axis=0)
    big_rows = [(SamplingParams(seed=i), 0, 0) for i in range(3 * S)] + rows
    big = sample(big_logits, tensors(big_rows, s=4 * S))
    np.testing.assert_array_equal(np.asarray(big.token_ids)[3 * S :], small.token_ids)


def test_key_depends_on_seed_index_and_position() -> None:
    # With a flat distribution over V tokens, 8 draws repeating exactly by chance is
    # (1/16)^8; a key ignoring one of its inputs would repeat them surely.
    logits = np.zeros((S, V), np.float32)

    def draws(seed: int, index: int, offset: int) -> np.ndarray:
        p = SamplingParams(seed=seed, n=2)
        return np.asarray(
            sample(logits, tensors([(p, index, offset + i) for i in range(S)])).token_ids
        )

    base = draws(1, 0, 0)
    np.testing.assert_array_equal(base, draws(1, 0, 0))
    assert not np.array_equal(base, draws(2, 0, 0))
    assert not np.array_equal(base, draws(1, 1, 0))
    assert not np.array_equal(base, draws(1, 0, S))


# ------------------------------------------------------------ empirical frequencies

N_DRAWS = 4096


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.3, top_k=5, seed=12),
        SamplingParams(top_p=0.7, seed=13),
        SamplingParams(min_p=0.1, temperature=1.2, seed=14),
        SamplingParams(top_k=6, top_p=0.9, min_p=0.05, presence_penalty=1.0, seed=15),
    ],
    ids=["temperature", "top_k", "top_p", "min_p", "combined"],
)
def test_empirical_frequencies(params: SamplingParams) -> None:
    logits = np.tile(logits_from(3, s=1, scale=1.5), (N_DRAWS, 1))
    t = tensors([(params, 0, i) for i in range(N_DRAWS)], s=N_DRAWS)
    history = TokenHistory.from_lists([[0]] * N_DRAWS, [[1, 2]] * N_DRAWS, N_DRAWS, 1, 2)
    ids = np.asarray(sample(logits, t, history, max_logprobs=1).token_ids)
    probs = np.asarray(
        processed_probs(
            logits[:1],
            tensors([(params, 0, 0)], s=1),
            TokenHistory(history.prompt_ids[:1], history.output_ids[:1]),
        )
    )
    probs = probs[0].astype(np.float64)
    observed = np.bincount(ids, minlength=V)
    support = probs > 0
    assert observed[~support].sum() == 0, "sampled a filtered-out token"
    expected = N_DRAWS * probs[support]
    chi2 = float(np.sum((observed[support] - expected) ** 2 / expected))
    dof = max(int(support.sum()) - 1, 1)
    # Loose bound, about 5 standard deviations above the mean of chi2(dof).
    assert chi2 < dof + 5 * np.sqrt(2 * dof) + 5, (chi2, dof)


# ------------------------------------------------------------ greedy and logprobs


@settings(deadline=None)  # the first example compiles
@given(logits_seed=st.integers(0, 2**16))
def test_greedy_and_small_temperature_are_argmax(logits_seed: int) -> None:
    logits = logits_from(logits_seed)
    greedy = SamplingParams(temperature=0.0, top_k=2, top_p=0.1)  # filters ignored
    cold = SamplingParams(temperature=1e-3, seed=logits_seed)
    half = S // 2
    rows = [(greedy, 0, 0)] * half + [(cold, 0, i) for i in range(S - half)]
    ids = np.asarray(sample(logits, tensors(rows)).token_ids)
    argmax = np.argmax(logits, axis=-1)
    np.testing.assert_array_equal(ids[:half], argmax[:half])
    top2 = np.sort(logits, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05  # at T = 1e-3 a 0.05 gap leaves p < e^-50
    clear[:half] = False
    np.testing.assert_array_equal(ids[clear], argmax[clear])


def test_logprobs_are_raw_log_softmax() -> None:
    logits = logits_from(5)
    p = SamplingParams(temperature=0.9, top_k=4, repetition_penalty=1.5, seed=3, logprobs=5)
    history = TokenHistory.from_lists([[0, 1, 2]] * S, [[3]] * S, S, LP, LO)
    out = sample(logits, tensors([(p, 0, i) for i in range(S)]), history, max_logprobs=5)
    raw = np.asarray(jax.nn.log_softmax(logits.astype(np.float64), axis=-1))
    ids = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(S), ids], atol=1e-5)
    np.testing.assert_array_equal(out.ranks, 1 + np.sum(raw > raw[np.arange(S), ids][:, None], -1))
    assert out.top_ids.shape == (S, 5)
    top = np.asarray(out.top_logprobs)
    assert np.all(np.diff(top, axis=-1) <= 0)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=-1, kind="stable")[:, :5])
    np.testing.assert_allclose(top, np.sort(raw, axis=-1)[:, ::-1][:, :5], atol=1e-5)


def test_top_logprobs_only_when_a_row_asks_and_nothing_else_moves() -> None:
    """Ranks and top tokens are computed on a step where a row asked for logprobs and
    are zeros otherwise; the sampled ids and their logprobs are bitwise the same either
    way (a row's output does not depend on a neighbour's request)."""
    logits = logits_from(11)
    plain = [(SamplingParams(temperature=0.8, seed=5 + i), 0, i) for i in range(S)]
    asking = [*plain[:-1], (SamplingParams(temperature=0.8, seed=5 + S - 1, logprobs=2), 0, S - 1)]
    off = sample(logits, tensors(plain), max_logprobs=3)
    on = sample(logits, tensors(asking), max_logprobs=3)
    np.testing.assert_array_equal(off.token_ids, on.token_ids)
    np.testing.assert_array_equal(off.logprobs, on.logprobs)
    assert not np.any(off.ranks) and not np.any(off.top_ids) and not np.any(off.top_logprobs)
    raw = np.asarray(jax.nn.log_softmax(logits.astype(np.float64), axis=-1))
    ids = np.asarray(on.token_ids)
    np.testing.assert_array_equal(on.ranks, 1 + np.sum(raw > raw[np.arange(S), ids][:, None], -1))
    np.testing.assert_array_equal(on.top_ids, np.argsort(-raw, axis=-1, kind="stable")[:, :3])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, V - 1), st.booleans())
def test_first_argmax_is_jnp_argmax(seed: int, n_inf: int, tie: bool) -> None:
    """The sampler's argmax equals jnp.argmax, first index on ties, on rows with -inf
    entries and on a row that is all -inf."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 3, (S, V)).astype(np.float32)  # small integers: many ties
    x[0, rng.choice(V, n_inf, replace=False)] = -np.inf
    x[1] = -np.inf
    if tie:
        x[2, [1, V - 1]] = 10.0
    np.testing.assert_array_equal(first_argmax(x), np.argmax(x, axis=-1))
    # A NaN row (jnp.argmax: the NaN's index) gives V - 1: still a token id, never V.
    x[3, 2] = np.nan
    assert int(first_argmax(x)[3]) == V - 1


def test_prompt_logprobs() -> None:
    logits = logits_from(9)
    next_ids = np.array([3, 0, 15, 7, 7, 1, 2, -1], np.int32)
    out = prompt_logprobs(logits, next_ids, 3)
    raw = np.asarray(jax.nn.log_softmax(logits.astype(np.float64), axis=-1))
    np.testing.assert_allclose(out.logprobs[:-1], raw[np.arange(S - 1), next_ids[:-1]], atol=1e-5)
    assert out.logprobs[-1] == 0 and out.ranks[-1] == 0
    np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=-1, kind="stable")[:, :3])
    with pytest.raises(ValueError, match="k must be"):
        prompt_logprobs(logits, next_ids, V + 1)


# ------------------------------------------------------------ host helpers


def test_from_params_errors() -> None:
    with pytest.raises(ValueError, match="seed is None"):
        tensors([(SamplingParams(), 0, 0)])
    with pytest.raises(ValueError, match="sample_index"):
        tensors([(SamplingParams(seed=1, n=2), 2, 0)])
    with pytest.raises(ValueError, match="output_position"):
        tensors([(SamplingParams(seed=1), 0, -1)])
    with pytest.raises(ValueError, match="pad_to"):
        tensors([(SamplingParams(seed=1), 0, 0)] * 3, s=2)
    with pytest.raises(ValueError, match="rows\\[0\\]"):
        tensors([(0.5, 0, 0)])
    with pytest.raises(ValueError, match="outputs\\[0\\]"):
        TokenHistory.from_lists([[1]], [[1] * (LO + 1)], S, LP, LO)
    # A greedy request needs no seed.
    assert bool(tensors([(SamplingParams(temperature=0.0), 0, 0)]).greedy[0])
