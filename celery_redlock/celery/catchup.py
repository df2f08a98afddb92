"""The ticks that fell due while nobody led, and what a new leader sends for them.

For a process-local schedule (``PersistentScheduler``) a standby follows by advancing entries of
its own; it cannot see what the leader sent. A run it let pass is therefore never counted as
sent: :class:`CatchUp` keeps, per entry, the latest due time this beat let pass without sending
(a standby's, or a leader's that had too little validity left), until a leader is known to have
sent it. What a leader knows, it says in its leader record, rewritten with every extension of its
lock: ``sent_before``, an instant before which every tick that fell due was sent
(:meth:`CatchUp.claim`). A standby reads the record while it has a due time not yet covered, and
drops the due times the record covers.

On taking the lead, a beat sends each entry it still holds a due time for, once, for the latest
such due time, stamped with it (the ``redlock_slot`` header): the ticks that fell due between the
last ``sent_before`` it read and its election, that is, while no live leader was known to send.
An entry with several such due times is sent once, for the latest, as celery's own beat does
after a restart.

Why ``sent_before`` is what it is:

- It comes from the leader's tick loop, not from its heartbeat: a leader alive at an extension
  may still be on its way to a tick due a moment before. The loop claims a sweep once the
  wrapped tick has nothing more due (the sweep's start plus the delay the tick asked for:
  nothing falls due before then), never past now, and never past a due time it let pass itself.
- It is read in the leader's own clock, against due times that are instants (crontab, solar,
  aligned intervals): the leader sent a tick due at ``D`` when its clock passed ``D`` in a sweep,
  whatever the skew between its host and the standby's.

Where this sends a tick twice: a leader that dies had sent the ticks due between its last
extension and its death without saying so, and its successor sends the latest of them again;
likewise a successor that dies before its first extension after its catch-up, a standby that
missed the last record of a leader that resigned (``redlock_beat_min_validity`` below
``redlock_beat_standby_interval``), and a leader that writes no ``sent_before`` (an earlier
release). Both copies carry the same slot stamp, so a ``lock_slot`` task runs it once; a task
without ``lock_slot`` runs it twice. Due times of unaligned intervals count from each beat's own
start, so a caught-up interval tick may come within a period of the old leader's last send (see
``redlock_beat_align_intervals``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

#: The field of the leader record that carries the leader's ``sent_before``.
RECORD_FIELD = "sent_before"


class CatchUp:
    """One beat's account of the ticks nobody may have sent (process-local schedules only)."""

    def __init__(self) -> None:
        self._due: dict[str, float] = {}  # entry name -> latest due time not known to be sent
        self._known: float | None = None  # the latest sent_before a leader claimed
        self._swept: float | None = None  # while leading: this term's sweeps reached this far

    # -- a standby's side ------------------------------------------------------------------------
    def skip(self, name: str, due: float) -> None:
        """Entry ``name`` fell due at ``due`` and this beat did not send it."""
        if self._known is not None and due < self._known:
            return
        if due > self._due.get(name, -math.inf):
            # A new dict rather than a change in place: the heartbeat thread reads it (claim).
            self._due = {**self._due, name: due}

    def read(self, sent_before: float | None) -> None:
        """A leader's record said ``sent_before`` (None: it said nothing)."""
        if sent_before is None or (self._known is not None and sent_before <= self._known):
            return
        self._known = sent_before
        self._due = {name: due for name, due in self._due.items() if due >= sent_before}

    @property
    def unsettled(self) -> bool:
        """Whether some due time is not yet known to be sent: the leader record is worth reading."""
        return bool(self._due)

    def take(self) -> dict[str, float]:
        """On leading: each entry to send now, with the due time to stamp it with; forgotten here
        (a send that does not happen after all is skipped again)."""
        due, self._due = self._due, {}
        return due

    # -- a leader's side -------------------------------------------------------------------------
    def start_term(self) -> None:
        """Took the lead: nothing is claimed until this term's first sweep."""
        self._swept = None

    def swept(self, until: float) -> None:
        """The tick loop has handled every tick due before ``until``."""
        if self._swept is None or until > self._swept:
            self._swept = until

    def claim(self, now: float) -> float | None:
        """The leader's ``sent_before`` at ``now``; None before its first sweep."""
        if self._swept is None:
            return None
        # A due time this beat let pass itself (validity too short) holds the claim back until
        # the leader's next tick sends it.
        return min(now, self._swept, *self._due.values())


def sent_before(records: Iterable[bytes | str | None]) -> float | None:
    """The latest ``sent_before`` among the copies of the leader record read from the masters.

    One copy is enough: only a leader writes the record, and what a leader once claimed stays
    true. A copy without the field (an earlier release, a leader before its first sweep) or not
    readable says nothing.
    """
    latest: float | None = None
    for raw in records:
        if raw is None:
            continue
        try:
            value = json.loads(raw).get(RECORD_FIELD)
        except (ValueError, AttributeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            latest = value if latest is None else max(latest, value)
    return latest
