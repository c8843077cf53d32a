"""Hypothesis profiles: a deterministic CI profile, and a long one chosen by env var.

PAGEDJAX_HYPOTHESIS_PROFILE=long runs >= 5,000 examples per state machine / property.
"""

import os

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
