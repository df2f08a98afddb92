"""Fixtures for the issue 26 review: three real masters (the embedded server binary), plain and
with an append-only file (a master killed comes back with its keys), and nothing shared with the
other test packages. Each test names the transports it runs over (both, as a differential)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_redlock.testing import ServerSet

TRANSPORTS = ["fast", "redis-py"]


def _ready(servers: ServerSet) -> ServerSet:
    servers.ensure_running()
    for server in servers:
        client = server.client()
        try:
            client.config_set("timeout", 0)
        finally:
            client.close()
    return servers


@pytest.fixture(scope="module")
def server_set() -> Iterator[ServerSet]:
    with ServerSet(3) as servers:
        yield servers


@pytest.fixture
def masters(server_set: ServerSet) -> ServerSet:
    """Three running, empty masters (paused or stopped ones brought back first)."""
    return _ready(server_set)


@pytest.fixture(scope="module")
def persistent_set() -> Iterator[ServerSet]:
    with ServerSet(3, persistent=True) as servers:
        yield servers


@pytest.fixture
def persistent(persistent_set: ServerSet) -> ServerSet:
    """Three running, empty masters that keep their keys across a kill (appendfsync always)."""
    return _ready(persistent_set)
