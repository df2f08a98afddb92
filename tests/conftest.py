"""Shared test settings. Lock masters come from the package's own pytest plugin
(``redlock_masters``, ``redlock_master_urls``, ``redlock``), loaded by ``-p`` in pyproject.toml's
addopts: real servers on free loopback ports."""

from __future__ import annotations

import pytest

from celery_redlock.testing.pytest_plugin import stop_on_sigterm


def pytest_configure(config: pytest.Config) -> None:
    # Our suite starts servers and workers from many fixtures, not only the plugin's: a SIGTERM
    # from the CI runner must tear all of them down.
    stop_on_sigterm()
