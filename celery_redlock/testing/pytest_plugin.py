"""pytest fixtures with real lock masters. Opt-in, as Celery's own plugin is: in the root
``conftest.py`` write ``pytest_plugins = ["celery_redlock.testing.pytest_plugin"]``, or run
``pytest -p celery_redlock.testing.pytest_plugin``. Installing the package loads nothing into
anyone's pytest.

- ``redlock_masters``: five real servers on free loopback ports for the whole session, each with
  ``kill()``, ``pause()``, ``resume()``, ``restart()`` and ``flushall()``. Before every test that
  uses it, stopped servers are started again, paused ones resumed, and all of them emptied.
- ``redlock_master_urls``: their ``redis://`` URLs, for ``Redlock(...)`` or ``redlock_masters``
  in a Celery app's configuration.
- ``redlock``: a ``Redlock`` over those five masters, closed after the test.

Loading the plugin has no side effect: the first use of a server fixture starts the servers and
makes SIGTERM end the session the way Ctrl-C does, so the servers are stopped, not orphaned.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from types import FrameType

import pytest

from ..lock.redlock import Redlock
from .servers import ServerSet


def stop_on_sigterm() -> None:
    # CI runners stop a job with SIGTERM, which by default ends Python on the spot: no fixture
    # teardown, no atexit, and every server and worker the tests started is left running.
    # Stopping the session the way Ctrl-C does runs the teardown first. Installed only once a
    # fixture has started servers, and only where nobody installed a handler of their own.
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _stop_session)


def _stop_session(signum: int, frame: FrameType | None) -> None:
    pytest.exit(f"stopped by signal {signum}; tearing down", returncode=128 + signum)


@pytest.fixture(scope="session")
def _redlock_server_set() -> Iterator[ServerSet]:
    stop_on_sigterm()
    with ServerSet(5) as servers:
        yield servers


@pytest.fixture
def redlock_masters(_redlock_server_set: ServerSet) -> ServerSet:
    _redlock_server_set.ensure_running()
    return _redlock_server_set


@pytest.fixture
def redlock_master_urls(redlock_masters: ServerSet) -> list[str]:
    return redlock_masters.urls


@pytest.fixture
def redlock(redlock_master_urls: list[str]) -> Iterator[Redlock]:
    with Redlock(redlock_master_urls) as instance:
        yield instance
