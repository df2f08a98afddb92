"""Fixtures for the issue 25 review: three real masters (the embedded server binary), a Redlock
over them, and nothing else shared with the other test packages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import ServerSet


@pytest.fixture(scope="module")
def server_set() -> Iterator[ServerSet]:
    with ServerSet(3) as servers:
        yield servers


@pytest.fixture
def masters(server_set: ServerSet) -> ServerSet:
    """Three running, empty masters."""
    server_set.ensure_running()
    for server in server_set:
        server.flushall()
    return server_set


@pytest.fixture
def rl(masters: ServerSet) -> Iterator[Redlock]:
    with Redlock(masters.urls, retry_count=0) as instance:
        yield instance
