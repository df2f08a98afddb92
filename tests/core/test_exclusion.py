"""Mutual exclusion under load: threads and forked processes contend for one resource.

Each hold is recorded as (start, end of the window it may act in) on the machine-wide monotonic
clock, and each does a read-modify-write on a counter kept on a server that is not a master: an
overlap or a lost update means two holders acted at once.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from dataclasses import dataclass

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import RedisServer, ServerSet

DURATION = 4.0
THREADS_IN_PARENT = 8
PROCESSES = 4
THREADS_PER_PROCESS = 2
TTL = 1.0


@dataclass(frozen=True)
class Hold:
    client: str
    start: float
    end: float  # the earlier of the release and the end of validity


def contend(rl: Redlock, client: str, register_url: str, until: float, out: list[Hold]) -> None:
    import redis

    register = redis.Redis.from_url(register_url, socket_timeout=2)
    lock = rl.lock("contended", ttl=TTL)
    while time.monotonic() < until:
        if not lock.acquire(blocking=True, timeout=0.5):
            continue
        start = time.monotonic()
        valid_until = start + lock.validity
        value = int(register.get("counter") or 0)
        register.set("counter", value + 1)
        end = time.monotonic()
        lock.release()
        out.append(Hold(client, start, min(end, valid_until)))
    register.close()


def run_threads(rl: Redlock, prefix: str, count: int, register_url: str, until: float
                ) -> list[Hold]:
    holds: list[Hold] = []
    threads = [
        threading.Thread(target=contend, args=(rl, f"{prefix}-t{i}", register_url, until, holds))
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DURATION + 10)
    return holds


def child_main(rl: Redlock, index: int, register_url: str, until: float,
               queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    holds = run_threads(rl, f"p{index}", THREADS_PER_PROCESS, register_url, until)
    queue.put([(h.client, h.start, h.end) for h in holds])


def overlaps(holds: list[Hold]) -> list[tuple[Hold, Hold]]:
    found = []
    ordered = sorted(holds, key=lambda h: h.start)
    latest = ordered[0]
    for hold in ordered[1:]:
        if hold.start < latest.end:
            found.append((latest, hold))
        if hold.end > latest.end:
            latest = hold
    return found


@pytest.mark.timeout(60)
def test_threads_and_forked_processes_never_overlap(masters: ServerSet) -> None:
    with RedisServer() as register_server:
        register_url = register_server.url
        # One Redlock, used before the fork and inherited by the children: they must make
        # connections of their own rather than talk on the parent's sockets.
        rl = Redlock(masters.urls, retry_delay=0.01)
        warm = rl.lock("contended", ttl=TTL)
        assert warm.acquire(blocking=False)
        warm.release()

        until = time.monotonic() + DURATION
        ctx = multiprocessing.get_context("fork")
        queue: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
        children = [
            ctx.Process(target=child_main, args=(rl, i, register_url, until, queue))
            for i in range(PROCESSES)
        ]
        for child in children:
            child.start()
        holds = run_threads(rl, "parent", THREADS_IN_PARENT, register_url, until)
        for _ in children:
            holds += [Hold(*h) for h in queue.get(timeout=DURATION + 20)]
        for child in children:
            child.join(10)
            assert child.exitcode == 0
        rl.close()

        clients = {h.client.split("-")[0] for h in holds}
        assert clients == {"parent", *(f"p{i}" for i in range(PROCESSES))}, clients
        assert len(holds) > 50, f"only {len(holds)} holds in {DURATION}s"
        assert overlaps(holds) == []
        counter = int(register_server.client().get("counter") or 0)
        assert counter == len(holds), f"{len(holds)} holds but the counter says {counter}"
        print(f"\n{len(holds)} holds by {len({h.client for h in holds})} clients, no overlap")


def test_the_overlap_check_sees_an_overlap() -> None:
    """The checker is not blind: two windows that intersect are reported."""
    holds = [Hold("a", 0.0, 1.0), Hold("b", 1.0, 2.0), Hold("c", 1.5, 1.6), Hold("d", 3, 4)]
    assert overlaps(holds) == [(holds[1], holds[2])]
