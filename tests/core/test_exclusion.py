"""Mutual exclusion under load: threads and forked processes contend for one resource.

Each hold is recorded as (start, end of the window it may act in) on the machine-wide monotonic
clock, and each does a read-modify-write on a counter kept on a server that is not a master: an
overlap or a lost update means two holders acted at once.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import Hold, RedisServer, ServerSet, find_overlaps

from .conftest import take

DURATION = 4.0
THREADS_IN_PARENT = 8
PROCESSES = 4
THREADS_PER_PROCESS = 2
TTL = 1.0
RESOURCE = "contended"


def contend(rl: Redlock, client: str, register_url: str, until: float, out: list[Hold]) -> None:
    import redis

    register = redis.Redis.from_url(register_url, socket_timeout=2)
    lock = rl.lock(RESOURCE, ttl=TTL)
    while time.monotonic() < until:
        if not lock.acquire(blocking=True, timeout=0.5):
            continue
        start = time.monotonic()
        valid_until = start + lock.validity
        value = int(register.get("counter") or 0)
        register.set("counter", value + 1)
        end = time.monotonic()
        lock.release()
        # The window it may act in ends at the earlier of the release and the end of validity.
        out.append(Hold(RESOURCE, start, min(end, valid_until), owner=client))
    register.close()


def run_threads(rl: Redlock, prefix: str, count: int, register_url: str, until: float) -> list[Hold]:
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


def child_main(
    rl: Redlock, index: int, register_url: str, until: float, queue: multiprocessing.Queue
) -> None:  # type: ignore[type-arg]
    holds = run_threads(rl, f"p{index}", THREADS_PER_PROCESS, register_url, until)
    queue.put(holds)


@pytest.mark.timeout(60)
def test_threads_and_forked_processes_never_overlap(masters: ServerSet) -> None:
    with RedisServer() as register_server:
        register_url = register_server.url
        # One Redlock, used before the fork and inherited by the children: they must make
        # connections of their own rather than talk on the parent's sockets.
        rl = Redlock(masters.urls, retry_delay=0.01)
        warm = rl.lock(RESOURCE, ttl=TTL)
        assert take(warm)
        warm.release()

        until = time.monotonic() + DURATION
        ctx = multiprocessing.get_context("fork")
        queue: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
        children = [
            ctx.Process(target=child_main, args=(rl, i, register_url, until, queue)) for i in range(PROCESSES)
        ]
        for child in children:
            child.start()
        holds = run_threads(rl, "parent", THREADS_IN_PARENT, register_url, until)
        for _ in children:
            holds += queue.get(timeout=DURATION + 20)
        for child in children:
            child.join(10)
            assert child.exitcode == 0
        rl.close()

        clients = {h.owner.split("-")[0] for h in holds}
        assert clients == {"parent", *(f"p{i}" for i in range(PROCESSES))}, clients
        assert len(holds) > 50, f"only {len(holds)} holds in {DURATION}s"
        assert find_overlaps(holds) == []
        counter = int(register_server.client().get("counter") or 0)
        assert counter == len(holds), f"{len(holds)} holds but the counter says {counter}"
        print(f"\n{len(holds)} holds by {len({h.owner for h in holds})} clients, no overlap")
