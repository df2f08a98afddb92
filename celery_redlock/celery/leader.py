"""Who leads a cluster of HA beats: the leader lock, the leader record beside it, and this
process's terms as leader (:class:`Leadership`), with the signals that announce them.

- The lock is kept alive by the process heartbeat thread, not by the beat's ``tick()``: a tick
  may sleep for ``beat_max_loop_interval`` (five minutes by default), far longer than a lock TTL
  that gives a failover in seconds.
- A leader with less than ``redlock_beat_min_validity`` seconds of validity left, even after one
  extension of its own, may not send (:meth:`Leadership.may_dispatch`, asked just before every
  message): a leader that was paused or cut off from a majority stops before another process can
  have taken over.
- Slots are decided by each host's wall clock. A leader that shuts down cuts its lock to
  ``redlock_beat_min_validity`` rather than deleting it, and never sends with less than that
  left, so hosts whose clocks disagree by less than ``redlock_beat_min_validity`` never send the
  same slot twice; more skew than that can double a slot at a handover.
- The current leader is written, as JSON (hostname, pid, since, and ``sent_before`` for a
  process-local schedule, see :mod:`~celery_redlock.celery.catchup`), to the key
  ``<lock key>:leader`` on every master with the lock's TTL, refreshed on every extension, so
  anyone can read who leads (:func:`read_leader`).

Leadership changes are logged on ``celery_redlock.beat`` and sent as the signals
:data:`beat_leader_elected` and :data:`beat_leader_lost`. ``beat_leader_lost`` may be sent from
the heartbeat thread (when an extension finds the lock gone); keep its receivers short.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery.utils.dispatch import Signal

from ..errors import ConfigError
from ..lock.heartbeat import process_heartbeat
from ..lock.redlock import Redlock
from ..lock.resource import Lock, lock_key
from ..ops.leader import LEADER_SUFFIX as LEADER_SUFFIX
from ..ops.leader import read_leader as read_leader
from ..ops.leader import record_key as _record_key
from .beatconf import BeatSettings
from .catchup import RECORD_FIELD, CatchUp
from .settings import read_settings, refuse_unknown_settings

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


def leader_redlock(conf: Mapping[str, Any]) -> Redlock:
    """A Redlock of the beat's own over the app's ``redlock_*`` settings (masters, timeouts,
    key prefix), so its connections close with the scheduler and never with a task's."""
    refuse_unknown_settings(conf)
    settings = read_settings(conf)
    try:
        return settings.redlock()
    except ConfigError as exc:
        raise ConfigError(f"redlock_{exc}") from None


class LeaderLock(Lock):
    """The leader lock; each successful extension also refreshes the leader record."""

    def __init__(self, redlock: Redlock, name: str, ttl: float, record: Callable[[], str]) -> None:
        super().__init__(redlock, name, ttl)
        self.record_key = _record_key(redlock, name)
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


class Leadership:
    """This process's terms as leader: the lock held now and since when.

    The only writer of that state. A tick begins and ends terms, and the heartbeat thread ends
    one when an extension finds the lock gone: hence the mutex.
    """

    def __init__(self, redlock: Redlock, settings: BeatSettings, catchup: CatchUp, sender: object) -> None:
        self._redlock = redlock
        self._settings = settings
        self._catchup = catchup  # says, in the record, before when every tick was sent
        self._sender = sender  # the scheduler: what the signals name as their sender
        self._state = threading.Lock()
        self._lock: LeaderLock | None = None
        self._leading = False
        self._since = 0.0
        self._since_wall = 0.0
        self._hostname = socket.gethostname()

    @property
    def leading(self) -> bool:
        return self._leading

    @property
    def lock(self) -> LeaderLock | None:
        """The lock of the current (or last) term; None before the first."""
        return self._lock

    @property
    def validity(self) -> float:
        lock = self._lock
        return lock.validity if lock is not None else 0.0

    def may_dispatch(self) -> bool:
        """Whether this process may send a message now, as the leader.

        INVARIANT: True only while this term's lock has at least ``min_validity`` of validity
        left, counted from before the round that gave it: a leader that was paused or cut off
        from a majority stops before another beat can have taken over.

        A healthy leader's validity falls below that every heartbeat cycle (at a TTL of 3 s it
        runs from 1.5 s down to 0.5 s before each extension: the heartbeat counts it from the
        extension's start, interval plus margin). Refusing there would lose a run a shared
        store has already recorded, and no failover would follow to send it; so below the
        minimum the lock is extended once, here, and the rule asked again.
        """
        lock = self._lock
        if not self._leading or lock is None:
            return False
        if lock.validity >= self._settings.min_validity:
            return True
        return lock.extend() and self._leading and lock.validity >= self._settings.min_validity

    def confirm(self) -> None:
        """A leader that may not dispatch (too little validity left, even after one extension
        of its own: :meth:`may_dispatch`) steps down."""
        if not self._leading or self.may_dispatch():
            return
        lock = self._lock
        left = lock.validity if lock is not None else 0.0
        reason = (
            lock.lost_reason
            if lock is not None and lock.lost_reason
            else f"{left:.2f} s of validity left, below redlock_beat_min_validity "
            f"({self._settings.min_validity:g} s), and the lock could not be extended"
        )
        self.step_down(reason)

    def acquire(self) -> LeaderLock | None:
        """Take the leader lock if it is free and begin a term; the lock, or None if taken."""
        s = self._settings
        # A fresh Lock per attempt: the previous one may still be counting down a handover.
        lock = LeaderLock(self._redlock, s.lock_name, s.lock_ttl, self._record)
        if not lock.acquire(blocking=False):
            return None
        with self._state:
            self._lock = lock
            self._leading = True
            self._since = time.monotonic()
            self._since_wall = time.time()
            self._catchup.start_term()
        process_heartbeat().keep(lock, on_lost=self._on_lost)
        return lock

    def elected(self, lock: LeaderLock) -> None:
        """The term that took ``lock`` is under way: write the leader record, and say so."""
        s = self._settings
        lock.announce(s.lock_ttl)
        logger.info(
            "beat leader elected: %s pid %d holds %s (validity %.2f s); dispatching",
            self._hostname,
            os.getpid(),
            lock.key,
            lock.validity,
        )
        beat_leader_elected.send(
            sender=self._sender,
            lock_name=s.lock_name,
            hostname=self._hostname,
            pid=os.getpid(),
            validity=lock.validity,
        )

    def give_back(self) -> None:
        """End a term that could not start (before :meth:`elected`): the lock is released."""
        lock = self._leave()
        if lock is not None:
            lock.release()

    def step_down(self, reason: str) -> None:
        """End the term because the lock was lost, or is about to be."""
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
        self._lost(reason, held_for)

    def resign(self) -> None:
        """End the term because this beat shuts down."""
        lock = self._leave()
        if lock is None:
            return
        held_for = time.monotonic() - self._since
        # Cut to min_validity, not deleted: a successor whose clock runs behind ours must not
        # see the slot we just sent as still due.
        handover = self._settings.min_validity
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
        self._lost("shut down", held_for)

    def read_records(self) -> list[bytes | None]:
        """Every master's copy of the leader record (None where it has none)."""
        return self._redlock.read_everywhere(_record_key(self._redlock, self._settings.lock_name))

    def _record(self) -> str:
        return json.dumps(
            {
                "hostname": self._hostname,
                "pid": os.getpid(),
                "since": self._since_wall,
                "lock": lock_key(self._redlock.key_prefix, self._settings.lock_name),
                "ttl": self._settings.lock_ttl,
                RECORD_FIELD: self._catchup.claim(time.time()),
            }
        )

    def _on_lost(self, lock: Lock, reason: str) -> None:
        if lock is self._lock:
            self.step_down(reason)

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

    def _lost(self, reason: str, held_for: float) -> None:
        beat_leader_lost.send(
            sender=self._sender,
            lock_name=self._settings.lock_name,
            hostname=self._hostname,
            pid=os.getpid(),
            reason=reason,
            held_for=held_for,
        )
