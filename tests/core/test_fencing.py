"""Fencing tokens from the quorum (issue 17), on real masters.

Invariants attacked here:
- every fenced grant of a name has a fence strictly above every earlier grant's: in sequence,
  between contending clients in threads and processes (checked in real time: a grant that
  returned before another began has the smaller fence), and across masters emptied (a minority,
  or all of them: the clock floor) between grants;
- the write-back is the grant's own: a write-back with another token writes nothing, a counter is
  never lowered, and a refused first round writes no counter;
- ``lock.fence`` is None before a grant, after a release and in a forked child, kept after the
  lock is lost; an unfenced lock raises NotFenced; an extension keeps the fence;
- a fenced grant is two rounds, an unfenced one still one command per master.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from typing import Any

import pytest

from celery_redlock import ConfigError, NotFenced, Redlock
from celery_redlock.lock import scripts
from celery_redlock.lock.fencing import COUNTER_SUFFIX, FencedLock
from celery_redlock.testing import ServerSet

from .conftest import take

pytestmark = pytest.mark.timeout(90)


def counters(masters: ServerSet, name: str) -> list[int | None]:
    found = []
    for server in masters:
        client = server.client()
        try:
            value = client.get(f"redlock:{name}{COUNTER_SUFFIX}")
        finally:
            client.close()
        found.append(None if value is None else int(value))
    return found


def test_fences_increase_grant_after_grant(rl: Redlock, masters: ServerSet) -> None:
    fences = []
    for _ in range(20):
        lock = rl.lock("seq", ttl=5, fenced=True)
        assert lock.fence is None
        assert take(lock), lock.last_error
        assert isinstance(lock.fence, int)
        fences.append(lock.fence)
        lock.release()
        assert lock.fence is None
    assert fences == sorted(set(fences))
    # Each fence is recorded on every master (a quorum at least), never above the last.
    assert all(c == fences[-1] for c in counters(masters, "seq"))


def test_unfenced_and_options(rl: Redlock) -> None:
    lock = rl.lock("plain", ttl=5)
    assert not lock.fenced
    with pytest.raises(NotFenced, match="fenced=True"):
        _ = lock.fence
    with pytest.raises(ConfigError, match="fenced"):
        rl.lock("x", fenced=1)  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="combined"):
        rl.lock("x", fenced=True, reentrant=True)  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="combined"):
        rl.lock("x", fenced=True, fair=True)
    assert isinstance(rl.lock("x", fenced=True), FencedLock)


def _contend(urls: list[str], name: str, seconds: float, ready: Any, go: Any, out: Any) -> None:
    """One contending process: connected first (a warm-up lock), then told to go with the
    others, then ``seconds`` of non-blocking fenced acquires, each recorded."""
    records = []
    with Redlock(urls, retry_count=0, request_timeout=0.2) as own:
        warm = own.lock(f"{name}-warm-{os.getpid()}", ttl=2)
        if warm.acquire(timeout=10):
            warm.release()
        ready.put(os.getpid())
        go.wait(60)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            lock = own.lock(name, ttl=2, fenced=True)
            invoked = time.monotonic()
            if lock.acquire(blocking=False):
                records.append((invoked, time.monotonic(), lock.fence))
                lock.release()
    out.put(records)


def real_time_violations(records: list[tuple[float, float, int]]) -> list[tuple[object, object]]:
    """Pairs (A, B) where A's acquire returned before B's began, yet F_A >= F_B; plus any
    fence given twice."""
    bad: list[tuple[object, object]] = []
    fences = [r[2] for r in records]
    if len(set(fences)) != len(fences):
        bad.append(("duplicate fences", sorted(f for f in fences if fences.count(f) > 1)))
    by_invoked = sorted(records)
    by_acquired = sorted(records, key=lambda r: r[1])
    best: tuple[float, float, int] | None = None
    j = 0
    for b in by_invoked:
        while j < len(by_acquired) and by_acquired[j][1] < b[0]:
            if best is None or by_acquired[j][2] > best[2]:
                best = by_acquired[j]
            j += 1
        if best is not None and best[2] >= b[2]:
            bad.append((best, b))
    return bad


@pytest.mark.timeout(120)
def test_contending_processes_get_fences_in_real_time_order(masters: ServerSet) -> None:
    # Spawned, not forked: a child forked from this test process (an xdist worker with threads
    # of its own and of earlier tests) inherits any lock one of those threads held at the fork,
    # a stream's included, and hangs on it. What is checked here is the order of fences across
    # processes; the library's own fork handling has tests of its own (test_fork.py).
    context = multiprocessing.get_context("spawn")
    ready, go, out = context.Queue(), context.Event(), context.Queue()
    children = [
        context.Process(target=_contend, args=(masters.urls, "contended", 3.0, ready, go, out), daemon=True)
        for _ in range(3)
    ]
    for child in children:
        child.start()
    try:
        for _ in children:
            ready.get(timeout=60)  # each connected: they contend from the same moment
        go.set()
        records = [record for _ in children for record in out.get(timeout=30)]
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    assert len(records) > 30, len(records)
    assert real_time_violations(records) == []


def test_the_checker_finds_a_fence_out_of_real_time_order() -> None:
    # The check above must be able to fail: A returned (t=2) before B began (t=3), F_A > F_B.
    assert real_time_violations([(1.0, 2.0, 10), (3.0, 4.0, 9)])
    assert real_time_violations([(1.0, 2.0, 10), (3.0, 4.0, 10)])
    assert not real_time_violations([(1.0, 3.5, 10), (3.0, 4.0, 9)])  # overlapping calls: unordered


def test_fences_survive_emptied_masters(rl: Redlock, masters: ServerSet) -> None:
    lock = rl.lock("emptied", ttl=5, fenced=True)
    assert take(lock)
    last = lock.fence
    lock.release()
    for server in list(masters)[:2]:  # a minority restarted without data
        server.flushall()
    assert take(lock)
    assert lock.fence is not None and last is not None and lock.fence > last
    last = lock.fence
    lock.release()
    for server in masters:  # every master: only the clock floor is left
        server.flushall()
    assert take(lock)
    assert lock.fence > last  # the floor, microseconds of a clock that moved on
    lock.release()


def test_write_back_is_the_grants_own_and_never_lowers_a_counter(masters: ServerSet) -> None:
    client = masters[0].client()
    try:
        key, counter = "redlock:wb", "redlock:wb" + COUNTER_SUFFIX
        assert client.eval(scripts.FENCED_ACQUIRE.source, 2, key, counter, "tokA", 5000) > 0
        # Refused: the key exists; nothing written.
        refused = client.eval(scripts.FENCED_ACQUIRE.source, 2, key, counter, "tokB", 5000)
        assert -5001 <= refused <= -1  # -1 - the holder's PTTL
        assert client.get(counter) is None
        # Another token's write-back writes nothing.
        assert client.eval(scripts.FENCE_WRITE_BACK.source, 2, key, counter, "tokB", "100", 60000) == 0
        assert client.get(counter) is None
        assert client.eval(scripts.FENCE_WRITE_BACK.source, 2, key, counter, "tokA", "100", 60000) == 1
        assert client.eval(scripts.FENCE_WRITE_BACK.source, 2, key, counter, "tokA", "50", 60000) == 1
        assert client.get(counter) == b"100"  # never lowered
        assert 0 < client.pttl(counter) <= 60000
        # A counter above the clock floor wins the next grant's reading.
        client.set(counter, str(2**52))
        client.delete(key)
        assert client.eval(scripts.FENCED_ACQUIRE.source, 2, key, counter, "tokC", 5000) == 2**52
    finally:
        client.close()


def test_fence_is_kept_when_lost_and_none_in_a_forked_child(rl: Redlock, masters: ServerSet) -> None:
    lock = rl.lock("kept", ttl=0.5, fenced=True)
    assert take(lock)
    fence = lock.fence
    assert lock.extend()
    assert lock.fence == fence  # an extension is the same interval: the same fence
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, b"none" if lock.fence is None else b"some")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 4) == b"none"
    deadline = time.monotonic() + 5
    while lock.owned() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not lock.owned()
    assert lock.fence == fence  # lost: judging it is the resource's job
    other = rl.lock("kept", ttl=5, fenced=True)
    # Not owned is earlier than expired on the masters (validity keeps the drift allowance
    # back): the next holder waits for the keys to go, as any contender would.
    assert other.acquire(timeout=5), other.last_error
    assert other.fence is not None and fence is not None and other.fence > fence
    other.release()


def test_fenced_grant_is_two_rounds_unfenced_one(masters: ServerSet, transport: str) -> None:
    # The commands are counted, not timed: a whole second per round, so that a loaded host's
    # slow first connect cannot turn the single attempts below into retries (or failures).
    rl = Redlock(masters.urls, retry_count=0, request_timeout=1.0, transport=transport)
    warm = rl.lock("rounds0", ttl=5, fenced=True)  # the links are up, the scripts cached
    assert warm.acquire(timeout=10), warm.last_error
    warm.release()
    for server in masters:
        server.client().config_resetstat()
    plain = rl.lock("rounds", ttl=5)
    assert plain.acquire(blocking=False)
    plain.release()
    fenced = rl.lock("rounds2", ttl=5, fenced=True)
    assert fenced.acquire(blocking=False)
    for server in masters:
        stats = server.client().info("commandstats")
        # plain: one SET and the release script; fenced: the acquire and the write-back. Every
        # script by digest, none by source (the masters have them all: no NOSCRIPT).
        assert "cmdstat_eval" not in stats, stats["cmdstat_eval"]
        assert stats["cmdstat_evalsha"]["calls"] == 3, stats["cmdstat_evalsha"]
    fenced.release()
    rl.close()


def test_threads_sharing_one_redlock_get_distinct_increasing_fences(rl: Redlock) -> None:
    records: list[tuple[float, float, int]] = []
    mutex = threading.Lock()
    until = time.monotonic() + 2

    def run() -> None:
        while time.monotonic() < until:
            lock = rl.lock("threads", ttl=2, fenced=True)
            invoked = time.monotonic()
            if lock.acquire(blocking=False):
                with mutex:
                    records.append((invoked, time.monotonic(), lock.fence))  # type: ignore[arg-type]
                lock.release()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(records) > 20
    assert real_time_violations(records) == []


def test_a_fenced_waiter_wakes_when_an_abandoned_lock_expires(masters: ServerSet) -> None:
    """Refusals carry the holder's PTTL, so a waiter wakes at the expiry, not a poll later."""
    with Redlock(masters.urls, retry_delay=10, wait_poll=8) as own, Redlock(masters.urls) as other:
        abandoned = other.lock("abandoned", ttl=1.0, fenced=True)
        assert take(abandoned)  # never released: it must expire
        started = time.monotonic()
        waiter = own.lock("abandoned", ttl=5, fenced=True)
        assert waiter.acquire(timeout=6)
        assert time.monotonic() - started < 1.0 + 0.5
        assert waiter.fence is not None and abandoned.fence is not None
        assert waiter.fence > abandoned.fence
        waiter.release()


def test_a_master_without_the_scripts_is_sent_their_source(rl: Redlock, masters: ServerSet) -> None:
    """Fenced rounds send the scripts by digest; a master that lost them (SCRIPT FLUSH, a
    restart) answers NOSCRIPT, runs nothing, and gets the source: the grant is as usual."""
    lock = rl.lock("flushed", ttl=5, fenced=True)
    assert take(lock)
    first = lock.fence
    lock.release()
    for server in list(masters)[:3]:  # a quorum without the scripts
        server.client().script_flush()
    assert lock.acquire(blocking=False), lock.last_error
    assert all(vote.kind == "yes" for vote in lock.last_votes)
    assert lock.fence is not None and first is not None and lock.fence > first
    lock.release()
