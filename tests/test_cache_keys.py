"""What survives between runs is keyed by what determines it: a changed source misses.

JAX's persistent compilation cache keys a program by its traced HLO, so it cannot go stale;
the two caches pagedjax keys itself can: the native kernels' shared libraries
(pagedjax/native_build.py: source, flags, compiler, FFI headers, jax / jaxlib, CPU) and
the program store's serialized step programs (pagedjax/engine/program_store.py: the
digest of every .py / .cc file of pagedjax and pallas_kernels, jax / jaxlib, ...).
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import pytest

from pagedjax import compile_cache, native_build
from pagedjax.engine import program_store
from pagedjax.engine.program_store import ProgramStore, tree_digest

_SOURCE = 'extern "C" int answer() { return %d; }\n'


@pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler")
def test_a_changed_kernel_source_builds_anew(tmp_path, monkeypatch):
    import ctypes

    monkeypatch.setenv("PAGEDJAX_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "k.cc"
    src.write_text(_SOURCE % 41)
    cxx, inc = native_build.compiler(), jax.ffi.include_dir()
    first = native_build.build_library(src, inc, cxx)
    assert first.parent == tmp_path / "cache"
    mtime = first.stat().st_mtime_ns
    assert native_build.build_library(src, inc, cxx) == first  # a hit: not rebuilt
    assert first.stat().st_mtime_ns == mtime
    src.write_text(_SOURCE % 42)  # the source changes: a miss, a new library
    second = native_build.build_library(src, inc, cxx)
    assert second != first and second.exists()
    assert ctypes.cdll.LoadLibrary(str(second)).answer() == 42
    assert ctypes.cdll.LoadLibrary(str(first)).answer() == 41


def test_kernel_key_covers_the_project_headers_it_includes(tmp_path):
    """A kernel's build key changes with a header it includes by a relative path (the
    shared native_pool.h), so editing the header rebuilds every kernel that uses it."""
    (tmp_path / "sub").mkdir()
    header = tmp_path / "shared.h"
    header.write_text("#define ANSWER 1\n")
    src = tmp_path / "sub" / "k.cc"
    src.write_text('#include "xla/ffi/api/ffi.h"\n#include "../shared.h"\n' + _SOURCE % 1)
    assert native_build.local_headers(src) == [header.resolve()]
    cxx = native_build.compiler() or "true"
    base = native_build.build_key(src, "/inc", cxx)
    header.write_text("#define ANSWER 2\n")
    assert native_build.build_key(src, "/inc", cxx) != base


def test_the_kernels_include_the_shared_pool_header():
    from pagedjax.attention import native_cpu
    from pagedjax.model import native_lora, native_matmul

    for source in (native_cpu.SOURCE, native_matmul.SOURCE, native_lora.SOURCE):
        assert [h.name for h in native_build.local_headers(source)] == ["native_pool.h"]


def test_kernel_key_covers_jax_versions(tmp_path, monkeypatch):
    src = tmp_path / "k.cc"
    src.write_text(_SOURCE % 1)
    cxx = native_build.compiler() or "true"
    base = native_build.build_key(src, "/inc", cxx)
    monkeypatch.setattr(native_build.jaxlib.version, "__version__", "0.0.0")
    assert native_build.build_key(src, "/inc", cxx) != base
    monkeypatch.undo()
    monkeypatch.setattr(native_build.jax, "__version__", "0.0.0")
    assert native_build.build_key(src, "/inc", cxx) != base


def test_kernel_cache_dir_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDJAX_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native_build.cache_dir() == tmp_path / "pagedjax" / "kernels"
    monkeypatch.setenv("PAGEDJAX_KERNEL_CACHE", str(tmp_path / "k"))
    assert native_build.cache_dir() == tmp_path / "k"


def test_a_changed_python_source_misses_the_program_store(tmp_path, monkeypatch):
    """The store's key changes with any .py / .cc file of the package, so a program saved
    before an edit is not loaded after it (and the jax / jaxlib versions are in the key)."""
    tree = tmp_path / "src"
    shutil.copytree(
        program_store.Path(program_store.__file__).parents[1] / "sampling",
        tree / "pagedjax" / "sampling",
    )
    before = tree_digest(tree)
    assert tree_digest(tree) == before  # deterministic
    victim = next((tree / "pagedjax").rglob("*.py"))
    victim.write_text(victim.read_text() + "\n# an edit\n")
    assert tree_digest(tree) != before
    edited_digest = tree_digest(tree)
    (tree / "pagedjax" / "new.cc").write_text("// a new kernel source\n")
    assert tree_digest(tree) not in (before, edited_digest)

    x = jnp.ones(3)
    store = ProgramStore(tmp_path / "store")
    key = store.key("f", "", (x,), {})
    with compile_cache.bypassed():  # as the engine saves (tests/test_program_store.py)
        compiled = jax.jit(lambda v: v + 1).lower(x).compile()
    store.save(key, compiled)
    assert ProgramStore(tmp_path / "store").load(key) is not None  # same source: a hit
    monkeypatch.setattr(program_store, "source_digest", lambda: before)  # an edited source
    edited = ProgramStore(tmp_path / "store")
    assert edited.key("f", "", (x,), {}) != key
    assert edited.load(edited.key("f", "", (x,), {})) is None  # a miss
    monkeypatch.setattr(program_store.jaxlib.version, "__version__", "0.0.0")
    assert ProgramStore(tmp_path / "store").key("f", "", (x,), {}) != key  # another jaxlib


def test_the_suite_uses_the_persistent_per_user_cache(monkeypatch, tmp_path):
    """conftest.py leaves the compilation cache at the per-user default (kept between
    runs) unless the developer's environment names another."""
    import os

    if "PAGEDJAX_COMPILATION_CACHE" not in os.environ:
        assert jax.config.jax_compilation_cache_dir == str(compile_cache.default_cache_dir())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_cache_dir() == tmp_path / "pagedjax" / "jax"


def test_prune_keeps_the_newest_files_under_the_cap(tmp_path):
    import os

    for i in range(5):
        f = tmp_path / "sub" / f"{i}.bin" if i % 2 else tmp_path / f"{i}.bin"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"x" * 100)
        os.utime(f, (1000 + i, 1000 + i))
    assert compile_cache.prune(tmp_path, max_bytes=250) == 300
    left = sorted(p.name for p in tmp_path.rglob("*.bin"))
    assert left == ["3.bin", "4.bin"]
    assert compile_cache.prune(tmp_path / "missing", max_bytes=0) == 0
