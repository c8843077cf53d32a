"""Host-built device arrays (pagedjax/engine/host_arrays.py) against the jnp calls they
replace, and the engine's state building compiling no op-by-op programs (issue 31: in a
cold run each one was an XLA compile of 17-80 ms)."""

from __future__ import annotations

import logging

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pagedjax.engine.host_arrays import filled_like, upload, zeros_like_tree
from pagedjax.memory.paged_policy import PagedPolicy
from pagedjax.scheduler import init_state

DTYPES = [np.float64, np.float32, np.int64, np.int32, np.uint32, np.bool_, np.int8]


def _same(a: jax.Array, b: jax.Array) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.weak_type == b.weak_type and a.committed == b.committed
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3))
def test_upload_is_jnp_asarray(dtype, shape):
    host = (np.arange(int(np.prod(shape)), dtype=np.int64) % 3).astype(dtype).reshape(shape)
    _same(upload(host), jnp.asarray(host))


def test_upload_copies_the_host_buffer():
    # On a CPU device_put alone may share a small numpy array's buffer; the engine
    # mutates its host mirrors (sampling rows, LoRA slots) in place after uploading.
    host = np.zeros(8, np.int32)
    dev = upload(host)
    host[:] = 7
    assert int(dev.sum()) == 0


@pytest.mark.parametrize("fill", [0, -1])
def test_filled_like_keeps_dtype_placement_and_weak_type(fill):
    plain = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    committed = jax.device_put(np.ones((2, 3), np.float32), jax.devices()[0])
    weak = jnp.asarray(1.0) * 2  # a weakly typed float32 scalar
    for x in (plain, committed, weak, jnp.zeros((4,), bool)):
        _same(filled_like(x, fill), jnp.full_like(x, fill))
    tree = {"a": plain, "b": (committed, weak)}
    want = jax.tree.leaves(jax.tree.map(jnp.zeros_like, tree))
    for got, w in zip(jax.tree.leaves(zeros_like_tree(tree)), want, strict=True):
        _same(got, w)


def _compiled_names(fn) -> list[str]:
    records: list[str] = []

    class _H(logging.Handler):
        def emit(self, record):
            if isinstance(record.msg, str) and record.msg.startswith("Compiling "):
                records.append(str(record.args[0]))

    logger = logging.getLogger("jax._src.interpreters.pxla")
    h = _H(level=logging.DEBUG)
    logger.addHandler(h)
    try:
        with jax.log_compiles(True):
            fn()
    finally:
        logger.removeHandler(h)
    return records


def test_state_building_compiles_nothing():
    # A geometry no other test uses, so no in-memory cache can hide a compile.
    policy = PagedPolicy(num_blocks=37, block_size=4, max_seqs=7, max_blocks_per_seq=9,
                         enable_prefix_caching=True, num_host_blocks=5,
                         track_evictions=True)  # fmt: skip
    state = None

    def build():
        nonlocal state
        state = init_state(policy, 7)
        upload(np.zeros((7, 11), np.float64))
        filled_like(state.status, -1)

    assert _compiled_names(build) == []
    pool = state.mem.pool
    assert int(pool.num_free) == 36 and pool.next_free.dtype == jnp.int32
    # the free list 1 -> 2 -> ... -> 36 -> sentinel 37, and back
    nxt, prv = np.asarray(pool.next_free), np.asarray(pool.prev_free)
    assert nxt[37] == 1 and nxt[36] == 37 and list(nxt[1:36]) == list(range(2, 37))
    assert prv[1] == 37 and prv[37] == 36 and nxt[0] == prv[0] == 0
