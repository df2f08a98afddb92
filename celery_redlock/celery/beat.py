"""An HA ``celery beat``: run several beat processes, and exactly one of them dispatches.

    celery -A proj beat -S celery_redlock.beat:RedlockScheduler
    # or: beat_scheduler = "celery_redlock.beat:RedlockScheduler"

:class:`RedlockScheduler` wraps the scheduler class named by ``redlock_beat_scheduler`` (celery's
``PersistentScheduler`` by default) and lets it send a message only while this process holds the
*leader lock*, a Redlock over ``redlock_masters``.

Why each part is the way it is:

- The lock is kept alive by the process heartbeat thread, not by ``tick()``: a tick may sleep for
  ``beat_max_loop_interval`` (five minutes by default), far longer than a lock TTL that gives a
  failover in seconds.
- Validity is checked again just before every message is sent, and a leader with less than
  ``redlock_beat_min_validity`` seconds left does not send: a leader that was paused or cut off
  from a majority stops before another process can have taken over.
- A standby runs the wrapped scheduler's bookkeeping too (entries advance, nothing is sent), so
  when it takes over it carries on from the current slot instead of "catching up" the slots the
  old leader already sent. The standby ticks every ``redlock_beat_standby_interval`` seconds and
  tries to take the lock each time: after the leader dies, a standby dispatches within the lock's
  TTL plus one standby tick.
- Interval schedules (``schedule(T)``, ``"schedule": 30.0``) fire at multiples of ``T`` since
  the epoch rather than ``T`` after the process started (``redlock_beat_align_intervals``): every
  beat, and so every successive leader, then agrees on when a slot is, and the slot a message
  belongs to (:mod:`celery_redlock.slots`) is the one it was sent for.
- Slots are decided by each host's wall clock. A leader that shuts down cuts its lock to
  ``redlock_beat_min_validity`` rather than deleting it, and never sends with less than that
  left, so hosts whose clocks disagree by less than ``redlock_beat_min_validity`` never send
  the same slot twice; more skew than that can double a slot at a handover.
- The current leader is written, as JSON (hostname, pid, since), to the key
  ``<lock key>:leader`` on every master with the lock's TTL, refreshed on every extension, so
  anyone can read who leads (:func:`read_leader`).

Leadership changes are logged on ``celery_redlock.beat`` and sent as the signals
:data:`beat_leader_elected` and :data:`beat_leader_lost`. ``beat_leader_lost`` may be sent from
the heartbeat thread (when an extension finds the lock gone); keep its receivers short.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery.beat import Scheduler
from celery.schedules import schedstate, schedule
from celery.utils.dispatch import Signal
from celery.utils.imports import load_extension_class_names, symbol_by_name

from .._fork import on_fork_in_child
from .._validate import flag, number
from ..errors import ConfigError
from ..lock.heartbeat import process_heartbeat
from ..lock.redlock import Lock, Redlock, lock_key
from . import hooks
from .settings import read_settings

logger = logging.getLogger("celery_redlock.beat")

beat_leader_elected = Signal(
    name="beat_leader_elected",
    providing_args={"lock_name", "hostname", "pid", "validity"},
)
beat_leader_elected.__doc__ = "Sent by a RedlockScheduler that took the leader lock and now dispatches."

beat_leader_lost = Signal(
    name="beat_leader_lost",
    providing_args={"lock_name", "hostname", "pid", "reason", "held_for"},
)
beat_leader_lost.__doc__ = (
    "Sent by a RedlockScheduler that stopped dispatching: its lock was lost, or it shut down."
)

DEFAULT_SCHEDULER = "celery.beat:PersistentScheduler"
DEFAULT_LOCK_TTL = 10.0
DEFAULT_STANDBY_INTERVAL = 1.0
LEADER_SUFFIX = ":leader"
# A standby runs the wrapped tick until nothing is due; this bounds that loop for a schedule
# whose entries claim to be due again at once.
MAX_FOLLOW_STEPS = 1000


# -- settings ---------------------------------------------------------------------------------------
def _scheduler_class(value: object) -> type:
    if isinstance(value, str):
        aliases = dict(load_extension_class_names("celery.beat_schedulers"))
        try:
            value = symbol_by_name(value, aliases=aliases)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"redlock_beat_scheduler: cannot import {value!r}: {exc}") from None
    if not isinstance(value, type) or not issubclass(value, Scheduler):
        raise ConfigError(f"redlock_beat_scheduler must name a celery.beat.Scheduler subclass, got {value!r}")
    if issubclass(value, RedlockScheduler):
        raise ConfigError(
            "redlock_beat_scheduler names a RedlockScheduler; it must name the scheduler to wrap, "
            f"such as {DEFAULT_SCHEDULER!r}"
        )
    return value


@dataclass(frozen=True)
class BeatSettings:
    """The ``redlock_beat_*`` settings, validated."""

    lock_name: str
    lock_ttl: float
    min_validity: float
    standby_interval: float
    scheduler: type
    align_intervals: bool

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any], app_name: str | None = None) -> BeatSettings:
        lock_name = conf.get("redlock_beat_lock_name") or f"beat:{app_name or 'celery'}"
        if not isinstance(lock_name, str):
            raise ConfigError(f"redlock_beat_lock_name must be a str, got {lock_name!r}")
        ttl = number(
            "redlock_beat_lock_ttl",
            conf.get("redlock_beat_lock_ttl", DEFAULT_LOCK_TTL),
            above=0,
            unit="seconds",
        )
        min_validity = conf.get("redlock_beat_min_validity")
        min_validity = (
            ttl / 3
            if min_validity is None
            else number("redlock_beat_min_validity", min_validity, above=0, unit="seconds")
        )
        # The heartbeat extends every ttl/3, so a healthy leader's validity dips to 2/3 of the TTL.
        if min_validity >= ttl * 2 / 3:
            raise ConfigError(
                f"redlock_beat_min_validity must be below 2/3 of redlock_beat_lock_ttl "
                f"({ttl * 2 / 3:.3g} s), or a healthy leader would refuse to dispatch; "
                f"got {min_validity!r}"
            )
        standby = number(
            "redlock_beat_standby_interval",
            conf.get("redlock_beat_standby_interval", DEFAULT_STANDBY_INTERVAL),
            above=0,
            unit="seconds",
        )
        if standby > ttl:
            raise ConfigError(
                f"redlock_beat_standby_interval ({standby!r} s) must not exceed "
                f"redlock_beat_lock_ttl ({ttl!r} s): failover takes the TTL plus one standby tick"
            )
        scheduler = _scheduler_class(conf.get("redlock_beat_scheduler") or DEFAULT_SCHEDULER)
        align = flag("redlock_beat_align_intervals", conf.get("redlock_beat_align_intervals", True))
        return cls(lock_name, ttl, min_validity, standby, scheduler, align)


def leader_redlock(conf: Mapping[str, Any]) -> Redlock:
    """A Redlock of the beat's own over the app's ``redlock_*`` settings (masters, timeouts,
    key prefix), so its connections close with the scheduler and never with a task's."""
    settings = read_settings(conf)
    try:
        return settings.redlock(linger=False)
    except ConfigError as exc:
        raise ConfigError(f"redlock_{exc}") from None


# -- the leader record ---------------------------------------------------------------------------
def read_leader(redlock: Redlock, lock_name: str) -> dict[str, Any] | None:
    """The current leader's record (hostname, pid, since, ...), if a quorum of masters agrees."""
    key = lock_key(redlock.key_prefix, lock_name) + LEADER_SUFFIX
    counts = Counter(v for v in redlock.read_everywhere(key) if v is not None)
    if not counts:
        return None
    value, votes = counts.most_common(1)[0]
    if votes < redlock.quorum:
        return None
    record: dict[str, Any] = json.loads(value)
    return record


class LeaderLock(Lock):
    """The leader lock; each successful extension also refreshes the leader record."""

    def __init__(self, redlock: Redlock, name: str, ttl: float, record: Callable[[], str]) -> None:
        super().__init__(redlock, name, ttl)
        self.record_key = self.key + LEADER_SUFFIX
        self._record = record

    def extended(self, ttl: float) -> None:
        self.announce(ttl)

    def announce(self, ttl: float) -> None:
        # Best effort: the record only informs people, the lock is what decides.
        written = self.redlock.write_everywhere(self.record_key, self._record(), ttl)
        if written < len(self.redlock.masters):
            logger.debug(
                "leader record %s written to %d of %d masters",
                self.record_key,
                written,
                len(self.redlock.masters),
            )


# -- epoch-aligned intervals ---------------------------------------------------------------------
def _alignable(spec: object) -> bool:
    # Only celery's own interval schedule: a subclass with its own is_due keeps its own rule.
    return (
        isinstance(spec, schedule)
        and type(spec).is_due is schedule.is_due
        and not spec.relative
        and spec.seconds > 0
    )


def aligned_is_due(spec: Any, last_run_at: Any) -> Any:
    """``schedule.is_due`` with the ticks at multiples of the period since the epoch."""
    period = float(spec.seconds)
    now = spec.now().timestamp()
    last = spec.maybe_make_aware(last_run_at).timestamp()
    remaining = (math.floor(now / period) + 1) * period - now
    return schedstate(math.floor(now / period) > math.floor(last / period), remaining)


# -- the scheduler --------------------------------------------------------------------------------
_wrapped_classes: dict[type, type] = {}
_wrapped_mutex = threading.Lock()


def _wrap(inner: type) -> type:
    with _wrapped_mutex:
        cls = _wrapped_classes.get(inner)
        if cls is None:
            name = f"Redlock{inner.__name__}"
            cls = type(name, (RedlockScheduler, inner), {"__module__": __name__, "__qualname__": name})
            _wrapped_classes[inner] = cls
        return cls


def _after_fork_in_child() -> None:
    global _wrapped_mutex
    _wrapped_mutex = threading.Lock()  # another thread may have held it at the fork


on_fork_in_child(_after_fork_in_child)


class RedlockScheduler(Scheduler):  # type: ignore[misc]
    """A beat scheduler that dispatches only while it holds the leader lock.

    Instantiating it builds a class deriving from both this one and the scheduler to wrap
    (``redlock_beat_scheduler``), so the wrapped one keeps its own storage and tick logic; this
    class only decides whether a due entry is sent.
    """

    settings: BeatSettings

    def __new__(cls, app: Any, *args: Any, **kwargs: Any) -> RedlockScheduler:
        if cls is RedlockScheduler:
            settings = BeatSettings.from_conf(app.conf, app.main)
            cls = _wrap(settings.scheduler)
        instance: RedlockScheduler = super().__new__(cls)
        return instance

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        hooks.connect()  # beat publishes: its messages carry the publish time for lock_slot
        self.settings = BeatSettings.from_conf(app.conf, app.main)
        self._redlock = leader_redlock(app.conf)
        self._state = threading.Lock()
        self._lock: LeaderLock | None = None
        self._leading = False
        self._since = 0.0
        self._since_wall = 0.0
        self._hostname = socket.gethostname()
        super().__init__(app, *args, **kwargs)

    # -- what celery beat reads ----------------------------------------------------------------------
    @property
    def info(self) -> str:
        s = self.settings
        line = (
            f"    . leader lock -> {lock_key(self._redlock.key_prefix, s.lock_name)} on "
            f"{len(self._redlock.masters)} masters (ttl {s.lock_ttl:g}s, standby tick "
            f"{s.standby_interval:g}s)"
        )
        inner = super().info
        return f"{inner}\n{line}" if inner else line

    @property
    def leading(self) -> bool:
        """Whether this process holds the leader lock now."""
        return self._leading

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self._leading and not self._may_dispatch():
            # The heartbeat may only be late; one extension of our own before giving up.
            lock = self._lock
            if lock is None or not (lock.extend() and self._may_dispatch()):
                left = lock.validity if lock is not None else 0.0
                reason = (
                    lock.lost_reason
                    if lock is not None and lock.lost_reason
                    else f"{left:.2f} s of validity left, below redlock_beat_min_validity "
                    f"({self.settings.min_validity:g} s), and the lock could not be extended"
                )
                self._step_down(reason)
        if self._leading:
            delay: float = super().tick(*args, **kwargs)
            return delay
        delay = self._follow(*args, **kwargs)
        if self._try_lead():
            return 0.0
        return min(delay, self.settings.standby_interval)

    def is_due(self, entry: Any) -> Any:
        if self.settings.align_intervals and _alignable(entry.schedule):
            return aligned_is_due(entry.schedule, entry.last_run_at)
        return super().is_due(entry)

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        super().populate_heap(*args, **kwargs)
        if not self.settings.align_intervals or not self._heap:
            return
        # The base class places entries by entry.is_due(), not self.is_due(): re-place the
        # aligned ones, or the first run of each would wait for its unaligned time.
        for index, event in enumerate(self._heap):
            entry = event[2]
            if _alignable(entry.schedule):
                due, delay = self.is_due(entry)
                self._heap[index] = event._replace(time=self._when(entry, 0 if due else delay))
        heapq.heapify(self._heap)

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        if not self._may_dispatch():
            self._not_sent(entry)
            return
        super().apply_entry(entry, producer=producer)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        # Checked here too, right before the message goes out: some schedulers call apply_async
        # directly, and time passes between apply_entry and the send.
        if not self._may_dispatch():
            if advance:
                self.reserve(entry)
            self._not_sent(entry)
            return None
        return super().apply_async(entry, producer=producer, advance=advance, **kwargs)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._resign()
            self._redlock.close()

    # -- leadership ------------------------------------------------------------------------------------
    def _may_dispatch(self) -> bool:
        lock = self._lock
        return self._leading and lock is not None and lock.validity >= self.settings.min_validity

    def _not_sent(self, entry: Any) -> None:
        if self._leading:
            validity = self._lock.validity if self._lock is not None else 0.0
            logger.warning(
                "%s not sent: the leader lock has %.2f s of validity left, below "
                "redlock_beat_min_validity (%g s)",
                entry.name,
                validity,
                self.settings.min_validity,
            )
        else:
            logger.debug("standby: %s is the leader's to send", entry.name)

    def _follow(self, *args: Any, **kwargs: Any) -> float:
        """Advance the wrapped schedule without sending, as far as it is due now."""
        delay: float = 0.0
        for _ in range(MAX_FOLLOW_STEPS):
            delay = super().tick(*args, **kwargs)
            if delay is None or delay > 0:
                break
        return float(self.max_interval) if delay is None else float(delay)

    def _record(self) -> str:
        return json.dumps(
            {
                "hostname": self._hostname,
                "pid": os.getpid(),
                "since": self._since_wall,
                "lock": lock_key(self._redlock.key_prefix, self.settings.lock_name),
                "ttl": self.settings.lock_ttl,
            }
        )

    def _try_lead(self) -> bool:
        s = self.settings
        # A fresh Lock per attempt: the previous one may still be counting down a handover.
        lock = LeaderLock(self._redlock, s.lock_name, s.lock_ttl, self._record)
        if not lock.acquire(blocking=False):
            return False
        with self._state:
            self._lock = lock
            self._leading = True
            self._since = time.monotonic()
            self._since_wall = time.time()
        process_heartbeat().keep(lock, on_lost=self._on_lost)
        lock.announce(s.lock_ttl)
        logger.info(
            "beat leader elected: %s pid %d holds %s (validity %.2f s); dispatching",
            self._hostname,
            os.getpid(),
            lock.key,
            lock.validity,
        )
        beat_leader_elected.send(
            sender=self,
            lock_name=s.lock_name,
            hostname=self._hostname,
            pid=os.getpid(),
            validity=lock.validity,
        )
        return True

    def _on_lost(self, lock: Lock, reason: str) -> None:
        if lock is self._lock:
            self._step_down(reason)

    def _leave(self) -> LeaderLock | None:
        """Stop leading; the lock that was held, or None if this process was not leading."""
        with self._state:
            if not self._leading:
                return None
            self._leading = False
            lock = self._lock
        if lock is not None:
            process_heartbeat().forget(lock)
        return lock

    def _step_down(self, reason: str) -> None:
        lock = self._leave()
        if lock is None:
            return
        held_for = time.monotonic() - self._since
        # Releasing deletes only our own token, so a successor's lock is never touched.
        lock.release()
        logger.error(
            "beat leader lock %s lost after %.1f s: %s; dispatching stopped, back to standby",
            lock.key,
            held_for,
            reason,
        )
        beat_leader_lost.send(
            sender=self,
            lock_name=self.settings.lock_name,
            hostname=self._hostname,
            pid=os.getpid(),
            reason=reason,
            held_for=held_for,
        )

    def _resign(self) -> None:
        lock = self._leave()
        if lock is None:
            return
        held_for = time.monotonic() - self._since
        # Cut to min_validity, not deleted: a successor whose clock runs behind ours must not
        # see the slot we just sent as still due.
        handover = self.settings.min_validity
        if not lock.extend(handover):
            lock.release()
        logger.info(
            "beat leader %s pid %d resigned %s after %.1f s; a standby may take over in %.1f s",
            self._hostname,
            os.getpid(),
            lock.key,
            held_for,
            handover,
        )
        beat_leader_lost.send(
            sender=self,
            lock_name=self.settings.lock_name,
            hostname=self._hostname,
            pid=os.getpid(),
            reason="shut down",
            held_for=held_for,
        )
