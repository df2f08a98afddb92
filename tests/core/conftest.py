"""Core tests run against the embedded valkey-server and, where installed, this machine's
redis-server 7: the lock must behave the same on both.

The contract modules (``CONTRACT_MODULES``) also run over both transports, the fast one and the
plain redis-py one (lock/transport/reference.py): every scenario there is a differential test of
the fast transport's extra code. Only there, and on the embedded server only, so the suite does
not double: the transports' subject is the client, not the server binary."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import ServerSet

from ..waiting import wait_for as wait_for  # the core tests import it from here

BINARIES = ["embedded"]
if shutil.which("redis-server"):
    BINARIES.append("redis-server")
TRANSPORTS = ["fast", "redis-py"]
# The modules whose every scenario runs over both transports (by the ``transport`` fixture).
CONTRACT_MODULES = {
    "test_lock_semantics",
    "test_release_contract",
    "test_quorum",
    "test_exclusion",
    "test_reentrant",
    "test_fencing",
    "test_fair",
    "test_failures",
    "test_noscript",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.module.__name__.rpartition(".")[2] in CONTRACT_MODULES:
        metafunc.parametrize("transport", TRANSPORTS, indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Only the contract modules run on both server binaries: that is where the binaries' parity
    is shown, command by command. The other core tests (explorations, adversarial reviews,
    link and waiting details) attack the protocol and the client, not the server binary: they
    run on the embedded one only, as doubling their minutes shows nothing more.

    The reference transport's runs are on the embedded binary only, and not for the explore or
    slow tests; a test marked ``fast_transport`` (it checks a detail of the fast transport) is
    skipped over it, with its reason."""
    keep, skip = [], []
    for item in items:
        contract = item.module is not None and item.module.__name__.rpartition(".")[2] in CONTRACT_MODULES
        if contract:
            item.add_marker(pytest.mark.contract)
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        on_system = params.get("server_set") == "redis-server"
        single = item.get_closest_marker("explore") or item.get_closest_marker("one_binary")
        reference = params.get("transport") == "redis-py"
        long = item.get_closest_marker("explore") or item.get_closest_marker("slow")
        (
            skip if (on_system and (single or reference or not contract)) or (reference and long) else keep
        ).append(item)
        fast_only = item.get_closest_marker("fast_transport")
        if reference and fast_only:
            item.add_marker(pytest.mark.skip(reason=f"checks a fast-transport detail: {fast_only.args[0]}"))
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


@pytest.fixture(autouse=True)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The transport of every Redlock the test builds in this process: ``rl``, its own, a
    subclass's, a helper's (``Redlock``'s default is patched for the test). Parametrized over
    TRANSPORTS in the contract modules, "fast" elsewhere."""
    name: str = getattr(request, "param", "fast")
    if name != "fast":
        defaults = Redlock.__init__.__kwdefaults__
        assert defaults is not None and "transport" in defaults
        monkeypatch.setitem(defaults, "transport", name)
    return name


@pytest.fixture
def rl(masters: ServerSet, transport: str) -> Iterator[Redlock]:
    with Redlock(masters.urls, retry_count=0, transport=transport) as instance:
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


def released_everywhere(masters: ServerSet, released: Any, *, key: str | None = None) -> bool:
    """An operator's release as a loaded host sees it: confirmed at once by a quorum of the
    masters (``released.deleted``), and applied by every master soon after, its delete having
    been sent to each (a late answer is not a refusal). ``key=None`` when someone may take the
    lock again at once: then only the quorum is asked for."""
    if released.deleted < len(masters) // 2 + 1:
        return False
    return key is None or wait_for(lambda: not any(keys_on(masters, key).values()), 5)


def take(lock: Any, within: float = 5.0) -> bool:
    """``lock.acquire(blocking=False)`` for a test whose subject is not the single attempt:
    an attempt that failed only because answers came late (a loaded host) is made again, until
    ``within``. A refusal by a holder is final at once: held on so many masters that no quorum is
    free, so a test that means "the key is free now" still fails when it is not. A held vote or
    two besides late answers are masters still working off a release that a quorum confirmed."""
    deadline = time.monotonic() + within
    while True:
        if lock.acquire(blocking=False):
            return True
        error = lock.last_error
        # Held: enough masters answered that the key is taken that no quorum is left free. Fewer
        # held votes than that are masters still working off a release that a quorum confirmed
        # (its other deletes are not waited for); the attempt failed on the late answers.
        held = error is None or sum(v.kind == "held" for v in error.votes) > len(error.votes) - error.quorum
        if held or time.monotonic() >= deadline:
            return False


def take_everywhere(lock: Any, within: float = 10.0) -> None:
    """Take ``lock`` (plain or reentrant, at depth 0) with a grant from every master, for a test
    whose premise is the lock on all of them: on a loaded host a master may answer late, its
    grant is then retracted, and nothing later (an extension, a re-entry) reaches it there.
    Such an acquire is released and made again, until ``within``."""
    deadline = time.monotonic() + within
    while True:
        assert take(lock, within=max(0.1, deadline - time.monotonic())), lock.last_error
        inner = lock.holding() if hasattr(lock, "holding") else lock
        votes = inner.last_votes
        if all(vote.kind == "yes" for vote in votes):
            return
        lock.release()
        assert time.monotonic() < deadline, f"never granted by every master: {votes}"


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
