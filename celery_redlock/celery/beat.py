"""An HA ``celery beat``: run several beat processes, and exactly one of them dispatches.

    celery -A proj beat -S celery_redlock.beat:RedlockScheduler
    # or: beat_scheduler = "celery_redlock.beat:RedlockScheduler"

:class:`RedlockScheduler` wraps the scheduler class named by ``redlock_beat_scheduler`` (celery's
``PersistentScheduler`` by default) and lets it send a message only while this process holds the
*leader lock*, a Redlock over ``redlock_masters``. This module is the scheduler; its parts live
beside it:

- :mod:`~celery_redlock.celery.beatconf`: the ``redlock_beat_*`` settings (:class:`BeatSettings`);
- :mod:`~celery_redlock.celery.leader`: the leader lock, the leader record (:func:`read_leader`),
  this process's terms as leader, the signals :data:`beat_leader_elected` and
  :data:`beat_leader_lost`, and why a leader stops sending before its lock runs out;
- :mod:`~celery_redlock.celery.stamp`: the slot stamp each message carries (header
  ``redlock_slot``), so a ``lock_slot`` task places it without guessing from the publish time;
- :mod:`~celery_redlock.celery.aligned`: interval ticks at ``anchor + k*T``
  (``redlock_beat_align_intervals``), and why HA wants them;
- :mod:`~celery_redlock.celery.kinds` and :mod:`~celery_redlock.celery.catchup`: what each kind
  of wrapped scheduler needs, and the ticks nobody may have sent.

**A failover loses no tick: a standby never records a run it did not send; a new leader sends
each tick that fell due in the gap once.** A standby *follows* the schedule, so that when it takes
over it carries on from the current slot instead of "catching up" the slots the old leader
already sent, while remembering what nobody may have sent. How depends on where the wrapped
scheduler keeps its state (:class:`~celery_redlock.celery.kinds.SchedulerKind`):

- *process-local* (``PersistentScheduler``: memory and a local shelve file): the standby runs the
  wrapped bookkeeping too (entries advance, nothing is sent), and keeps each due time it lets pass
  (:class:`~celery_redlock.celery.catchup.CatchUp`, fed by ``_not_sent``) until the leader record
  says the leader sent it: each leader writes there, with every extension, an instant before which
  it sent every tick (``sent_before``, from its tick loop). The beat that takes the lead sends each
  entry still kept, once, for its latest due time and stamped with it (``_catch_up``). A tick the
  dead leader sent in its last moments, after its last record, is sent again with the same stamp,
  which a ``lock_slot`` task runs once (catchup.py says where else that happens);
- *shared* (django-celery-beat's ``DatabaseScheduler``, redbeat's ``RedBeatScheduler``: a database
  or a Redis every beat reads): the store *is* the follow, and a standby must never write it (its
  tick would record runs it never sent, and the leader would then see nothing due). A standby does
  not even set the wrapped scheduler up; whoever takes the lead drops what it may have cached from
  an earlier term, installs the static entries and reads the store afresh (``_take_over``). The
  leader writes each run to the store just before sending it, so a successor finds the runs
  already sent, and a leader that may not send records nothing: a tick that fell due in the gap is
  still due in the store, and the new leader sends it once, late, stamped with its due time.
  (django-celery-beat's setup would move the first tick of a row that never ran past the gap;
  kinds.py keeps it.) A leader stopped between writing a run and sending it loses that one run; it
  never doubles it.

Any other scheduler is refused at start-up unless ``redlock_beat_scheduler_state = "local"`` says
its state is process-local. The standby ticks every ``redlock_beat_standby_interval`` seconds and
tries to take the lock each time: after the leader dies, a standby dispatches within the lock's
TTL plus one standby tick. Validity is checked again just before every message is sent: a leader
with less than ``redlock_beat_min_validity`` seconds left, even after extending its lock once
there, does not send.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Any, ClassVar

from celery.beat import ScheduleEntry, Scheduler

from .._fork import on_fork_in_child
from ..lock.resource import lock_key
from . import hooks
from .aligned import AlignedInterval, alignable, aligned_is_due
from .beatconf import BeatSettings
from .catchup import CatchUp, sent_before
from .leader import (
    LeaderLock,
    Leadership,
    beat_leader_elected,
    beat_leader_lost,
    leader_redlock,
    read_leader,
)
from .slots import render
from .stamp import Stamps, stamped

# Names that moved to the modules above, still importable from here.
__all__ = [
    "BeatSettings",
    "RedlockScheduler",
    "aligned_is_due",
    "beat_leader_elected",
    "beat_leader_lost",
    "leader_redlock",
    "read_leader",
]

logger = logging.getLogger("celery_redlock.beat")

# A standby runs the wrapped tick until nothing is due; this bounds that loop for a schedule
# whose entries claim to be due again at once.
MAX_FOLLOW_STEPS = 1000

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
    # Refused as redlock_beat_scheduler (beatconf reads it): a wrapper must wrap a real scheduler.
    wraps_a_scheduler: ClassVar[bool] = True

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
        self._kind = self.settings.kind
        self._catchup = CatchUp()
        # Before the base class's __init__, which sets the schedule up and asks who leads.
        self._leadership = Leadership(self._redlock, self.settings, self._catchup, sender=self)
        self._stamps = Stamps(self.settings)
        super().__init__(app, *args, **kwargs)
        self._kind.adopt(self)

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
        return self._leadership.leading

    @property
    def _lock(self) -> LeaderLock | None:
        # The lock of the current term, under the name the HA tests have always looked it up by.
        return self._leadership.lock

    def tick(self, *args: Any, **kwargs: Any) -> float:
        self._leadership.confirm()
        if self._leadership.leading:
            return self._lead(*args, **kwargs)
        # A shared store needs no following: it is what the next leader reads.
        delay = self.settings.standby_interval if self._kind.shared else self._follow(*args, **kwargs)
        if self._try_lead():
            return 0.0
        if self._catchup.unsettled:
            self._catchup.read(sent_before(self._leadership.read_records()))
        return min(delay, self.settings.standby_interval)

    def setup_schedule(self) -> None:
        # Installing the static entries writes a shared store: left to whoever takes the lead.
        if self._kind.shared and not self._leadership.leading:
            return
        super().setup_schedule()

    def reserve(self, entry: Any) -> Any:
        # Celery's tick reserves first and sends after; a shared store's write lies in between
        # and may end in the next slot. The slot is taken now, from the clock the tick was found
        # due by, and the send of this entry uses it (apply_async).
        self._stamps.fix(entry)
        if not self._kind.shared:
            return super().reserve(entry)  # a process-local schedule advances, sent or not
        # A run that is not sent must not be recorded in a shared store, or the next leader
        # would take it as sent; it stays due instead.
        if not self._leadership.may_dispatch():
            return entry
        reserved = super().reserve(entry)
        self._kind.reserved(self, reserved)
        # Written now, before the send, as redbeat does by itself (django-celery-beat would write
        # it up to 3 minutes later, or never if it is stopped first): a successor never sends it
        # again. A leader stopped between the two loses that one run; it never doubles it.
        self.sync()
        return reserved

    def sync(self) -> None:
        # A standby has nothing of its own to write (it reserved nothing), and a former leader's
        # unwritten runs were dropped on stepping down; only the leader writes the store.
        if self._kind.shared and not self._leadership.leading:
            return
        super().sync()

    def is_due(self, entry: Any) -> Any:
        spec = entry.schedule
        if not (self.settings.align_intervals and alignable(spec)):
            return super().is_due(entry)
        if type(entry).is_due is ScheduleEntry.is_due:
            return aligned_is_due(spec, entry.last_run_at, self.settings.align_anchor)
        # An entry with checks of its own (django-celery-beat's: enabled, start_time, one_off,
        # expires) keeps them: it is asked as usual, with an aligned stand-in for its schedule
        # for the length of the call, so that only the interval's phase changes.
        entry.schedule = AlignedInterval(spec, self.settings.align_anchor)
        try:
            return super().is_due(entry)
        finally:
            entry.schedule = spec

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        super().populate_heap(*args, **kwargs)
        if not self.settings.align_intervals or not self._heap:
            return
        # The base class places entries by entry.is_due(), not self.is_due(): re-place the
        # aligned ones, or the first run of each would wait for its unaligned time.
        for index, event in enumerate(self._heap):
            entry = event[2]
            if alignable(entry.schedule):
                due, delay = self.is_due(entry)
                self._heap[index] = event._replace(time=self._when(entry, 0 if due else delay))
        heapq.heapify(self._heap)

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        if not self._leadership.may_dispatch():
            self._not_sent(entry, self._stamps.take(entry))
            return
        super().apply_entry(entry, producer=producer)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        # Checked here too, right before the message goes out: some schedulers call apply_async
        # directly, and time passes between apply_entry and the send.
        if not self._leadership.may_dispatch():
            if advance:
                self.reserve(entry)
            self._not_sent(entry, self._stamps.take(entry))
            return None
        if advance:
            # Reserved here, not by the base class: it would reserve the entry with the stamp
            # in its options, and a scheduler that stores its entries would store the stamp.
            self.reserve(entry)  # fixes the slot, from last_run_at as it was before this run
        fire = self._stamps.take(entry)
        # The write to a shared store may have outlasted the lock: checked again, so a leader
        # that lost it meanwhile sends nothing (the run is recorded, not doubled).
        if advance and not self._leadership.may_dispatch():
            self._not_sent(entry, fire)
            return None
        with stamped(entry, fire):
            return super().apply_async(entry, producer=producer, advance=False, **kwargs)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._leadership.resign()
            self._redlock.close()

    # -- leading and following -------------------------------------------------------------------------
    def _not_sent(self, entry: Any, fire: float | None) -> None:
        if not self._kind.shared:
            # The process-local entry advanced all the same: the due time is kept, to be sent by
            # whoever leads next unless a leader says it sent it (a shared store keeps it due).
            self._catchup.skip(entry.name, time.time() if fire is None else fire)
        if self._leadership.leading:
            logger.warning(
                "%s not sent: the leader lock has %.2f s of validity left, below "
                "redlock_beat_min_validity (%g s), and could not be extended",
                entry.name,
                self._leadership.validity,
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

    def _lead(self, *args: Any, **kwargs: Any) -> float:
        if self._kind.shared:
            delay: float = super().tick(*args, **kwargs)
            return delay
        self._catch_up()
        started = time.time()
        delay = super().tick(*args, **kwargs)
        if delay is not None and delay > 0:
            # Nothing more was due: every tick due before now + delay has been handled.
            self._catchup.swept(started + delay)
        return delay

    def _catch_up(self) -> None:
        """Send, once each, the entries whose latest due time nobody is known to have sent (on
        taking the lead; or after this leader had too little validity left to send one)."""
        for name, due in sorted(self._catchup.take().items(), key=lambda item: item[1]):
            entry = self.schedule.get(name)
            if entry is None:
                continue  # no longer in the schedule
            logger.warning(
                "%s fell due at %s and no leader is known to have sent it; sending it now",
                name,
                render(due),
            )
            # Reserved as a tick reserves (the run written to a shared store before the send,
            # a local entry advanced), then stamped with the due time it was let pass for.
            self.reserve(entry)
            self._stamps.fix_at(entry, due)
            self.apply_entry(entry, producer=self.producer)

    def _try_lead(self) -> bool:
        lock = self._leadership.acquire()
        if lock is None:
            return False
        if self._kind.shared and not self._take_over():
            return False
        self._leadership.elected(lock)
        return True

    def _take_over(self) -> bool:
        """Set the wrapped scheduler up from its shared store, as it stands now; on failure (the
        store unreachable), give the lock back and stay a standby."""
        try:
            self._kind.forget(self)
            self._kind.before_setup(self)
            super().setup_schedule()
        except Exception:
            logger.exception(
                "beat: could not read the %s schedule on taking the lead; giving the leader lock back",
                self._kind.name,
            )
            self._leadership.give_back()
            return False
        return True
