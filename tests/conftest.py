"""Shared test settings: hypothesis profiles (``HYPOTHESIS_PROFILE=long`` for ``make test-long``)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption(
        "--solutions", action="store_true", default=False,
        help="run every notebook with the reference solutions injected into its exercise cells",
    )
