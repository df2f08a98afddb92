"""Review 29: mutual exclusion under generated interleavings, asyncio and threads together.

Invariant: at no instant do two holders believe they own one name. Several AsyncRedlocks (each
its own connections) and a threaded ``Redlock`` in a thread of its own contend for one name
with short TTLs; hypothesis draws each async actor's program of acquires (blocking, waiting,
cancelled at a drawn loop iteration), extends (shorter and longer TTLs), releases (some
cancelled) and pauses. A monitor task samples ``owned()`` of every async lock at every loop
turn (at most one may be True), and the thread records its windows ``[granted, min(release,
granted + validity))`` on the same clock (``celery_redlock.lock.clock.now``): no sample of an
owned async lock may fall inside one. Real masters, no mocks, no patched clock.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_redlock import AsyncRedlock, Redlock
from celery_redlock.lock.clock import now
from celery_redlock.testing import ServerSet
from tests.asyncio.conftest import run

NAME = "review29:safety"

KIND = st.sampled_from([{}, {"fenced": True}, {"fair": True}, {"keepalive": True}])
ACQUIRE = st.tuples(st.just("acquire"), st.sampled_from([0.0, 0.1, 0.5, 1.0]))
OP = st.one_of(
    ACQUIRE,
    ACQUIRE,
    ACQUIRE,
    st.tuples(st.just("cancel_acquire"), st.integers(0, 12)),
    st.tuples(st.just("extend"), st.sampled_from([0.25, 0.6, 1.2])),
    st.tuples(st.just("release"), st.just(0)),
    st.tuples(st.just("cancel_release"), st.integers(0, 3)),
    st.tuples(st.just("pause"), st.sampled_from([0.0, 0.02, 0.15, 0.4])),
)
PROGRAM = st.lists(OP, min_size=4, max_size=12)
ACTORS = st.lists(st.tuples(st.integers(0, 2), KIND, PROGRAM), min_size=2, max_size=5)


class Violation(AssertionError):
    pass


def _thread_holder(urls: list[str], stop: threading.Event, windows: list[tuple[float, float]]) -> None:
    rl = Redlock(urls, ttl=0.4, request_timeout=0.05)
    try:
        lock = rl.lock(NAME)
        while not stop.is_set():
            if lock.acquire(timeout=0.2):
                granted = now()
                until = granted + lock.validity
                stop.wait(0.03)
                end = now()
                lock.release()
                windows.append((granted, min(end, until)))
            stop.wait(0.05)  # room for the async actors
    finally:
        rl.close()


async def _actor(
    rl: AsyncRedlock, kind: dict[str, Any], program: list[tuple[str, float]], locks: list[Any]
) -> None:
    lock = rl.lock(NAME, 0.4, **kind)
    locks.append(lock)
    for op, arg in program:
        if op == "acquire":
            if lock.owned():
                continue
            if arg == 0.0:
                await lock.acquire(blocking=False)
            else:
                await lock.acquire(timeout=arg)
        elif op == "cancel_acquire":
            if lock.owned():
                continue
            task = asyncio.create_task(lock.acquire(timeout=0.3))
            for _ in range(int(arg)):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif op == "extend":
            await lock.extend(arg)
        elif op == "release":
            await lock.release()
        elif op == "cancel_release":
            task = asyncio.create_task(lock.release())
            for _ in range(int(arg)):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:
            await asyncio.sleep(arg)
    await lock.release()


async def _scenario(
    urls: list[str], actors: list[tuple[int, dict[str, Any], list[tuple[str, float]]]]
) -> list[float]:
    """Run the actors; the instants at which some async lock was owned (checked against the
    thread's windows afterwards)."""
    clients = [AsyncRedlock(urls, ttl=0.4, request_timeout=0.05, wait_poll=0.2) for _ in range(3)]
    locks: list[Any] = []
    samples: list[float] = []
    done = asyncio.Event()

    async def monitor() -> None:
        while not done.is_set():
            t = now()
            owned = [lk for lk in locks if lk.owned()]
            if len(owned) > 1:
                raise Violation(f"{len(owned)} async locks owned at once: {owned}")
            if owned:
                samples.append(t)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(monitor())
    try:
        await asyncio.wait_for(
            asyncio.gather(*(_actor(clients[c], kind, program, locks) for c, kind, program in actors)), 30.0
        )
    finally:
        done.set()
        await watcher  # raises the Violation, if any
        for client in clients:
            await client.aclose()
    return samples


@pytest.mark.timeout(300)
@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(actors=ACTORS)
def test_async_and_threaded_holders_never_overlap(masters: ServerSet, actors: list[Any]) -> None:
    masters.ensure_running()
    stop = threading.Event()
    windows: list[tuple[float, float]] = []
    thread = threading.Thread(target=_thread_holder, args=(masters.urls, stop, windows), daemon=True)
    thread.start()
    try:
        samples = run(_scenario(masters.urls, actors))
    finally:
        stop.set()
        thread.join(10.0)
    assert not thread.is_alive()
    print(f"REVIEW29 samples={len(samples)} windows={len(windows)}")
    for t in samples:
        for start, end in windows:
            assert not (start < t < end), f"an async lock owned at {t} inside a thread hold {start}..{end}"
