"""One daemon thread per process that keeps held locks alive. Knows nothing of Celery.

Each kept lock is extended about every ``ttl / 3``. A failed extension is retried quickly while
the lock still has validity left; the lock is *lost* when its validity runs out or when the
masters that no longer hold its token leave no quorum possible. The owner then hears of it
through its ``on_lost`` callback. ``max_hold`` stops the extensions after that many seconds, so a
stuck holder cannot keep a resource forever: the lock then expires and counts as lost.

Locks that come due at about the same time are extended together, in one round per Redlock with
every extension for a master in one write (:meth:`Redlock.extend_many`): a process holding many
locks behind a slow master pays one round trip per beat, not one per lock.

The thread holds only weak references to locks, and every heartbeat starts empty again in a
forked child: a child never extends its parent's locks.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .._fork import on_fork_in_child
from .._validate import number
from ..errors import ConfigError, name_masters
from .clock import now
from .redlock import Redlock
from .reentrant import ReentrantLock
from .resource import Lock

logger = logging.getLogger("celery_redlock.heartbeat")

OnLost = Callable[[Lock, str], None]
# Told of every beat, after it: how late the beat began after its first lock came due (seconds),
# and for each lock extended, (the lock, the validity it had left just before, extended or not).
# For metrics (celery_redlock.celery.metrics); with none set, a beat pays one global read.
BeatObserver = Callable[[float, list[tuple[Lock, float, bool]]], None]
_observer: BeatObserver | None = None


def observe_beats(observer: BeatObserver | None) -> None:
    """Tell ``observer`` of every beat of every heartbeat in this process (None: stop)."""
    global _observer
    _observer = observer


# After a failed extension, try again after this fraction of the validity left (at least
# MIN_RETRY seconds), so a passing fault does not cost the lock.
RETRY_FRACTION = 0.25
MIN_RETRY = 0.02
# The queue is compacted when it holds this many more forgotten entries than live ones.
COMPACT_SLACK = 64
# Locks due within this fraction of their interval after the first due one are extended with it,
# in one round (pipelined, see Redlock.extend_many): a process holding many locks pays one round
# trip per beat, not one per lock, and an extension comes at most this much early.
BATCH_WINDOW = 0.1
# At most this many locks share one round; more go in the next round of the same beat. One round
# of 1000 extensions to 3 loopback masters costs this process about 16 ms (measured: ~16 us a
# lock, against ~150 us for a round of one), well inside the default request_timeout of 0.1 s;
# a beat of 10000 locks behind a 20 ms round trip takes ten such rounds, 0.4 s, inside the
# 0.5 s interval of a 1.5 s TTL (benchmarks/bench_heartbeat.py).
MAX_BATCH = 1000
# A heartbeat that gets to a lock a whole interval after it came due was not let run: its locks
# may have expired meanwhile. Under a gevent or eventlet pool the heartbeat is a green thread,
# which runs only when the task body yields, so a CPU-bound body that never does starves it
# (see docs/pools.md); elsewhere, the process was paused or starved of CPU. Reported, since
# the lock's loss alone does not say why.
STARVED = (
    "the lock heartbeat ran %.2f s late and its locks may have expired meanwhile: this process "
    "did not let it run (under a gevent or eventlet pool, a task body that does not yield, e.g. a "
    "CPU-bound loop; otherwise a paused or overloaded process)"
)


@dataclass(slots=True)
class _Entry:
    lock_ref: weakref.ReferenceType[Lock]
    interval: float
    on_lost: OnLost | None
    hold_until: float | None
    token: str | None
    done: bool = False


def longest_interval(ttl: float, request_timeout: float, drift: float) -> float:
    """The longest heartbeat interval that keeps a lock of ``ttl`` seconds alive.

    INVARIANT: an extension lands before the validity of the one before it runs out, even when
    one extension round is missed. The round after a successful one starts ``interval`` later
    and may take ``request_timeout``; if it fails, a retry follows at once (the heartbeat
    retries quickly while validity is left) and may take ``request_timeout`` too; and the
    validity of a round is its TTL less ``drift`` (counted from before the round). So
    ``interval + 2 * request_timeout + drift <= ttl``. Zero or less: no interval can keep a lock
    of that TTL.
    """
    return ttl - drift - 2 * request_timeout


# The least margin over a heartbeat interval (see margin()).
MIN_MARGIN = 0.5


def margin(interval: float, request_timeout: float) -> float:
    """How much longer than its heartbeat ``interval`` a kept lock may go unextended before it is
    no longer counted as owned, and before an operator's watch may call its holder dead (the
    same number on both sides: see :mod:`.liveness`).

    Two request timeouts: the round that extends may take one, and a failed one is retried;
    MIN_MARGIN: a busy process's thread wakes late; half the interval: a heartbeat late under
    load.
    """
    return max(MIN_MARGIN, 2 * request_timeout, interval / 2)


def heartbeat_interval(lock: Lock, interval: float | None) -> float:
    """``interval`` checked against :func:`longest_interval`, or, for None, the default: a
    third of the TTL, or less where the rule needs less. A :class:`ConfigError` names the
    largest interval allowed."""
    redlock = lock.redlock
    longest = longest_interval(lock.ttl, redlock.request_timeout, redlock.drift(lock.ttl))
    if interval is None:
        interval = min(lock.ttl / 3, longest)
        if interval > 0:
            return interval
    else:
        interval = number("heartbeat interval", interval, above=0, unit="seconds")
        if interval <= longest:
            return interval
    raise ConfigError(
        f"heartbeat interval {interval:g} s cannot keep lock {lock.name!r} alive: with ttl "
        f"{lock.ttl:g} s and request_timeout {redlock.request_timeout:g} s the largest interval "
        f"allowed is {max(0.0, longest):g} s (ttl - drift - 2 x request_timeout: an extension "
        "must land before validity ends even when one round is missed)"
    )


# The checked intervals a heartbeat keeps (see Heartbeat._interval): past this many distinct TTL
# and interval pairs, the rest are checked on every keep().
MAX_INTERVALS_KEPT = 256
# The interval types whose checked value may be looked up: None and a float. A bool equals and
# hashes like an int (True like 1.0), so any other type is checked anew each time, and refused.
_PLAIN_INTERVALS = (type(None), float)

# Queue items are (due time, sequence, entry) tuples: the heap compares them in C, where an
# ordered dataclass would run a Python __lt__ for every comparison of every push and pop.
_Due = tuple[float, int, _Entry]


class Heartbeat:
    """Extends every lock it keeps, from one daemon thread started on first use."""

    def __init__(self, name: str = "redlock-heartbeat") -> None:
        self._name = name
        self._seq = itertools.count()
        self._start_empty()
        on_fork_in_child(self._after_fork_in_child)

    def _start_empty(self) -> None:
        """No lock kept, no thread: a new heartbeat, or a forked child's copy of one."""
        self._queue: list[_Due] = []
        self._entries: dict[int, _Entry] = {}
        # The hot paths (keep, forget) take the condition's own mutex: a ``with`` on it runs in C,
        # where the Condition's __enter__ and __exit__ are two Python calls each time.
        self._mutex = threading.Lock()  # never taken re-entrantly
        self._cond = threading.Condition(self._mutex)
        # Intervals already checked against the rule, by (request_timeout, drift factor, ttl,
        # interval asked): a process keeps locks of a few TTLs, thousands of times each.
        self._intervals: dict[tuple[float, float, float, float | None], tuple[float, float]] = {}
        self._thread: threading.Thread | None = None
        self._running = False  # the thread runs (cheaper to read than Thread.is_alive())
        self._stopping = False
        # When the sleeping thread will next look at the queue (0 while it is awake, inf when it
        # waits to be told): keep() wakes it only for a lock due before then.
        self._sleep_until = 0.0
        self._lag = 0.0  # how late the last beat began after its first lock came due

    def _after_fork_in_child(self) -> None:
        # The locks kept are the parent's: the child must never extend them, and has no thread
        # to do it anyway. The condition is replaced, not taken (see celery_redlock._fork).
        self._start_empty()

    def keep(
        self,
        lock: Lock | ReentrantLock,
        *,
        interval: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
    ) -> None:
        """Start keeping ``lock`` (already acquired) alive until :meth:`forget`. For a
        reentrant lock, the calling owner's holding is kept (the heartbeat thread is another
        owner: through the view it would see nothing held)."""
        lock = _kept(lock)
        if not lock.owned():
            raise ValueError(f"lock {lock.name!r} is not held; acquire it before keeping it alive")
        every, beat = self._interval(lock, interval)
        # INVARIANT (an operator's release never breaks a live holder): a kept lock counts as
        # owned only until interval + margin after the start of its last extension (or from
        # now, for the first). An operator's watch calls a holder dead only after seeing no
        # extension for that long (lock/liveness.py), so by then the holder no longer acts on
        # the lock even if its heartbeat was held up (a long C call holding the GIL, SIGSTOP).
        lock._keep_alive(beat)
        if max_hold is not None and not (type(max_hold) is float and 0 < max_hold < math.inf):
            max_hold = number("max_hold", max_hold, above=0, unit="seconds")
        hold_until = None if max_hold is None else now() + max_hold
        entry = _Entry(weakref.ref(lock), every, on_lost, hold_until, lock.token)
        due = now() + every
        with self._mutex:
            old = self._entries.get(id(lock))
            if old is not None:
                old.done = True
            self._entries[id(lock)] = entry
            self._push(due, entry)
            if not self._running or self._stopping:  # stopping: that thread is on its way out
                self._start_thread()

    def _interval(self, lock: Lock, interval: float | None) -> tuple[float, float]:
        """(:func:`heartbeat_interval`, that plus its :func:`margin`) for ``lock``, looked up
        when that TTL and interval were checked before (a ConfigError is never kept: a bad
        interval raises every time)."""
        redlock = lock.redlock
        key = (redlock.request_timeout, redlock.drift_factor, lock.ttl, interval)
        known = self._intervals.get(key)
        if known is None or type(interval) not in _PLAIN_INTERVALS:
            every = heartbeat_interval(lock, interval)
            known = every, every + margin(every, redlock.request_timeout)
            if len(self._intervals) < MAX_INTERVALS_KEPT:
                self._intervals[key] = known
        return known

    def forget(self, lock: Lock | ReentrantLock) -> None:
        """Stop keeping ``lock`` alive (call before or after releasing it)."""
        lock = _kept(lock)
        lock._keep_alive(None)
        owed = None
        with self._mutex:
            entry = self._entries.pop(id(lock), None)
            if entry is not None:
                entry.done = True
                # The callback usually holds its owner's state (a task's lock and request data):
                # a forgotten entry waiting in the queue must not keep that alive. Taken under
                # the condition, as _lost takes it: whoever takes it calls it, at most once.
                owed, entry.on_lost = entry.on_lost, None
            # Forgotten entries leave the queue lazily, when they come due a whole interval
            # later; a busy process forgets thousands per interval, and every one of them would
            # sit in memory (and in the garbage collector's way) until then.
            if len(self._queue) > 2 * len(self._entries) + COMPACT_SLACK:
                self._queue = [due for due in self._queue if not due[2].done]
                heapq.heapify(self._queue)
        # INVARIANT: a kept lock lost while kept is announced, once. Its owner may see the loss
        # first (ensure() raising after a stop longer than the TTL) and forget it before this
        # thread's round does: the lock still has this entry's token, and is no longer owned.
        if owed is not None and entry is not None and lock.token == entry.token and not lock.owned():
            reason = lock.lost_reason or "validity ran out while it was kept"
            logger.error("lock %s lost: %s", lock.name, reason)
            try:
                owed(lock, reason)
            except Exception:
                logger.exception("on_lost callback failed for %s", lock.name)

    def kept(self) -> list[Lock]:
        """The locks kept alive now."""
        with self._mutex:
            refs = [e.lock_ref() for e in self._entries.values() if not e.done]
        return [lock for lock in refs if lock is not None]

    def stop(self, timeout: float = 5.0) -> None:
        with self._mutex:
            self._stopping = True
            self._cond.notify_all()  # a thread replaced by keep() may still be waiting
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------------------
    def _push(self, at: float, entry: _Entry) -> None:
        """Queue ``entry`` to be extended at ``at`` (holding the mutex).

        INVARIANT: a sleeping thread wakes by the first due time in the queue. A thread wake-up
        per task costs more than the rest of keep() and forget() together, so it is woken only
        for an entry due before it would wake anyway: a lock kept now, or one that a thread
        replaced by keep() (see _start_thread) rescheduled after its successor went to sleep.
        """
        heapq.heappush(self._queue, (at, next(self._seq), entry))
        if at < self._sleep_until:
            self._cond.notify()

    def _start_thread(self) -> None:
        """A new thread, called holding the mutex when none runs or the one running was told
        to stop (it is on its way out)."""
        self._running = True
        self._stopping = False
        # INVARIANT: one thread beats at a time. A thread told to stop may still be inside a
        # beat (outside the mutex) when keep() starts its successor here and clears the stop:
        # it must not go on, so every thread runs only while it is ``_thread``.
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._beat_until_stopped()
        finally:
            with self._mutex:
                if self._thread is threading.current_thread():  # not a replaced one's
                    self._running = False

    def _beat_until_stopped(self) -> None:
        while True:
            with self._mutex:
                due = self._wait_for_due()
            if due is None:
                return
            try:
                self._beat(due)
            except Exception:  # a bug must not stop the heartbeat of every other lock
                logger.exception("heartbeat failed for %d locks", len(due))

    def _wait_for_due(self) -> list[_Entry] | None:
        """The entries to extend now, once the first is due (called holding the condition):
        every entry due by then or within ``BATCH_WINDOW`` of its interval after it, so that
        they share one round. None to stop (told to, or replaced: see _start_thread)."""
        me = threading.current_thread()
        while self._beats(me):
            queue = self._queue  # forget() may replace it (compaction) while this one waits
            current = now()
            if queue and current - queue[0][0] > queue[0][2].interval:
                # The thread sleeps until the first due time, so this is how late it woke (see
                # STARVED); told even when that lock was forgotten meanwhile.
                logger.warning(STARVED, current - queue[0][0])
            # Forgotten entries are dropped without waiting for their due times. When nothing
            # live is left, the thread still sleeps until the last dropped one would have come
            # due: locks kept meanwhile are due later than that (their owners' intervals are
            # alike), so keeping them costs no wake-up, and the thread looks at them then.
            dropped_until = 0.0
            while queue and queue[0][2].done:
                dropped_until = heapq.heappop(queue)[0]
            if queue and queue[0][0] <= current:
                self._lag = current - queue[0][0]
                due = []
                # An entry taken early is extended at most BATCH_WINDOW of its interval early.
                while queue and (
                    queue[0][2].done or queue[0][0] <= current + BATCH_WINDOW * queue[0][2].interval
                ):
                    entry = heapq.heappop(queue)[2]
                    if not entry.done:
                        due.append(entry)
                return due
            if queue:
                self._sleep(me, queue[0][0], current)
            else:
                self._sleep(me, dropped_until if dropped_until > current else math.inf, current)
        return None

    def _sleep(self, me: threading.Thread, until: float, current: float) -> None:
        """Wait on the condition (holding it) until ``until`` or a wake-up, saying meanwhile in
        ``_sleep_until`` when this thread will look at the queue (see _push's INVARIANT)."""
        self._sleep_until = until
        self._cond.wait(None if until == math.inf else until - current)
        if self._thread is me:  # replaced, it must not mark its successor awake
            self._sleep_until = 0.0

    def _beats(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is to go on beating: not told to stop, and not replaced (see
        _start_thread's INVARIANT). Asked holding the condition."""
        return not self._stopping and self._thread is thread

    def _beat(self, due: list[_Entry]) -> None:
        """Extend every due lock, one round per Redlock (and per ``MAX_BATCH`` locks)."""
        groups: dict[Redlock, list[tuple[_Entry, Lock]]] = {}
        for entry in due:
            lock = self._to_extend(entry)
            if lock is not None:
                groups.setdefault(lock.redlock, []).append((entry, lock))
        observer = _observer
        seen: list[tuple[Lock, float, bool]] = []
        for redlock, group in groups.items():
            for start in range(0, len(group), MAX_BATCH):
                batch = group[start : start + MAX_BATCH]
                left = [lock.validity for _, lock in batch] if observer is not None else []
                try:
                    extended = redlock.extend_many([lock for _, lock in batch])
                except Exception:  # a bug here must not cost the locks their retries
                    logger.exception("extending %d locks failed", len(batch))
                    extended = [False] * len(batch)
                for (entry, lock), ok in zip(batch, extended, strict=True):
                    self._after_extension(entry, lock, ok)
                if observer is not None:
                    seen.extend(zip((lock for _, lock in batch), left, extended, strict=True))
        if observer is not None and seen:
            try:
                observer(self._lag, seen)
            except Exception:
                logger.exception("the heartbeat's observer failed")

    def _to_extend(self, entry: _Entry) -> Lock | None:
        """The entry's lock if it is to be extended now; otherwise settles the entry."""
        lock = entry.lock_ref()
        if lock is None or entry.done:
            return None
        if lock.token != entry.token:  # released (or re-acquired) by its owner meanwhile
            self._finish(lock, entry)
            return None
        current = now()
        if entry.hold_until is not None and current >= entry.hold_until:
            # INVARIANT: a holder whose lock is no longer extended is told at once (its owned()
            # turns False, ensure() raises), while the key still has validity left on the
            # masters: its body can stop before another client can take the lock.
            left = lock.validity
            lock._give_up("max hold reached; the lock is no longer extended and is left to expire")
            logger.warning(
                "lock %s reached its max hold; no longer extended, it expires in %.1f s", lock.name, left
            )
            self._lost(lock, entry, "max hold reached; the lock was left to expire")
            return None
        return lock

    def _after_extension(self, entry: _Entry, lock: Lock, extended: bool) -> None:
        if extended:
            self._reschedule(entry, now() + entry.interval)
            return
        if lock.token != entry.token:
            self._finish(lock, entry)
            return
        if lock.owned():
            # Close to the end of validity the retry goes at once: the interval rule
            # (longest_interval) counts on it following the failed round without a pause.
            left = lock.validity
            quick = left < 2 * lock.redlock.request_timeout
            retry = MIN_RETRY if quick else max(MIN_RETRY, left * RETRY_FRACTION)
            # The masters that did not extend it, named: the votes of the failed round
            # (Lock.last_votes, set by _settle_extension).
            logger.warning(
                "extension of %s failed (%s); %.2f s of validity left, retrying in %.2f s",
                lock.name,
                "; ".join(name_masters(lock.last_votes)) or "the round raised",
                lock.validity,
                retry,
            )
            self._reschedule(entry, now() + min(retry, entry.interval))
            return
        reason = lock.lost_reason or "validity ran out before an extension succeeded"
        self._lost(lock, entry, reason)

    def _reschedule(self, entry: _Entry, at: float) -> None:
        with self._mutex:
            if not entry.done:
                self._push(at, entry)

    def _finish(self, lock: Lock, entry: _Entry) -> None:
        with self._mutex:
            entry.done = True
            if self._entries.get(id(lock)) is entry:
                del self._entries[id(lock)]

    def _lost(self, lock: Lock, entry: _Entry, reason: str) -> None:
        self._finish(lock, entry)
        with self._mutex:  # see forget(): one of the two calls it
            owed, entry.on_lost = entry.on_lost, None
        logger.error("lock %s lost: %s", lock.name, reason)
        if owed is None:
            return
        try:
            owed(lock, reason)
        except Exception:
            logger.exception("on_lost callback failed for %s", lock.name)


_process_heartbeat: Heartbeat | None = None
_process_mutex = threading.Lock()


def process_heartbeat() -> Heartbeat:
    """This process's heartbeat (a new one in a forked child)."""
    global _process_heartbeat
    if _process_heartbeat is not None:  # the hot path: once made, no mutex needed to read it
        return _process_heartbeat
    with _process_mutex:
        if _process_heartbeat is None:
            _process_heartbeat = Heartbeat()
        return _process_heartbeat


def _after_fork_in_child() -> None:
    global _process_heartbeat, _process_mutex
    _process_heartbeat = None  # the child's own is made on first use, its thread with it
    _process_mutex = threading.Lock()  # another thread may have held it at the fork


on_fork_in_child(_after_fork_in_child)


def _kept(lock: Lock | ReentrantLock) -> Lock:
    """The Lock a heartbeat keeps for ``lock``: a reentrant lock's holding for the asking owner
    (or the view's template, never held, when it has none: refused or forgotten as unheld)."""
    if isinstance(lock, ReentrantLock):
        return lock.holding() or lock._template
    return lock
