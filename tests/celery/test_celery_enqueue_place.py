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
