"""The device n-gram proposer equals the host one (``NgramProposer``) on random rows."""

from __future__ import annotations

import functools

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.engine.spec.ngram import NgramProposer
from pagedjax.engine.spec.ngram_device import propose_ngram

WIDTH, ROWS, K = 24, 4, 4


@functools.cache
def _jitted(min_n: int, max_n: int):
    return jax.jit(functools.partial(propose_ngram, min_n=min_n, max_n=max_n, k=K))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    data=st.data(),
    ns=st.sampled_from([(1, 1), (1, 3), (2, 3), (2, 5)]),
    vocab=st.integers(2, 5),  # a small vocabulary makes n-grams recur
)
def test_device_proposer_equals_host(data, ns, vocab):
    lengths = data.draw(st.lists(st.integers(1, WIDTH), min_size=ROWS, max_size=ROWS))
    want = data.draw(st.lists(st.integers(0, K), min_size=ROWS, max_size=ROWS))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    tokens = rng.integers(0, vocab, (ROWS, WIDTH)).astype(np.int32)
    # Junk past each row's length must not matter.
    for r, n in enumerate(lengths):
        tokens[r, n:] = vocab + 7
    drafts, counts = jax.device_get(
        _jitted(*ns)(tokens, np.asarray(lengths, np.int32), np.asarray(want, np.int32))
    )
    host = NgramProposer(*ns)
    for r in range(ROWS):
        expect = host.propose(tokens[r, : lengths[r]], want[r])
        assert counts[r] == len(expect), (r, tokens[r, : lengths[r]], want[r])
        assert drafts[r, : counts[r]].tolist() == expect
        assert (drafts[r, counts[r] :] == -1).all()
