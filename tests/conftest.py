"""Shared test settings. Lock masters come from the package's own pytest plugin
(``redlock_masters``, ``redlock_master_urls``, ``redlock``), loaded by ``-p`` in pyproject.toml's
addopts: real servers on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_redlock.testing.celery import ask_all_to_stop
from celery_redlock.testing.pytest_plugin import stop_on_sigterm


def pytest_configure(config: pytest.Config) -> None:
    # Our suite starts servers and workers from many fixtures, not only the plugin's: a SIGTERM
    # from the CI runner must tear all of them down.
    stop_on_sigterm()


# How long the session's own teardown may take (every worker pool, beat, server and proxy the
# session fixtures started), on a bound of its own.
SESSION_TEARDOWN_BOUND = 120.0


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The last test of a session (of each xdist worker) also tears down the session's fixtures,
    and pytest-timeout would charge that to the test's own limit: a 20 s test once failed on
    the worker pools' shutdown. Its teardown gets the session's bound instead.

    The session's fixtures stop their workers and beats one fixture after another; each
    shutdown takes a second or more on a loaded host. A finalizer added to the session now runs
    before theirs (finalizers run last-added first), once the test's and its module's are done:
    it asks every process still running to stop, so that the shutdowns overlap."""
    if nextitem is None:
        item.session.addfinalizer(ask_all_to_stop)
        import pytest_timeout

        hooks = item.config.pluginmanager.hook
        hooks.pytest_timeout_cancel_timer(item=item)
        method = getattr(item.config, "_env_timeout_method", "signal")
        bound = pytest_timeout.Settings(SESSION_TEARDOWN_BOUND, method, False, False)
        hooks.pytest_timeout_set_timer(item=item, settings=bound)
    yield


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``--dist loadfile`` (the README's command), the longest files are handed out first
    (tests/schedule.py says why); any other distribution is xdist's own."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from .schedule import LongestFirstScheduling

    return LongestFirstScheduling(config, log)
