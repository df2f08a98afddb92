"""The heartbeat's mutex taken directly and the inlined push and thread start, under
many threads, a fork in the middle of keep(), and stop() followed by keep(); three real masters.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import pytest

from celery_redlock import Lock, Redlock
from celery_redlock.lock.heartbeat import Heartbeat, process_heartbeat
from celery_redlock.testing import ServerSet
from tests.core.conftest import take

from .conftest import outlives


@pytest.mark.timeout(90)
def test_many_threads_keep_and_forget_while_locks_are_extended_and_lost(
    masters46: ServerSet, rl46: Redlock, beat46: Heartbeat
) -> None:
    """Eight threads churn keep()/forget() on one heartbeat for 3 s; meanwhile four 0.5 s locks
    must stay owned throughout (six TTLs), and six victims whose keys are deleted on every master
    are each reported lost exactly once."""
    stop = threading.Event()
    errors: list[BaseException] = []
    churned = [0]

    def churn(n: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                lock = rl46.lock(f"churn-{n}-{i % 5}", ttl=0.5)
                if take(lock):
                    beat46.keep(lock, interval=0.1 if i % 2 else None, on_lost=lambda _l, _r: None)
                    if i % 3 == 0:
                        beat46.keep(lock)  # kept again: the old entry is replaced
                    beat46.forget(lock)
                    lock.release()
                    churned[0] += 1
                i += 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    steady = [rl46.lock(f"steady-{n}", ttl=0.5) for n in range(4)]
    victims = [rl46.lock(f"victim-{n}", ttl=0.5) for n in range(6)]
    lost: dict[str, list[str]] = {v.name: [] for v in victims}
    all_lost = threading.Event()

    def on_lost(lock: Lock, reason: str) -> None:
        lost[lock.name].append(reason)
        if all(lost.values()):
            all_lost.set()

    for lock in steady + victims:
        assert take(lock)
    for lock in steady:
        beat46.keep(lock)
    for lock in victims:
        beat46.keep(lock, on_lost=on_lost)
    threads = [threading.Thread(target=churn, args=(n,), daemon=True) for n in range(8)]
    for thread in threads:
        thread.start()
    try:
        started = time.monotonic()
        deleted = False
        while time.monotonic() - started < 3.0:
            for lock in steady:
                assert lock.owned(), f"{lock.name} not kept under churn"
            if not deleted and time.monotonic() - started > 0.7:
                for server in masters46:
                    server.client().delete(*(v.key for v in victims))
                deleted = True
            time.sleep(0.02)
        assert all_lost.wait(5.0), {k: len(v) for k, v in lost.items()}
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert not errors, errors
    assert churned[0] > 50
    time.sleep(0.6)  # more than an interval: a second report would have come by now
    assert {k: len(v) for k, v in lost.items()} == {v.name: 1 for v in victims}
    for lock in steady:
        assert lock.owned()
        beat46.forget(lock)
        assert lock.release()
    assert beat46.kept() == []


def _child_keeps(rl: Redlock, write: int) -> None:
    """In the forked child: keep a fresh 0.4 s lock with this process's heartbeat and see it
    owned for four TTLs; write the outcome and leave with os._exit."""
    code = 1
    try:
        beat = process_heartbeat()
        assert beat.kept() == [], "the child inherited the parent's kept locks"
        lock = rl.lock(f"child-{os.getpid()}", ttl=0.4)
        assert take(lock)
        beat.keep(lock, interval=0.1)
        outlives(lock, seconds=1.6, what="the child's lock was not extended")
        beat.forget(lock)
        assert lock.release()
        os.write(write, b"ok")
        code = 0
    except BaseException as exc:
        os.write(write, repr(exc).encode()[:500])
    finally:
        os._exit(code)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("own", [False, True], ids=["process-heartbeat", "own-heartbeat"])
def test_a_child_forked_while_another_thread_keeps_has_a_working_heartbeat(
    rl46: Redlock, beat46: Heartbeat, own: bool
) -> None:
    beat = beat46 if own else process_heartbeat()
    stop = threading.Event()
    in_keep = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            lock = rl46.lock(f"fork-churn-{i % 3}", ttl=0.5)
            if take(lock):
                beat.keep(lock)
                in_keep.set()
                beat.forget(lock)
                lock.release()
            i += 1

    parent_lock = rl46.lock("fork-parent", ttl=0.5)
    assert take(parent_lock)
    beat.keep(parent_lock)
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    outcomes = []
    try:
        assert in_keep.wait(10)
        for _ in range(3):  # a few forks, at different points of the churn
            read, write = os.pipe()
            child = os.fork()
            if child == 0:
                os.close(read)
                if own:  # the child's copy of this heartbeat starts empty, and must work too
                    beat46.stop(0)  # no thread in the child: returns at once
                _child_keeps(rl46, write)
            os.close(write)
            ready, _, _ = select.select([read], [], [], 20)
            got = os.read(read, 600) if ready else b"timeout"
            os.close(read)
            if not ready:
                os.kill(child, signal.SIGKILL)
            _, status = os.waitpid(child, 0)
            outcomes.append((got, os.waitstatus_to_exitcode(status)))
            assert parent_lock.owned()
    finally:
        stop.set()
        thread.join(10)
        beat.forget(parent_lock)
        parent_lock.release()
    assert outcomes == [(b"ok", 0)] * 3


@pytest.mark.timeout(60)
def test_keep_after_stop_starts_a_thread_that_extends(rl46: Redlock, beat46: Heartbeat) -> None:
    """stop(), then keep(): a new thread, which keeps the lock for several TTLs; three times."""
    for round_ in range(3):
        lock = rl46.lock(f"restart-{round_}", ttl=0.4)
        assert take(lock)
        beat46.keep(lock)
        first = beat46._thread
        beat46.stop()
        assert first is not None and not first.is_alive()
        beat46.keep(lock)  # kept again after the stop
        assert beat46._thread is not first and beat46._thread is not None
        outlives(lock, seconds=1.4, what=f"round {round_}: not extended after stop() and keep()")
        beat46.forget(lock)
        assert lock.release()
