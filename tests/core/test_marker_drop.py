"""``markers.drop`` deletes a marker everywhere, or says where it could not.

A marker left behind answers every later publish of its resource with the id of a message that
will never run, for up to its TTL. The properties, on five real masters:

- every master that answers deletes it, in one round;
- the masters that do not answer within ``request_timeout`` cost no more than that, are returned
  and named in a WARNING; the deletes written to a stopped master take effect when it resumes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from celery_redlock.lock import markers
from celery_redlock.lock.redlock import Redlock
from celery_redlock.lock.resource import lock_key
from celery_redlock.testing import ServerSet

REQUEST_TIMEOUT = 0.5  # far above a loaded host's round trip; a stopped master costs it all
TTL_MS = 60_000


@pytest.fixture(scope="module")
def masters() -> Iterator[ServerSet]:
    with ServerSet(5) as servers:
        yield servers


@pytest.fixture
def rl(masters: ServerSet) -> Iterator[Redlock]:
    with Redlock(masters.urls, request_timeout=REQUEST_TIMEOUT) as redlock:
        yield redlock


def place_everywhere(masters: ServerSet, key: str, side: str) -> str:
    """A marker value on the lock key and on the side key of every master, set directly."""
    value = markers.new_value('{"name":"drop-test","task":"t-1","queued":true}')
    for server in masters:
        with server.client() as client:
            client.set(key, value, px=TTL_MS)
            client.set(side, value, px=TTL_MS)
    return value


def holding(masters: ServerSet, keys: tuple[str, ...], value: str) -> list[int]:
    """The indexes of the masters on which any of ``keys`` still holds ``value``."""
    found = []
    for i, server in enumerate(masters):
        with server.client() as client:
            if any(client.get(key) == value.encode() for key in keys):
                found.append(i)
    return found


def warm(rl: Redlock, value: str) -> None:
    """Every link connected and idle: a drop of a name nobody holds, made again until every
    master answered it (a first connect on a loaded host may take longer than a round)."""
    deadline = time.monotonic() + 10
    while markers.drop(rl, "drop:warmup", value):
        assert time.monotonic() < deadline, "the masters never all answered"


def release_calls(masters: ServerSet) -> list[int]:
    """Each master's count of script calls so far (the compare-and-delete is one)."""
    counts = []
    for server in masters:
        with server.client() as client:
            stats = client.info("commandstats")
        counts.append(
            sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
        )
    return counts


@pytest.mark.timeout(30)
def test_every_answering_master_deletes_it_once(masters: ServerSet, rl: Redlock) -> None:
    key, side = lock_key(rl.key_prefix, "drop:a"), "redlock-side:drop:a"
    value = place_everywhere(masters, key, side)
    warm(rl, value)  # connected before counting: a first connect loads scripts
    before = release_calls(masters)
    assert markers.drop(rl, "drop:a", value, side) == []
    assert holding(masters, (key, side), value) == []
    per_master = [after - b for after, b in zip(release_calls(masters), before, strict=True)]
    # one batch each: the lock key and the side key, each in both forms of the marker
    assert len(set(per_master)) == 1 and 2 <= per_master[0] <= 4, per_master


@pytest.mark.timeout(30)
def test_stopped_masters_are_named_and_the_deletes_land_on_resume(
    masters: ServerSet, rl: Redlock, caplog: pytest.LogCaptureFixture
) -> None:
    key, side = lock_key(rl.key_prefix, "drop:b"), "redlock-side:drop:b"
    value = place_everywhere(masters, key, side)
    warm(rl, value)
    stopped = [masters[1], masters[3]]
    for server in stopped:
        server.pause()
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="celery_redlock.markers"):
            left = markers.drop(rl, "drop:b", value, side)
        took = time.monotonic() - started
    finally:
        for server in stopped:
            server.resume()
    assert sorted(left) == sorted(
        m.name for m in rl.masters if m.name.endswith(tuple(f":{s.port}" for s in stopped))
    )
    assert len(left) == 2
    # the round waits its request_timeout for the stopped ones, and no longer
    assert took < REQUEST_TIMEOUT + 0.5, took
    warned = [r for r in caplog.records if "not confirmed deleted by 2 of 5 masters" in r.getMessage()]
    assert warned, [r.getMessage() for r in caplog.records]
    for server in stopped:
        assert f":{server.port}" in warned[0].getMessage()
    # The deletes written to the stopped masters' links run when they resume.
    deadline = time.monotonic() + 10
    while holding(masters, (key, side), value) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert holding(masters, (key, side), value) == []
