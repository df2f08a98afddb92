"""pytest fixtures with real lock masters, registered through the ``pytest11`` entry point.

- ``redlock_masters``: five real servers on free loopback ports for the whole session, each with
  ``kill()``, ``pause()``, ``resume()``, ``restart()`` and ``flushall()``. Before every test that
  uses it, stopped servers are started again, paused ones resumed, and all of them emptied.
- ``redlock_master_urls``: their ``redis://`` URLs, for ``Redlock(...)`` or ``redlock_masters``
  in a Celery app's configuration.
- ``redlock``: a ``Redlock`` over those five masters, closed after the test.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from types import FrameType

import pytest

from ..redlock import Redlock
from .servers import ServerSet


def pytest_configure(config: pytest.Config) -> None:
    # CI runners stop a job with SIGTERM, which by default ends Python on the spot: no fixture
    # teardown, no atexit, and every server and worker the tests started is left running.
    # Stopping the session the way Ctrl-C does runs the teardown first.
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _stop_session)


def _stop_session(signum: int, frame: FrameType | None) -> None:
    pytest.exit(f"stopped by signal {signum}; tearing down", returncode=128 + signum)


@pytest.fixture(scope="session")
def _redlock_server_set() -> Iterator[ServerSet]:
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
