"""The program store (pagedjax/engine/program_store.py): keys computed without tracing,
compiled steps saved and loaded back callable, damaged files compiled again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import compile_cache
from pagedjax.engine.program_store import ProgramStore


def _f(x, y, *, n):
    return (x * n + y).sum(axis=0)


def test_key_depends_on_what_determines_the_program(tmp_path):
    store = ProgramStore(tmp_path)
    x, y = jnp.ones((4, 3)), jnp.zeros((4, 3))
    base = store.key("f", "cfg", (x, y), dict(n=2))
    assert store.key("f", "cfg", (jnp.ones((4, 3)), jnp.ones((4, 3))), dict(n=2)) == base
    others = [
        store.key("g", "cfg", (x, y), dict(n=2)),  # another program
        store.key("f", "cfg2", (x, y), dict(n=2)),  # another configuration
        store.key("f", "cfg", (x, y), dict(n=3)),  # another static argument
        store.key("f", "cfg", (jnp.ones((5, 3)), y), dict(n=2)),  # another shape
        store.key("f", "cfg", (x.astype(jnp.int32), y), dict(n=2)),  # another dtype
        store.key("f", "cfg", (np.ones((4, 3), np.float32), y), dict(n=2)),  # numpy, not jax
        store.key("f", "cfg", ((x,), y), dict(n=2)),  # another tree structure
    ]
    assert base not in others and len(set(others)) == len(others)


def test_saved_program_loads_and_runs(tmp_path):
    fn = jax.jit(_f, static_argnames="n")
    x, y = jnp.arange(12.0).reshape(4, 3), jnp.ones((4, 3))
    store = ProgramStore(tmp_path)
    key = store.key("f", "", (x, y), dict(n=2))
    assert store.load(key) is None
    # As the engine does: a program loaded from JAX's persistent cache (warm from an earlier
    # run) does not serialize whole on the CPU (compile_cache.bypassed's docstring).
    with compile_cache.bypassed():
        compiled = fn.lower(x, y, n=2).compile()
    store.save(key, compiled)
    loaded = ProgramStore(tmp_path).load(key)
    np.testing.assert_array_equal(np.asarray(loaded(x, y)), np.asarray(fn(x, y, n=2)))


def test_damaged_file_is_compiled_again(tmp_path, caplog):
    store = ProgramStore(tmp_path)
    key = store.key("f", "", (jnp.ones(3),), {})
    (tmp_path / f"{key}.pkl").write_bytes(b"not a program")
    assert store.load(key) is None and store.hits == 0
    assert "did not load" in caplog.text


def test_off_without_a_cache_or_with_several_devices(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert ProgramStore.for_current_cache(1) is None
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        assert ProgramStore.for_current_cache(2) is None
        assert ProgramStore.for_current_cache(1).directory.parent == tmp_path
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
