"""One script policy, on real masters: every script goes by digest (EVALSHA); a master that lost
its scripts answers NOSCRIPT, runs nothing, and the transport sends it the source (EVAL) on the
same link within the same call, so the caller only ever sees the script's own reply. Every new
link loads every script (SCRIPT LOAD with its handshake), so a restarted master is never sent a
digest it does not know. A contract module: every scenario runs over both transports.

Each step that sends a script checks, in the masters' ``INFO errorstats``, that every master did
answer NOSCRIPT: the fallback was exercised, not skipped by a script cached some other way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.lock import markers, scripts
from celery_redlock.lock.commands import EXTEND, PLAIN, REENTRANT
from celery_redlock.lock.resource import Lock
from celery_redlock.testing import ServerSet
from tests.core.conftest import wait_for
from tests.onmasters import holding

from .conftest import take

pytestmark = pytest.mark.timeout(60)

MASTERS_LOGGER = "celery_redlock.masters"
TTL = 5.0
KINDS = ["plain", "waiting", "fair", "fenced", "reentrant", "handover"]


@pytest.fixture
def redlock(masters: ServerSet, transport: str) -> Iterator[Redlock]:
    # A generous request_timeout: a reply that comes late on a loaded machine is owed, and a
    # NOSCRIPT read as an owed reply is (by design) not resent; these tests are about the rest.
    with Redlock(masters.urls, retry_count=0, request_timeout=1.0, transport=transport) as instance:
        # Links made now: a new link loads every script, which would hide the flushes below.
        instance.read_everywhere("warm")
        yield instance


def flush_scripts(masters: ServerSet) -> None:
    for server in masters:
        client = server.client()
        try:
            client.script_flush()
        finally:
            client.close()


def noscript_counts(masters: ServerSet) -> list[int]:
    """How many NOSCRIPT errors each master has answered since it started."""
    counts = []
    for server in masters:
        client = server.client()
        try:
            stats = client.info("errorstats")
        finally:
            client.close()
        entry = stats.get("errorstat_NOSCRIPT", {})
        # redis-py parses the entry into a dict; its oldest supported version leaves "count=N".
        if isinstance(entry, str):
            entry = dict(part.split("=", 1) for part in entry.split(","))
        counts.append(int(entry.get("count", 0)))
    return counts


def after_a_flush(masters: ServerSet, step: Callable[[], object], *, scripted: bool = True) -> object:
    """``step()`` run right after every master lost its scripts; if it sends a script, every
    master must have answered NOSCRIPT to it (and the step still did what it does)."""
    flush_scripts(masters)
    before = noscript_counts(masters)
    result = step()
    if scripted:
        after = noscript_counts(masters)
        assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)
    return result


def released(masters: ServerSet, redlock: Redlock, key: str, caplog: pytest.LogCaptureFixture) -> None:
    """``key`` is gone from every master; or, where it is not (the fast transport, a NOSCRIPT
    that came after the quorum answered: owed, and by design not resent), a WARNING names that
    master and NOSCRIPT once the reply has been read."""
    if wait_for(lambda: not any(holding(masters, key)), 2.0):
        return
    assert sum(holding(masters, key)) <= len(masters) - redlock.quorum, holding(masters, key)
    redlock.read_everywhere("drain")  # the owed replies are read by the links' next use
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    for server, kept in zip(masters, holding(masters, key), strict=True):
        assert not kept or (server.address in warned and "NOSCRIPT" in warned), (server.address, warned)


def taken(masters: ServerSet, redlock: Redlock, kind: str, name: str) -> Lock:
    """A lock of ``kind`` on ``name``, acquired right after the masters lost their scripts."""
    if kind == "handover":
        side = markers.side_key(redlock.key_prefix, name, "owner")
        value = markers.new_value("queued")
        assert markers.place(redlock, name, side, value, TTL).value == value
        lock: Lock = markers.HandoverLock(redlock, name, TTL, marker=value, side=side)
        assert after_a_flush(masters, lambda: lock.acquire(blocking=False)), lock.last_error
        assert redlock.read_everywhere(side) == [None] * len(masters)  # taken over in one step
        return lock
    if kind == "waiting":
        lock = redlock.lock(name, ttl=TTL)
        # Another holder, on every master until one instant (the masters share this host's
        # clock): set one by one for a fixed time, the keys went at different moments, and on a
        # loaded host an attempt between them took some masters. Its retraction, sent unwaited
        # right after the flush, was answered NOSCRIPT and not resent (the documented gap of a
        # SCRIPT FLUSH under live links), and those grants outlived the test's wait.
        until = int((time.time() + 1.0) * 1000)
        for server in masters:
            client = server.client()
            try:
                client.set(lock.key, "another holder", pxat=until)
            finally:
                client.close()
        # The first attempt is a plain SET; the later ones ask for the holder's PTTL by script.
        assert after_a_flush(masters, lambda: lock.acquire(timeout=5)), lock.last_error
        return lock
    options = {kind: True} if kind != "plain" else {}
    lock = redlock.lock(name, ttl=TTL, **options)  # type: ignore[call-overload]
    assert after_a_flush(masters, lambda: lock.acquire(blocking=False), scripted=kind != "plain"), (
        lock.last_error
    )
    return lock


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_acquires_extends_and_releases_while_the_masters_lose_their_scripts(
    masters: ServerSet, redlock: Redlock, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=MASTERS_LOGGER)
    lock = taken(masters, redlock, kind, f"flushed-{kind}")
    # (A waiting lock may be granted by a quorum only: its attempt can meet the other holder's
    # keys as some have expired and others not yet.)
    held = holding(masters, lock.key)
    assert lock.owned() and sum(held) >= redlock.quorum
    if kind == "fenced":
        assert lock.fence is not None  # type: ignore[attr-defined]
    assert after_a_flush(masters, lambda: lock.extend(30.0)), lock.last_votes
    for server, has in zip(masters, held, strict=True):
        client = server.client()
        try:
            assert not has or client.pttl(lock.key) > 10_000  # the extension ran (the TTL was 5 s)
        finally:
            client.close()
    if kind == "reentrant":
        assert after_a_flush(masters, lambda: lock.acquire(blocking=False))  # re-entry
        assert after_a_flush(masters, lock.release)  # inner exit: still held
        assert lock.owned() and holding(masters, lock.key) == held
    assert after_a_flush(masters, lock.release)
    assert not lock.owned()
    released(masters, redlock, lock.key, caplog)


@pytest.mark.parametrize("kind", KINDS)
def test_a_master_restarted_empty_mid_hold_is_sent_nothing_it_does_not_know(
    masters: ServerSet, redlock: Redlock, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=MASTERS_LOGGER)
    lock = taken(masters, redlock, kind, f"restarted-{kind}")
    held = holding(masters, lock.key)
    # One that does not hold it if there is one (see the test above): the lock keeps a quorum.
    restarted = held.index(False) if not all(held) else 0
    masters[restarted].restart(keep_data=False)  # keys and script cache gone; our links closed
    assert lock.extend(), lock.last_votes  # the others still hold it
    assert lock.release()
    released(masters, redlock, lock.key, caplog)
    # The restarted master's new link loaded every script before it carried one: it never
    # answered NOSCRIPT, and has them all.
    assert noscript_counts(masters)[restarted] == 0
    client = masters[restarted].client()
    try:
        assert all(client.script_exists(*(s.sha1 for s in scripts.for_masters())))
    finally:
        client.close()
    again = taken(masters, redlock, kind, f"restarted-{kind}-again") if kind != "waiting" else None
    if again is not None:
        assert all(holding(masters, again.key))
        again.release()


def test_a_new_connection_loads_every_script(masters: ServerSet, transport: str) -> None:
    flush_scripts(masters)
    with Redlock(masters.urls, transport=transport) as fresh:
        fresh.read_everywhere("anything")  # one round: one new connection per master
        for server in masters:
            client = server.client()
            try:
                assert all(client.script_exists(*(s.sha1 for s in scripts.for_masters())))
                # Sent to data servers, never to a lock master.
                assert not any(client.script_exists(scripts.FENCED_READ.sha1, scripts.FENCED_WRITE.sha1))
            finally:
                client.close()


def test_the_caller_sees_the_scripts_replies_never_noscript(masters: ServerSet, redlock: Redlock) -> None:
    """At the transport: a call, and a batch with scripts between plain commands, answered
    NOSCRIPT by every master, come back with the scripts' own replies, in the batch's order."""
    n = len(masters)
    with redlock._round() as rnd:
        assert [o.value for o in rnd.call([("SET", "redlock:a", "t", "PX", 60_000)] * n, 1.0)] == [b"OK"] * n
        flush_scripts(masters)
        assert [(o.kind, o.value) for o in rnd.call([EXTEND.pack("redlock:a", "t", 30_000)] * n, 1.0)] == [
            ("ok", 1)
        ] * n
        flush_scripts(masters)
        batch = [
            PLAIN.release.pack("redlock:a", "other"),  # another token's: 0, nothing deleted
            ("GET", "redlock:a"),
            REENTRANT.acquire.pack("redlock:b", "t", 60_000),
            PLAIN.release.pack("redlock:a", "t"),
            ("EXISTS", "redlock:a"),
        ]
        for replies in rnd.call_many([batch] * n, 1.0):
            assert [(o.kind, o.value) for o in replies] == [
                ("ok", 0),
                ("ok", b"t"),
                ("ok", b"OK"),
                ("ok", 1),
                # Read before the release's EVAL ran: a command resent after NOSCRIPT runs after
                # the batch's later ones (batches hold other keys: see transport.batch.await_batch).
                ("ok", 1),
            ], replies
    assert not any(holding(masters, "redlock:a"))


def test_the_heartbeats_batched_extensions_survive_a_flush(masters: ServerSet, redlock: Redlock) -> None:
    locks = [redlock.lock(f"beat-{n}", ttl=TTL) for n in range(3)]
    assert all(lock.acquire(blocking=False) for lock in locks)
    assert after_a_flush(masters, lambda: redlock.extend_many(locks)) == [True] * 3
    for lock in locks:
        assert lock.release()


def test_a_release_nobody_waits_for_after_a_flush(
    masters: ServerSet, redlock: Redlock, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The gap the connect-time load narrows: a reply nobody waits for. The reference transport's
    lanes read every reply, and resend; the fast one reads it with the link's next use, when the
    command is long gone: the key lives out its TTL, and a WARNING names the master."""
    caplog.set_level(logging.WARNING, logger=MASTERS_LOGGER)
    lock = redlock.lock("unwaited", ttl=TTL)
    assert take(lock)
    flush_scripts(masters)
    lock.release_without_waiting()
    time.sleep(0.2)  # the replies are in
    redlock.read_everywhere("next")  # each link's next use reads what it owes
    if transport == "redis-py":
        assert wait_for(lambda: not any(holding(masters, lock.key)), 2.0)
        return
    assert all(holding(masters, lock.key))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for server in masters:
        assert any(server.address in w and "NOSCRIPT" in w for w in warnings), (server.address, warnings)
