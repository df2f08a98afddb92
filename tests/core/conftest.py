"""Core tests run against the embedded valkey-server and, where installed, this machine's
redis-server 7: the lock must behave the same on both."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import ServerSet

BINARIES = ["embedded"]
if shutil.which("redis-server"):
    BINARIES.append("redis-server")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The explore tests (hypothesis machines, adversarial reviews) attack the protocol, not a
    server binary: they run on the embedded one only. Every other core test runs on both, which
    is where the binaries' parity is shown; doubling the minutes of the explorations shows
    nothing more."""
    keep, skip = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_system = callspec is not None and callspec.params.get("server_set") == "redis-server"
        (skip if on_system and item.get_closest_marker("explore") else keep).append(item)
    if skip:
        config.hook.pytest_deselected(items=skip)
        items[:] = keep


@pytest.fixture(scope="session", params=BINARIES)
def server_set(request: pytest.FixtureRequest) -> Iterator[ServerSet]:
    binary = None if request.param == "embedded" else shutil.which("redis-server")
    with ServerSet(5, binary=binary) as servers:
        yield servers


@pytest.fixture
def masters(server_set: ServerSet) -> ServerSet:
    """Five running, empty masters (killed or paused ones are brought back first)."""
    server_set.ensure_running()
    return server_set


@pytest.fixture
def rl(masters: ServerSet) -> Iterator[Redlock]:
    with Redlock(masters.urls, retry_count=0) as instance:
        yield instance


def keys_on(masters: ServerSet, pattern: str = "redlock:*") -> dict[str, list[bytes]]:
    """Every key matching ``pattern`` on every running master."""
    found: dict[str, list[bytes]] = {}
    for server in masters:
        if server.running and not server.paused:
            client = server.client()
            try:
                found[server.address] = sorted(client.keys(pattern))
            finally:
                client.close()
    return found


def values_on(masters: ServerSet, key: str) -> dict[str, bytes | None]:
    """The value of ``key`` on every master, by address."""
    values: dict[str, bytes | None] = {}
    for server in masters:
        client = server.client()
        try:
            values[server.address] = client.get(key)
        finally:
            client.close()
    return values


def wait_for(predicate: Callable[[], object], timeout: float) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def set_idle_timeout(servers: ServerSet, seconds: int) -> None:
    for server in servers:
        client = server.client()
        try:
            client.config_set("timeout", seconds)
        finally:
            client.close()


@pytest.fixture
def idle_timeout(masters: ServerSet) -> Iterator[ServerSet]:
    """The masters close connections idle for more than one second (as managed Redis does)."""
    set_idle_timeout(masters, 1)
    try:
        yield masters
    finally:
        set_idle_timeout(masters, 0)
