"""Aligned interval schedules (``redlock_beat_align_intervals``): ticks at ``anchor + k*T``
instead of ``T`` after the previous run.

Interval schedules keep celery's meaning by default: a tick ``T`` after the previous run. With
``redlock_beat_align_intervals`` they fire at ``anchor + k*T`` instead
(``redlock_beat_align_anchor``, the epoch by default), which is opt-in because it changes what an
interval means (a 7-day interval on the epoch's grid fires on Thursdays, 00:00 UTC).

Why the slot stamp does not make alignment unnecessary for HA: the stamp says which tick *a
sender* meant, but without alignment each beat's interval ticks count from its own start, so the
leader and a standby mean different instants by "the next tick". After a handover the new
leader's first tick comes at its own phase: anything from just after the old leader's last send
to a whole period later. Both sends carry honest, different stamps, so the worker runs both; what
was one tick per period becomes two in one period (or a gap nearly twice as long). Aligned, every
beat has the same boundaries: the standby follows the leader's ticks exactly, its first send is
the boundary after the leader's last, and the stamps of successive leaders agree (the HA tests
count slots this way). crontab and solar entries need no alignment: their fire times are the same
for every beat, and so are their stamps.
"""

from __future__ import annotations

import math
from typing import Any

from celery.schedules import schedstate, schedule


def alignable(spec: object) -> bool:
    """Whether ``spec`` is an interval this beat aligns when asked to."""
    # Only celery's own interval schedule: a subclass with its own is_due keeps its own rule.
    return (
        isinstance(spec, schedule)
        and type(spec).is_due is schedule.is_due
        and not spec.relative
        and spec.seconds > 0
    )


def aligned_is_due(spec: Any, last_run_at: Any, anchor: float = 0.0) -> Any:
    """``schedule.is_due`` with the ticks at ``anchor + k * period`` (``anchor`` in seconds since
    the epoch): due once a boundary has passed since the last run."""
    period = float(spec.seconds)
    now = spec.now().timestamp() - anchor
    last = spec.maybe_make_aware(last_run_at).timestamp() - anchor
    remaining = (math.floor(now / period) + 1) * period - now
    return schedstate(math.floor(now / period) > math.floor(last / period), remaining)


class AlignedInterval(schedule):  # type: ignore[misc]
    """An interval schedule whose ticks are at ``anchor + k * period`` (see aligned_is_due):
    what an entry with its own is_due is given to ask, for one call."""

    def __init__(self, spec: Any, anchor: float) -> None:
        super().__init__(run_every=spec.run_every, relative=False, nowfun=spec.nowfun, app=spec.app)
        self._anchor = anchor

    def is_due(self, last_run_at: Any) -> Any:
        return aligned_is_due(self, last_run_at, self._anchor)
