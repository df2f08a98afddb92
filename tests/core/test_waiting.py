"""Waiting woken by the release (issue 16, part 2), on real masters.

Invariants attacked here:
- a waiter with time left is woken by the holder's release, not by a poll: every handoff here runs
  with ``retry_delay=10``, so a waiter that polled would take seconds;
- a lost notice (the listening links killed, a deletion that published nothing) costs at most the
  fallback poll, never the whole timeout;
- the timeout bounds the whole call, and every timeout value means what the docstring says;
- one listening connection per master per Redlock, however many waiters;
- exclusion holds while waiters are woken (checked by the holders themselves).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator

import pytest

from celery_redlock import ConfigError, Redlock
from celery_redlock.lock.resource import Lock
from celery_redlock.testing import ServerSet

from .conftest import take, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair(masters: ServerSet) -> Iterator[tuple[Redlock, Redlock]]:
    """A holder's Redlock and a waiter's, with a retry delay no poll could hide behind."""
    with (
        Redlock(masters.urls, retry_delay=10, request_timeout=0.5) as holder,
        Redlock(masters.urls, retry_delay=10, request_timeout=0.5, wait_poll=2.0) as waiter,
    ):
        yield holder, waiter


def pubsub_clients(masters: ServerSet) -> list[int]:
    counts = []
    for server in masters:
        client = server.client()
        try:
            counts.append(len(client.client_list(_type="pubsub")))
        finally:
            client.close()
    return counts


def handoff(holder: Redlock, waiter: Redlock, name: str, free: object = None) -> float:
    """Seconds from the holder's release (or ``free(held_lock)``) returning to the waiter's acquire
    returning True; the waiter is asleep in its room before the release."""
    held = holder.lock(name, ttl=10)
    assert take(held)
    result: dict[str, object] = {}

    def wait() -> None:
        lock = waiter.lock(name, ttl=10)
        result["ok"] = lock.acquire(timeout=8)
        result["at"] = time.monotonic()
        lock.release()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    # Asleep in the room: its subscription is confirmed on every master.
    assert wait_for(lambda: min(pubsub_clients_of(waiter)) >= 1, 5.0)
    time.sleep(0.05)  # past its second attempt (the one after joining), into the sleep
    released = time.monotonic()
    if free is None:
        held.release()
    else:
        free(held)  # type: ignore[operator]
    thread.join(10)
    assert result.get("ok") is True, result
    return float(result["at"]) - released  # type: ignore[arg-type]


def pubsub_clients_of(redlock: Redlock) -> list[int]:
    return [1 if listener.link is not None else 0 for listener in redlock._subscriber._listeners]


def test_woken_by_release_not_by_polling(pair: tuple[Redlock, Redlock]) -> None:
    holder, waiter = pair
    times = [handoff(holder, waiter, f"wake-{n}") for n in range(5)]
    # A poll with retry_delay=10 would wait 5 s on average; the release wakes it in about a round.
    assert max(times) < 0.5, times


def test_release_publishes_only_what_it_deletes(masters: ServerSet, rl: Redlock) -> None:
    client = masters[0].client()
    pubsub = client.pubsub()
    try:
        pubsub.subscribe("redlock:published")
        assert pubsub.get_message(timeout=2)["type"] == "subscribe"
        assert rl.release_key("redlock:published", "not-held") is True  # answered; deletes nothing
        lock = rl.lock("published", ttl=5)
        assert take(lock)
        lock.release()
        message = pubsub.get_message(timeout=2)
        assert message is not None and message["type"] == "message", message
        assert message["data"] == b"*"
        assert pubsub.get_message(timeout=0.2) is None  # the refused release published nothing
    finally:
        pubsub.close()
        client.close()


def test_lost_notices_cost_at_most_the_fallback_poll(masters: ServerSet) -> None:
    """The key vanishes without a notice (deleted by hand: no release script ran): the waiter
    is back by its fallback poll, not by its 8 s timeout."""
    with (
        Redlock(masters.urls, retry_delay=10, request_timeout=0.5) as holder,
        Redlock(masters.urls, retry_delay=10, request_timeout=0.5, wait_poll=0.5) as waiter,
    ):

        def delete_silently(_: object) -> None:
            for server in masters:
                client = server.client()
                try:
                    client.delete("redlock:silent")
                finally:
                    client.close()

        took = handoff(holder, waiter, "silent", delete_silently)
        assert took < 0.5 + 0.5 + 0.3, took  # wait_poll, a round, slack for load


def test_listening_links_killed_before_the_release(masters: ServerSet, pair: tuple[Redlock, Redlock]) -> None:
    """The masters drop every pubsub connection just before the release: the waiter's
    resubscription counts as a notice, so it tries again well before its fallback poll (2 s)."""
    holder, waiter = pair

    def kill_then_release(held: Lock) -> None:
        for server in masters:
            client = server.client()
            try:
                client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            finally:
                client.close()
        held.release()

    assert handoff(holder, waiter, "killed", kill_then_release) < 1.5


def test_timeout_bounds_the_call(rl: Redlock, masters: ServerSet) -> None:
    with Redlock(masters.urls, retry_delay=10, request_timeout=0.2) as waiter:
        held = rl.lock("bounded", ttl=10)
        assert take(held)
        for timeout in (0.0, 0.3, 1.0):
            started = time.monotonic()
            assert not waiter.lock("bounded", ttl=10).acquire(timeout=timeout)
            took = time.monotonic() - started
            assert timeout <= took < timeout + 0.2 + 0.2, (timeout, took)  # + request_timeout + slack
        held.release()


@pytest.mark.parametrize("forever", [-1, math.inf])
def test_no_limit_waits_until_the_release(pair: tuple[Redlock, Redlock], forever: float) -> None:
    holder, waiter = pair
    held = holder.lock("forever", ttl=10)
    assert take(held)
    timer = threading.Timer(0.5, held.release)
    timer.start()
    started = time.monotonic()
    lock = waiter.lock("forever", ttl=10)
    assert lock.acquire(timeout=forever)
    assert 0.4 < time.monotonic() - started < 2.0
    lock.release()
    timer.join()


@pytest.mark.parametrize("bad", [math.nan, -2, -0.5, -math.inf, True, "1", None.__class__])
def test_bad_timeouts_are_refused_by_name(rl: Redlock, bad: object) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        rl.lock("bad-timeout").acquire(timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="timeout"):
        rl.lock("bad-timeout", timeout=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("wait", "sometimes"),
        ("wait", None),
        ("wait_poll", 0.01),
        ("wait_poll", math.nan),
        ("wait_poll", math.inf),
    ],
)
def test_bad_wait_options_are_refused_by_name(masters: ServerSet, option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=option):
        Redlock(masters.urls, request_timeout=0.1, **{option: value})  # type: ignore[arg-type]


def test_cancelled_ends_the_wait(pair: tuple[Redlock, Redlock]) -> None:
    holder, waiter = pair
    held = holder.lock("cancel", ttl=10)
    assert take(held)
    stop_at = time.monotonic() + 0.3
    started = time.monotonic()
    assert not waiter.lock("cancel", ttl=10).acquire(timeout=8, cancelled=lambda: time.monotonic() > stop_at)
    assert time.monotonic() - started < 0.3 + 0.5 + 0.3  # one sleep slice after the cancel, at most
    held.release()


def test_one_listening_link_per_master(masters: ServerSet, pair: tuple[Redlock, Redlock]) -> None:
    holder, waiter = pair
    names = [f"many-{n}" for n in range(5)]
    held = [holder.lock(name, ttl=10) for name in names]
    for lock in held:
        assert take(lock)
    before = pubsub_clients(masters)
    got: list[str] = []
    errors: list[BaseException] = []

    def wait(name: str) -> None:
        try:
            lock = waiter.lock(name, ttl=10)
            if lock.acquire(timeout=8):
                got.append(name)
                lock.release()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(names[n % 5],), daemon=True) for n in range(20)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: min(pubsub_clients_of(waiter)) >= 1, 5.0)
    time.sleep(0.2)
    assert [now - then for now, then in zip(pubsub_clients(masters), before, strict=True)] == [1] * 5
    for lock in held:
        lock.release()
    for thread in threads:
        thread.join(15)
    assert not errors, errors
    assert sorted(got) == sorted(names[n % 5] for n in range(20))


def test_poll_mode_opens_no_listening_link(masters: ServerSet) -> None:
    with (
        Redlock(masters.urls, request_timeout=0.2) as holder,
        Redlock(masters.urls, request_timeout=0.2, retry_delay=0.05, wait="poll") as waiter,
    ):
        held = holder.lock("polled", ttl=10)
        assert take(held)
        threading.Timer(0.3, held.release).start()
        lock = waiter.lock("polled", ttl=10)
        assert lock.acquire(timeout=5)
        lock.release()
        assert waiter._subscriber._thread is None
        assert pubsub_clients_of(waiter) == [0] * 5


def test_close_stops_the_listening_thread(pair: tuple[Redlock, Redlock], masters: ServerSet) -> None:
    holder, waiter = pair
    before = pubsub_clients(masters)
    handoff(holder, waiter, "closing")
    waiter.close()
    assert waiter._subscriber._thread is None
    assert wait_for(
        lambda: (
            pubsub_clients(masters) == [max(0, b) for b in before]
            or all(c <= b for c, b in zip(pubsub_clients(masters), before, strict=True))
        ),
        5.0,
    )
    # Usable again after close: a later wait starts a new thread.
    assert handoff(holder, waiter, "closing-again") < 0.5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_waits_on_its_own(pair: tuple[Redlock, Redlock]) -> None:
    """A child forked while its parent listens starts with no room, link or thread of its
    parent's, and is woken by a release on links of its own."""
    holder, waiter = pair
    handoff(holder, waiter, "fork-warm")  # the parent's listening thread runs
    held = holder.lock("fork", ttl=10)
    assert take(held)
    threading.Timer(0.5, held.release).start()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's outcome is its exit code
        code = 1
        try:
            inherited = waiter._subscriber._thread is None and pubsub_clients_of(waiter) == [0] * 5
            lock = waiter.lock("fork", ttl=10)
            started = time.monotonic()
            ok = lock.acquire(timeout=5)
            code = 0 if inherited and ok and time.monotonic() - started < 1.5 else 3
            lock.release()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        os.waitpid(child, 0)
        pytest.fail("the forked child did not finish")


def test_waiters_never_overlap(masters: ServerSet) -> None:
    """Eight threads in two Redlocks pass one lock around 80 times, each holder checking that
    nobody else is inside; every one is woken by a release (retry_delay=10 leaves no other way
    to finish in time)."""
    inside = []
    overlaps = []
    done = []
    mutex = threading.Lock()
    with (
        Redlock(masters.urls, retry_delay=10, request_timeout=0.5) as one,
        Redlock(masters.urls, retry_delay=10, request_timeout=0.5) as two,
    ):

        def worker(redlock: Redlock, n: int) -> None:
            for _ in range(10):
                lock = redlock.lock("herd", ttl=10)
                if not lock.acquire(timeout=20):
                    continue
                with mutex:
                    inside.append(n)
                    if len(inside) > 1:
                        overlaps.append(list(inside))
                time.sleep(0.002)
                with mutex:
                    inside.remove(n)
                    done.append(n)
                lock.release()

        threads = [
            threading.Thread(target=worker, args=((one, two)[n % 2], n), daemon=True) for n in range(8)
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(40)
        took = time.monotonic() - started
    assert not overlaps
    assert len(done) == 80
    assert took < 20, took


def test_woken_when_an_abandoned_lock_expires(masters: ServerSet) -> None:
    """The holder never releases (a process killed hard): the waiter wakes when the holder's TTL
    runs out on a quorum, which its refused attempts told it (PTTL), not at its fallback poll (5 s
    here) nor by polling (retry_delay 10 s)."""
    with (
        Redlock(masters.urls, request_timeout=0.5) as holder,
        Redlock(masters.urls, retry_delay=10, request_timeout=0.5, wait_poll=5.0) as waiter,
    ):
        abandoned = holder.lock("abandoned", ttl=1.0)
        assert take(abandoned)
        taken_at = time.monotonic()
        lock = waiter.lock("abandoned", ttl=10)
        assert lock.acquire(timeout=8)
        took = time.monotonic() - taken_at
        assert 0.9 < took < 1.0 + 0.3, took  # the TTL, plus a round and slack for load
        lock.release()
