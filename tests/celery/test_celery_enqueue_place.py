"""A key's marker is placed once while it lives, however the masters stall.

``enqueue._place`` tries up to ``PLACE_ATTEMPTS`` times; a failed attempt is retracted by value,
and that delete may reach a master late (kept for a master with no link, or queued behind a late
reply on an old link), after the same publisher's next attempt wrote there. Here eight threads
place markers for a few keys at a time on five real masters with a 10 ms request timeout while
the masters are stopped (SIGSTOP) for a few ms each, one after another. No marker is ever deleted
or expires during the run (TTL 30 s), so any key placed twice is two publishers each holding a
quorum: two messages for one key. With one value for every attempt of a publish, a late
retraction deleted a later attempt's grant and this happened within seconds.
"""

from __future__ import annotations

import os
import random
import threading
import time
import types
from collections import defaultdict

import pytest

from celery_redlock.celery import enqueue
from celery_redlock.errors import LockNotAcquired
from celery_redlock.lock import markers
from celery_redlock.lock.holder import HolderRecord
from celery_redlock.lock.redlock import Redlock
from celery_redlock.lock.state import lock_key
from celery_redlock.testing import ServerSet

SECONDS = float(os.environ.get("PLACE_SECONDS", "8"))
THREADS = 8
KEYS = 10
WINDOW = 0.5  # a key name lives this long: the publishers of one window contend for it


@pytest.mark.timeout(90)
def test_no_key_is_placed_twice_while_its_marker_lives_under_stalling_masters() -> None:
    task = types.SimpleNamespace(name="place-test")
    placed: dict[str, list[str]] = defaultdict(list)
    mutex = threading.Lock()
    stop = threading.Event()
    counts: dict[str, int] = defaultdict(int)
    with ServerSet(5) as servers, Redlock(servers.urls, request_timeout=0.01) as rl:
        rng = random.Random(7)

        def stall() -> None:
            while not stop.is_set():
                server = rng.choice(list(servers))
                server.pause()
                time.sleep(rng.uniform(0.002, 0.03))
                server.resume()
                stop.wait(rng.uniform(0.0, 0.03))

        def publish(n: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                name = f"k{random.randrange(KEYS)}-{int(time.monotonic() // WINDOW)}"
                record = HolderRecord(name=task.name, host="h", pid=n, ttl=30.0, queued=True)
                value = markers.new_value(record.to_text(task=f"{n}.{i}", since=time.time(), publish="p"))
                try:
                    got = enqueue._place(task, rl, name, value, 30.0)
                except LockNotAcquired:
                    counts["refused"] += 1  # no quorum decided: nothing placed, nothing published
                    continue
                if isinstance(got, markers.Placed):
                    with mutex:
                        placed[name].append(f"{n}.{i}")
                counts["placed" if isinstance(got, markers.Placed) else "duplicate"] += 1

        threads = [threading.Thread(target=publish, args=(n,), daemon=True) for n in range(THREADS)]
        staller = threading.Thread(target=stall, daemon=True)
        for thread in [*threads, staller]:
            thread.start()
        try:
            time.sleep(SECONDS)
        finally:
            stop.set()
            for thread in [*threads, staller]:
                thread.join(30)
            for server in servers:
                if server.paused:
                    server.resume()
    twice = {name: who for name, who in placed.items() if len(who) > 1}
    assert counts["placed"] and counts["duplicate"], dict(counts)  # the run contended at all
    assert not twice, f"placed twice: {dict(list(twice.items())[:3])} of {len(placed)} keys; {dict(counts)}"


def _marker(task: types.SimpleNamespace, who: str) -> str:
    record = HolderRecord(name=task.name, host="h", pid=1, ttl=30.0, queued=True)
    return markers.new_value(record.to_text(task=who, since=time.time(), publish="p"))


@pytest.mark.timeout(60)
def test_a_vote_split_by_two_dead_publishers_is_waited_out_not_refused() -> None:
    """Progress: two publishers of one key were killed in the middle of a split (each holds the
    marker on two of five masters, for the publish window, and will never retract it). Nobody
    holds the key, and every master answers: a new publish of it tries on until their parts
    expire and is then placed, rather than refused after a handful of tries."""
    task = types.SimpleNamespace(name="split-test")
    split_for = 1.5  # the dead publishers' parts expire well inside the publish window
    with ServerSet(5) as servers, Redlock(servers.urls, request_timeout=1.0) as rl:
        key = lock_key(rl.key_prefix, "split")
        for server, who in zip(list(servers)[:4], ["dead-a", "dead-a", "dead-b", "dead-b"], strict=True):
            assert server.client().set(key, _marker(task, who), px=int(split_for * 1000))
        mine = _marker(task, "new")
        start = time.monotonic()
        got = enqueue._place(task, rl, "split", mine, 30.0)
        waited = time.monotonic() - start
        assert isinstance(got, markers.Placed) and got.value is not None, got
        assert split_for * 0.9 <= waited < enqueue.PUBLISH_WINDOW, waited
        values = [server.client().get(key) for server in servers]
        assert sum(v == got.value.encode() for v in values) >= rl.quorum, values


@pytest.mark.timeout(60)
def test_a_split_that_outlives_the_publish_window_is_refused_naming_every_vote() -> None:
    """Bounded: a split that does not resolve within the publish window is refused, with each
    master's vote, once the window is over (not for ever, not at once)."""
    task = types.SimpleNamespace(name="split-test")
    with ServerSet(5) as servers, Redlock(servers.urls, request_timeout=1.0) as rl:
        key = lock_key(rl.key_prefix, "stuck")
        for server, who in zip(list(servers)[:4], ["dead-a", "dead-a", "dead-b", "dead-b"], strict=True):
            assert server.client().set(key, _marker(task, who), px=60_000)
        start = time.monotonic()
        with pytest.raises(LockNotAcquired) as refused:
            enqueue._place(task, rl, "stuck", _marker(task, "new"), 30.0)
        waited = time.monotonic() - start
        assert enqueue.PUBLISH_WINDOW <= waited < enqueue.PUBLISH_WINDOW + 2.0, waited
        assert len(refused.value.votes) == 5 and refused.value.attempts > enqueue.PLACE_ATTEMPTS
