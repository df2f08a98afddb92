"""pytest fixtures with real lock masters, registered through the ``pytest11`` entry point.

- ``redlock_masters``: five real servers on free loopback ports for the whole session, each with
  ``kill()``, ``pause()``, ``resume()``, ``restart()`` and ``flushall()``. Before every test that
  uses it, stopped servers are started again, paused ones resumed, and all of them emptied.
- ``redlock_master_urls``: their ``redis://`` URLs, for ``Redlock(...)`` or ``redlock_masters``
  in a Celery app's configuration.
- ``redlock``: a ``Redlock`` over those five masters, closed after the test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..redlock import Redlock
from .servers import ServerSet


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
