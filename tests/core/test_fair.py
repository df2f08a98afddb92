"""Fair locks (issue 16, part 3), on real masters.

Invariants attacked here:
- arrival order: a waiter whose place was acknowledged by every master before the next waiter
  arrived is granted before it, whether the waiters are threads or processes;
- only the head is woken: each grant after a release costs the woken waiter one attempt, so a
  queue of n waiters costs n attempts beyond their arrivals, not a herd's n * n;
- a dead waiter (SIGKILLed) holds the queue up for at most its entry's TTL plus a fallback poll;
- a waiter paused past its entry's TTL has lost its place and queues again at the back;
- a waiter that gives up leaves no entry behind; a released lock leaves no key at all;
- when the masters disagree (one restarted empty under a full queue), exclusion holds and every
  waiter is still granted;
- the kinds do not mix silently: fair or plain against a reentrant holder raise LockKindMismatch.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_redlock import ConfigError, LockKindMismatch, Redlock
from celery_redlock.errors import Vote
from celery_redlock.lock.fair import Entry, FairLock
from celery_redlock.testing import ServerSet

from .conftest import keys_on, take, wait_for

pytestmark = pytest.mark.timeout(90)

QUEUE = "redlock:{}~queue"


@pytest.fixture
def rl(masters: ServerSet) -> Iterator[Redlock]:
    with Redlock(masters.urls, wait_poll=0.5, request_timeout=0.2) as instance:
        yield instance


def queued(masters: ServerSet, name: str) -> list[int]:
    """How many entries each running master queues for ``name``."""
    counts = []
    for server in masters:
        if server.running and not server.paused:
            client = server.client()
            try:
                counts.append(client.zcard(QUEUE.format(name)))
            finally:
                client.close()
    return counts


def await_queued(masters: ServerSet, name: str, n: int, timeout: float = 10) -> None:
    assert wait_for(lambda: set(queued(masters, name)) == {n}, timeout), queued(masters, name)


def await_placed(masters: ServerSet, name: str, n: int, timeout: float = 10) -> None:
    """Until ``n`` entries are queued on a quorum of the masters, and on none more than ``n``: the
    arrival order's guarantee counts a quorum's acknowledgement. (A join that timed out on one
    master of a loaded machine is made again on the waiter's next attempt, which under a long
    ``wait_poll`` is its wake, so waiting for every master would wait on that.)"""

    def placed() -> bool:
        counts = queued(masters, name)
        return max(counts) <= n and sum(c == n for c in counts) >= len(masters) // 2 + 1

    assert wait_for(placed, timeout), queued(masters, name)


class Holds:
    """Who held the resource, in grant order; fails a test on any overlap."""

    def __init__(self) -> None:
        self.order: list[object] = []
        self.attempts: dict[object, int] = {}
        # Attempts begun after the holder's release was called, by waiter (see CountedFairLock).
        self.released_at = float("inf")
        self.after_release: dict[object, int] = {}
        self.granted_at: dict[object, float] = {}
        self.overlaps = 0
        self._inside = 0
        self._mutex = threading.Lock()

    def hold(self, who: object, lock: FairLock, seconds: float = 0.02) -> None:
        with self._mutex:
            self._inside += 1
            if self._inside > 1:
                self.overlaps += 1
            self.order.append(who)
            self.attempts[who] = lock.last_attempts
            if isinstance(lock, CountedFairLock):
                self.after_release[who] = sum(t >= self.released_at for t in lock.begun)
            self.granted_at[who] = time.monotonic()
        time.sleep(seconds)
        with self._mutex:
            self._inside -= 1
        lock.release()


class CountedFairLock(FairLock):
    """A fair lock that notes when each of its attempts began: the real attempt, only counted,
    so that a test can tell the attempts a release caused from those of a slow arrival."""

    def __init__(self, redlock: Redlock, name: str, ttl: float) -> None:
        super().__init__(redlock, name, ttl)
        self.begun: list[float] = []

    def _attempt(
        self, token: str, waiting: bool, expiry: list[float], entry: Entry | None
    ) -> tuple[float, list[Vote], float]:
        self.begun.append(time.monotonic())
        return super()._attempt(token, waiting, expiry, entry)


def start_waiter(
    urls: list[str], name: str, holds: Holds, who: object, timeout: float = 30, wait_poll: float = 0.5
) -> threading.Thread:
    def run() -> None:
        with Redlock(urls, wait_poll=wait_poll, request_timeout=0.2) as own:
            lock = CountedFairLock(own, name, ttl=10)
            if lock.acquire(timeout=timeout):
                holds.hold(who, lock)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_uncontended_fair_acquire_is_one_command_per_master(masters: ServerSet, rl: Redlock) -> None:
    for server in masters:
        server.client().config_resetstat()
    lock = rl.lock("free", ttl=5, fair=True)
    assert take(lock)
    assert lock.last_attempts == 1
    # One script per master, nothing before or after it. A quorum answered it; a master whose
    # link was not ready within the round (a loaded one) may have had none, never two.
    calls = [
        server.client().info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0) for server in masters
    ]
    assert all(count <= 1 for count in calls) and calls.count(1) >= len(masters) // 2 + 1, calls
    lock.release()
    assert wait_for(lambda: not any(keys_on(masters).values()), 5), keys_on(masters)


@pytest.mark.parametrize("waiters", [5, 10])
def test_threads_are_granted_in_arrival_order_one_wake_each(
    masters: ServerSet, rl: Redlock, waiters: int, transport: str
) -> None:
    # Held until the last waiter is placed, however long a loaded machine takes to place them.
    holder = rl.lock("order", ttl=60, fair=True)
    assert take(holder)
    holds = Holds()
    threads = []
    for i in range(waiters):
        # A fallback poll far longer than the test: every attempt after arrival is a wake.
        threads.append(start_waiter(masters.urls, "order", holds, i, wait_poll=10))
        await_placed(masters, "order", i + 1)  # acknowledged by a quorum before the next arrives
    assert holder.owned() and holds.order == [], holds.order
    holds.released_at = time.monotonic()
    holder.release()
    for thread in threads:
        thread.join(30)
    assert holds.order == list(range(waiters))
    assert holds.overlaps == 0
    # Each grant costs its waiter one attempt after the holder's release: its wake. (Arrival
    # costs two or more before it, the probe and the join, more when a loaded host's masters
    # answer a probe late: those are not counted.) A release returns once a quorum has applied
    # it, and every master announces its own part, so a waiter woken by the first announcements
    # may try while fewer than a quorum have applied it yet: at most quorum - 1 such early tries.
    # A herd (every waiter woken by every release) would give the waiter at place i about i
    # extra tries, past this bound from the fourth place on. Counted over the fast transport
    # only: the reference one's wake path is not the subject here (order and exclusion hold
    # over both).
    if transport == "fast":
        early = rl.quorum - 1
        tries = holds.after_release
        assert len(tries) == waiters and all(1 <= n <= 1 + early for n in tries.values()), str(tries)
    assert wait_for(lambda: not any(keys_on(masters).values()), 5), keys_on(masters)


class MinorityJoinFairLock(FairLock):
    """A fair lock whose join reaches only a minority: after its probe (its first attempt, which
    gives it a ticket) ``stopped`` masters are paused (SIGSTOP) for the join, its second attempt,
    and continued once that has returned. An event, not a timing: the join is never acknowledged
    by a quorum."""

    def __init__(self, redlock: Redlock, name: str, ttl: float, stopped: list[object]) -> None:
        super().__init__(redlock, name, ttl)
        self.stopped = stopped
        self.calls = 0

    def _attempt(
        self, token: str, waiting: bool, expiry: list[float], entry: Entry | None
    ) -> tuple[float, list[Vote], float]:
        self.calls += 1
        try:
            return super()._attempt(token, waiting, expiry, entry)
        finally:
            if self.calls == 1:
                for server in self.stopped:
                    server.pause()  # type: ignore[attr-defined]
            elif self.calls == 2:
                for server in self.stopped:
                    server.resume()  # type: ignore[attr-defined]


@pytest.mark.parametrize("wait", ["release", "poll"])
def test_a_waiter_whose_join_a_majority_answered_late_takes_the_lock_soon_after_its_release(
    masters: ServerSet, rl: Redlock, wait: str
) -> None:
    """A waiter's join that timed out on a majority (they were stopped; they run it when they
    resume) leaves the waiter knowing its place on a minority only: too few of the masters it
    listens to can wake it. It must still try again soon, not at its wait_poll (60 s here, past
    this test): once the holder releases, it takes the lock within a few retry delays."""
    holder = rl.lock("minority-join", ttl=60, fair=True)
    assert take(holder)
    stopped = list(masters)[:3]
    got: list[float] = []
    with Redlock(masters.urls, wait_poll=60, request_timeout=0.2, wait=wait) as own:
        lock = MinorityJoinFairLock(own, "minority-join", 10, stopped)

        def wait_for_it() -> None:
            if lock.acquire(timeout=30):
                got.append(time.monotonic())
                lock.release()

        thread = threading.Thread(target=wait_for_it, daemon=True)
        thread.start()
        try:
            assert wait_for(lambda: lock.calls >= 2, 10), "the waiter never joined"

            # Its join reached the two running masters. A resumed master runs it on resuming if it
            # was written there; it may not have been (a link that had to be made anew to a
            # stopped master sends nothing before its handshake), and either way the waiter knows
            # its place on a minority only, which is this test's subject. All five answer again.
            def joined() -> bool:
                counts = queued(masters, "minority-join")
                return len(counts) == 5 and counts[3:] == [1, 1] and all(n <= 1 for n in counts)

            assert wait_for(joined, 10), queued(masters, "minority-join")
        finally:
            for server in stopped:
                server.resume()
            released = time.monotonic()
            holder.release()
            thread.join(30)
    assert got, "the waiter never took the lock after its release"
    assert got[0] - released < 5.0, f"took the lock {got[0] - released:.1f} s after its release"


# The waiter processes are spawned, not forked: a child forked from this test process (an xdist
# worker with threads of its own, the reference transport's lanes, earlier tests' threads)
# inherits any lock one of those threads held at the fork, a stream's included, and hangs on it.
# Each is started and has imported what it needs before it is told to go (a spawned child takes a
# while to come up, longer on a loaded host): it joins the queue when the test means it to. What
# is checked is fair order across processes; the library's fork handling is test_fork.py's.
SPAWN = multiprocessing.get_context("spawn")


def _spawn(
    target: Callable[..., None], *args: object
) -> tuple[multiprocessing.process.BaseProcess, Any, Any]:
    """``target(*args, ready, go)`` in a spawned process, and its two events: it sets ``ready``
    once it is up, and goes on when ``go`` is set."""
    ready, go = SPAWN.Event(), SPAWN.Event()
    child = SPAWN.Process(target=target, args=(*args, ready, go), daemon=True)
    child.start()
    return child, ready, go


def _process_waiter(
    urls: list[str], name: str, log: str, who: int, transport: str, ready: Any, go: Any
) -> None:
    with Redlock(urls, wait_poll=0.5, request_timeout=0.2, transport=transport) as own:
        lock = own.lock(name, ttl=10, fair=True)
        ready.set()
        go.wait(60)
        if lock.acquire(timeout=30):
            with open(log, "a") as out:
                out.write(f"{who}\n")
            time.sleep(0.02)
            lock.release()


def test_processes_are_granted_in_arrival_order(
    masters: ServerSet, rl: Redlock, tmp_path: object, transport: str
) -> None:
    log = os.path.join(str(tmp_path), "grants")
    started = [_spawn(_process_waiter, masters.urls, "procs", log, i, transport) for i in range(5)]
    children = [child for child, _, _ in started]
    assert all(ready.wait(60) for _, ready, _ in started), "a waiter process never came up"
    holder = rl.lock("procs", ttl=10, fair=True)
    assert take(holder)
    for i, (_, _, go) in enumerate(started):
        go.set()
        await_queued(masters, "procs", i + 1)
    holder.release()
    for child in children:
        child.join(30)
        assert child.exitcode == 0
    with open(log) as grants:
        assert [int(line) for line in grants] == list(range(5))


def _park(urls: list[str], name: str, transport: str, ready: Any, go: Any) -> None:
    """A waiter that queues and then waits until it is killed."""
    with Redlock(urls, wait_poll=0.5, request_timeout=0.2, transport=transport) as own:
        lock = own.lock(name, ttl=10, fair=True)
        ready.set()
        go.wait(60)
        lock.acquire(timeout=60)


def test_a_dead_head_holds_the_queue_up_at_most_its_entry_ttl(
    masters: ServerSet, rl: Redlock, transport: str
) -> None:
    head, ready, go = _spawn(_park, masters.urls, "dead", transport)
    assert ready.wait(60), "the waiter process never came up"
    holder = rl.lock("dead", ttl=10, fair=True)
    assert take(holder)
    go.set()
    await_queued(masters, "dead", 1)
    holds = Holds()
    behind = start_waiter(masters.urls, "dead", holds, "behind")
    await_queued(masters, "dead", 2)
    assert head.pid is not None
    os.kill(head.pid, signal.SIGKILL)
    head.join(5)
    released = time.monotonic()
    holder.release()
    behind.join(30)
    waited = time.monotonic() - released
    assert holds.order == ["behind"]
    entry_ttl = holder.entry_ttl  # type: ignore[attr-defined]
    # The dead entry expires entry_ttl after its last refresh (at most one fallback poll before
    # the kill); the waiter behind tries at least every wait_poll.
    assert waited < entry_ttl + 2 * rl.wait_poll + 1.0, waited


def _timed_waiter(urls: list[str], name: str, log: str, transport: str, ready: Any, go: Any) -> None:
    with Redlock(urls, wait_poll=0.5, request_timeout=0.2, transport=transport) as own:
        lock = own.lock(name, ttl=10, fair=True)
        ready.set()
        go.wait(60)
        if lock.acquire(timeout=60):
            with open(log, "w") as out:
                out.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: system-wide on Linux
            lock.release()


def test_a_waiter_paused_past_its_entry_ttl_queues_again_at_the_back(
    masters: ServerSet, rl: Redlock, tmp_path: object, transport: str
) -> None:
    log = os.path.join(str(tmp_path), "paused")
    first, ready, go = _spawn(_timed_waiter, masters.urls, "paused", log, transport)
    assert ready.wait(60), "the waiter process never came up"
    holder = rl.lock("paused", ttl=30, fair=True)
    assert take(holder)
    go.set()
    await_queued(masters, "paused", 1)
    assert first.pid is not None
    os.kill(first.pid, signal.SIGSTOP)
    try:
        holds = Holds()
        later = start_waiter(masters.urls, "paused", holds, "later")
        await_queued(masters, "paused", 2)
        # The paused entry expires; the later waiter's refreshes prune it on every master.
        entry_ttl = holder.entry_ttl  # type: ignore[attr-defined]
        assert wait_for(lambda: set(queued(masters, "paused")) == {1}, entry_ttl + 5), queued(
            masters, "paused"
        )
    finally:
        os.kill(first.pid, signal.SIGCONT)
    await_queued(masters, "paused", 2)  # the resumed waiter lost its place and queued again
    holder.release()
    later.join(30)
    first.join(30)
    assert first.exitcode == 0
    assert holds.order == ["later"]
    with open(log) as written:
        assert float(written.read()) > holds.granted_at["later"]


def test_a_waiter_that_gives_up_leaves_no_entry(masters: ServerSet, rl: Redlock) -> None:
    holder = rl.lock("leave", ttl=10, fair=True)
    assert take(holder)
    waiter = rl.lock("leave", ttl=10, fair=True)
    started = time.monotonic()
    assert not waiter.acquire(timeout=0.5)
    assert time.monotonic() - started < 0.5 + rl.request_timeout + 0.3
    assert wait_for(lambda: set(queued(masters, "leave")) == {0}, 5), queued(masters, "leave")
    assert not waiter.acquire(blocking=False)  # never queues
    assert set(queued(masters, "leave")) == {0}
    holder.release()
    assert wait_for(lambda: not any(keys_on(masters).values()), 5), keys_on(masters)


def test_a_master_restarted_empty_under_a_full_queue_keeps_exclusion(masters: ServerSet, rl: Redlock) -> None:
    holder = rl.lock("restart", ttl=10, fair=True)
    assert take(holder)
    holds = Holds()
    threads = []
    for i in range(5):
        threads.append(start_waiter(masters.urls, "restart", holds, i))
        await_queued(masters, "restart", i + 1)
    # One master forgets everything: the lock and the queue (a restart without persistence).
    masters[0].client().flushall()
    holder.release()
    for thread in threads:
        thread.join(30)
    assert holds.overlaps == 0
    assert sorted(holds.order) == list(range(5))  # every waiter granted
    inversions = sum(1 for i, a in enumerate(holds.order) for b in holds.order[i + 1 :] if a > b)  # type: ignore[operator]
    print(f"one master emptied under 5 queued waiters: order {holds.order}, {inversions} inversions")


def test_kinds_do_not_mix(rl: Redlock) -> None:
    reentrant = rl.lock("kind", ttl=10, reentrant=True)
    assert take(reentrant)
    with pytest.raises(LockKindMismatch, match="reentrant"):
        rl.lock("kind", ttl=10, fair=True).acquire(blocking=False)
    with pytest.raises(LockKindMismatch, match="reentrant"):
        rl.lock("kind", ttl=10).acquire(timeout=5)  # a plain waiter: its waiting attempts ask
    reentrant.release()
    fair = rl.lock("kind2", ttl=10, fair=True)
    assert take(fair)
    with pytest.raises(LockKindMismatch, match="plain"):
        rl.lock("kind2", ttl=10, reentrant=True).acquire(blocking=False)
    fair.release()


def test_fair_options_are_checked(rl: Redlock) -> None:
    with pytest.raises(ConfigError, match="reentrant"):
        rl.lock("x", fair=True, reentrant=True)  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="fair"):
        rl.lock("x", fair="yes")  # type: ignore[call-overload]
    assert isinstance(rl.lock("x", fair=True), FairLock)


def test_fair_timeout_none_waits_the_retry_budget(masters: ServerSet) -> None:
    with Redlock(masters.urls, retry_count=2, retry_delay=0.2) as own:
        holder = own.lock("budget", ttl=10, fair=True)
        assert take(holder)
        started = time.monotonic()
        assert not own.lock("budget", ttl=10, fair=True).acquire()
        waited = time.monotonic() - started
        assert 0.55 < waited < 0.6 + own.request_timeout + 0.3, waited
        holder.release()


def test_poll_mode_keeps_arrival_order_too(masters: ServerSet, rl: Redlock) -> None:
    """With ``wait="poll"`` a waiter's join follows its probe at once, as when woken by the
    release: waiters arriving 0.3 s apart are granted in arrival order, though each naps up to
    a whole second between later attempts (a nap between probe and join let later arrivals
    join first)."""
    holds = Holds()
    # Each waiter's client is connected (and its scripts loaded) before the arrivals start:
    # "arrival" is the call to acquire, so the spacing must not also hold five connects, which
    # under a loaded machine took longer than the spacing and let a later waiter join first.
    # Their request timeout is long (1 s, not 0.2 s): a join whose replies came late on a loaded
    # machine failed, and that waiter joined again after its nap, behind the later arrivals
    # (seen once beside a CPU hog: order [1, 2, 3, 4, 5, 0]). A join that waits for its replies
    # is placed in the order it was written in, which the spacing decides.
    clients = [Redlock(masters.urls, wait="poll", retry_delay=1.0, request_timeout=1.0) for _ in range(6)]
    for own in clients:
        warm = own.lock("poll-order-warm", ttl=5, fair=True)
        assert take(warm, within=10)
        warm.release()

    def run(who: int) -> None:
        lock = clients[who].lock("poll-order", ttl=10, fair=True)
        if lock.acquire(timeout=30):
            holds.hold(who, lock)

    holder = rl.lock("poll-order", ttl=10, fair=True)
    assert take(holder)
    threads = []
    try:
        for who in range(6):
            threads.append(threading.Thread(target=run, args=(who,), daemon=True))
            threads[-1].start()
            time.sleep(0.3)  # the arrivals' spacing is the scenario, not a wait for an event
        holder.release()
        for thread in threads:
            thread.join(40)
    finally:
        for own in clients:
            own.close()
    assert holds.order == list(range(6))
    assert holds.overlaps == 0
