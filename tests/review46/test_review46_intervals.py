"""Remembered heartbeat intervals and max_hold's fast path, on three real masters.

The cache key is (request_timeout, drift factor, TTL, interval asked): two Redlocks that differ
in one of them and share a heartbeat must each get their own check. A bad interval or max_hold
is refused at every keep(), whatever was remembered, and a good lock kept beside them goes on
being extended for several TTLs."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

import pytest

from celery_redlock import ConfigError, Lock, Redlock
from celery_redlock.lock.heartbeat import MAX_INTERVALS_KEPT, Heartbeat, process_heartbeat
from celery_redlock.testing import ServerSet
from tests.core.conftest import take

from .conftest import outlives

pytestmark = pytest.mark.timeout(60)


class Seconds(float):
    """A float subclass, as a settings layer might hand one over."""


@pytest.fixture
def redlocks(masters46: ServerSet) -> Iterator[dict[str, Redlock]]:
    """Redlocks over the same masters that differ in request_timeout or drift factor."""
    for server in masters46:
        server.flushall()
    made = {
        "base": Redlock(masters46.urls, request_timeout=0.01, drift_factor=0.01),
        "slow": Redlock(masters46.urls, request_timeout=0.3, drift_factor=0.01),
        "drifty": Redlock(masters46.urls, request_timeout=0.01, drift_factor=0.4),
    }
    try:
        yield made
    finally:
        for redlock in made.values():
            redlock.close()


@pytest.mark.parametrize("other", ["slow", "drifty"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-heartbeat", "process-heartbeat"])
def test_an_interval_checked_for_one_redlock_is_checked_again_for_another(
    redlocks: dict[str, Redlock], beat46: Heartbeat, other: str, shared: bool
) -> None:
    """0.7 s keeps a 1 s lock of the base Redlock (request_timeout 10 ms, drift 1 %), not one of
    a Redlock whose request_timeout is 0.3 s (largest 0.39 s) or drift 40 % (largest 0.58 s):
    the same TTL and interval asked, remembered for the first, must be refused for the second,
    at every keep()."""
    beat = process_heartbeat() if shared else beat46
    good = redlocks["base"].lock(f"iv-good-{other}-{shared}", ttl=1.0)
    assert take(good)
    beat.keep(good, interval=0.7)  # remembered for (0.01, 0.01, 1.0, 0.7)
    try:
        for attempt in range(3):
            bad = redlocks[other].lock(f"iv-bad-{other}-{shared}-{attempt}", ttl=1.0)
            assert take(bad)
            with pytest.raises(ConfigError, match="interval"):
                beat.keep(bad, interval=0.7)
            assert bad not in beat.kept()
            bad.release()
        outlives(good, seconds=3.0)  # three TTLs
    finally:
        beat.forget(good)
        good.release()


def test_the_default_interval_follows_the_request_timeout(
    redlocks: dict[str, Redlock], beat46: Heartbeat
) -> None:
    """The default interval is min(ttl / 3, longest): a request_timeout of 0.3 s gives a 0.9 s
    lock a shorter one than the base Redlock's third, and both are kept for several TTLs."""
    base = redlocks["base"].lock("default-base", ttl=0.9)
    slow = redlocks["slow"].lock("default-slow", ttl=0.9)
    assert take(base) and take(slow)
    beat46.keep(base)
    beat46.keep(slow)
    try:
        intervals = {lock.name: e.interval for e in beat46._entries.values() if (lock := e.lock_ref())}
        assert intervals["default-base"] == pytest.approx(0.3)
        assert intervals["default-slow"] == pytest.approx(0.9 - 0.011 - 0.6)
        outlives(base, slow, seconds=3.6)  # four TTLs
    finally:
        for lock in (base, slow):
            beat46.forget(lock)
            lock.release()


BAD_INTERVALS = [
    pytest.param(True, id="True"),
    pytest.param(False, id="False"),
    pytest.param(float("nan"), id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(-math.inf, id="-inf"),
    pytest.param(-1.0, id="negative"),
    pytest.param(0.0, id="zero"),
    pytest.param(-0.0, id="minus-zero"),
    pytest.param(1.4, id="too-long"),
    pytest.param(Seconds(1.4), id="too-long-subclass"),
    pytest.param(10**400, id="huge-int"),
    pytest.param("0.3", id="str"),
]


@pytest.mark.parametrize("bad", BAD_INTERVALS)
def test_a_bad_interval_is_refused_at_every_keep(rl46: Redlock, beat46: Heartbeat, bad: object) -> None:
    """Whatever was remembered before (1.0 and 0.3 for this TTL), a bad interval raises a
    ConfigError naming the interval at every keep(), and the good lock is still kept."""
    good = rl46.lock("bad-iv-good", ttl=1.5)
    other = rl46.lock("bad-iv-other", ttl=1.5)
    assert take(good) and take(other)
    beat46.keep(good, interval=0.3)
    beat46.keep(other, interval=1.0)
    beat46.forget(other)
    other.release()
    try:
        for attempt in range(3):
            lock = rl46.lock(f"bad-iv-{attempt}", ttl=1.5)
            assert take(lock)
            with pytest.raises(ConfigError, match="interval"):
                beat46.keep(lock, interval=bad)  # type: ignore[arg-type]
            assert lock not in beat46.kept()
            lock.release()
        outlives(good, seconds=3.0)  # two TTLs
    finally:
        beat46.forget(good)
        good.release()


@pytest.mark.parametrize(
    "fine",
    [
        pytest.param(1, id="int"),
        pytest.param(Seconds(0.3), id="float-subclass"),
    ],
)
def test_a_good_interval_of_another_type_keeps_the_lock(
    rl46: Redlock, beat46: Heartbeat, fine: object
) -> None:
    """An int or a float subclass is checked (every time) and keeps its lock for
    several TTLs; the entry's interval is a plain float of that value."""
    for attempt in range(2):
        lock = rl46.lock(f"fine-iv-{attempt}", ttl=1.5)
        assert take(lock)
        beat46.keep(lock, interval=fine)  # type: ignore[arg-type]
        (entry,) = (e for e in beat46._entries.values() if e.lock_ref() is lock)
        assert type(entry.interval) is float and entry.interval == float(fine)  # type: ignore[arg-type]
        outlives(lock, seconds=2.0 if attempt else 0.2)
        beat46.forget(lock)
        lock.release()


def test_past_the_cache_bound_intervals_are_still_checked(rl46: Redlock, beat46: Heartbeat) -> None:
    """More distinct (TTL, interval) pairs than MAX_INTERVALS_KEPT: the cache stops growing, a
    bad interval is still refused and a good one past the bound still keeps its lock."""
    lock = rl46.lock("bound", ttl=30.0)
    assert take(lock)
    for n in range(MAX_INTERVALS_KEPT + 20):
        beat46.keep(lock, interval=1.0 + n / 1000)
    assert len(beat46._intervals) == MAX_INTERVALS_KEPT
    with pytest.raises(ConfigError, match="interval"):
        beat46.keep(lock, interval=100.0)
    beat46.forget(lock)
    lock.release()
    short = rl46.lock("bound-short", ttl=0.5)
    assert take(short)
    with pytest.raises(ConfigError, match="interval"):
        beat46.keep(short, interval=1.0)  # remembered for TTL 30, never for 0.5
    beat46.keep(short)
    outlives(short, seconds=1.6)
    beat46.forget(short)
    short.release()


BAD_MAX_HOLD = [
    pytest.param(True, id="True"),
    pytest.param(False, id="False"),
    pytest.param(float("nan"), id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(0.0, id="zero"),
    pytest.param(0, id="int-zero"),
    pytest.param(-1.0, id="negative"),
    pytest.param(Seconds(math.nan), id="nan-subclass"),
    pytest.param(Seconds(-1.0), id="negative-subclass"),
    pytest.param("1.0", id="str"),
]


@pytest.mark.parametrize("bad", BAD_MAX_HOLD)
def test_a_bad_max_hold_is_refused_naming_it(rl46: Redlock, beat46: Heartbeat, bad: object) -> None:
    good = rl46.lock("mh-good", ttl=1.0)
    assert take(good)
    beat46.keep(good, max_hold=30.0)
    try:
        for attempt in range(2):
            lock = rl46.lock(f"mh-bad-{attempt}", ttl=1.0)
            assert take(lock)
            with pytest.raises(ConfigError, match="max_hold"):
                beat46.keep(lock, max_hold=bad)  # type: ignore[arg-type]
            assert lock not in beat46.kept()
            lock.release()
        outlives(good, seconds=2.0)
    finally:
        beat46.forget(good)
        good.release()


@pytest.mark.parametrize(
    "hold",
    [
        pytest.param(1.0, id="float"),
        pytest.param(1, id="int"),
        pytest.param(Seconds(1.0), id="float-subclass"),
    ],
)
def test_a_good_max_hold_stops_the_extensions_in_time(rl46: Redlock, beat46: Heartbeat, hold: object) -> None:
    """A 0.3 s lock with max_hold 1 s: kept past its TTL, given up at about 1 s (on_lost says
    max hold), and another client gets it within a TTL after that."""
    lock = rl46.lock("mh-good-stop", ttl=0.3)
    assert take(lock)
    lost = threading.Event()
    reasons: list[str] = []

    def on_lost(_lock: Lock, reason: str) -> None:
        reasons.append(reason)
        lost.set()

    started = time.monotonic()
    beat46.keep(lock, max_hold=hold, on_lost=on_lost)  # type: ignore[arg-type]
    outlives(lock, seconds=0.8)
    assert lost.wait(3.0)
    given_up = time.monotonic() - started
    assert 0.95 <= given_up <= 1.6, given_up
    assert len(reasons) == 1 and "max hold" in reasons[0]
    contender = rl46.lock("mh-good-stop", ttl=0.3)
    deadline = time.monotonic() + 1.0
    while not take(contender):
        assert time.monotonic() < deadline, "the lock was still extended after its max hold"
        time.sleep(0.02)
    contender.release()
    time.sleep(0.3)
    assert reasons == [reasons[0]]
