"""The slot stamp of each message the beat leader sends: the due time it was fired for.

Every message the leader sends carries that due time (header ``redlock_slot``, see
:func:`celery_redlock.celery.slots.intended_fire`), so a ``lock_slot`` task places it without
guessing from the publish time. It is fixed when the entry is *reserved* (found due), not when
the message goes out: for a scheduler with a shared store, celery's tick reserves first and sends
after, and the write to the store in between may end in the next slot.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .aligned import alignable
from .beatconf import BeatSettings
from .slots import SLOT_HEADER, intended_fire, render

logger = logging.getLogger("celery_redlock.beat")


def _timestamp(spec: Any, value: Any) -> float:
    # A naive datetime is read as celery reads it: in UTC (maybe_make_aware's default).
    aware = spec.maybe_make_aware(value) if hasattr(spec, "maybe_make_aware") else value
    return float(aware.timestamp())


def _estimated_fire(spec: Any, last_run_at: Any, last: float | None, now: float) -> float:
    """The due time a schedule of a kind not known to :func:`intended_fire` fired for, by its
    own ``remaining_estimate`` (how far past due it is now); the send time where that gives
    nothing usable, so that successive sends of the entry still get successive slots."""
    estimate = getattr(spec, "remaining_estimate", None)
    if estimate is not None and last_run_at is not None:
        fire = now + float(estimate(last_run_at).total_seconds())
        if (last is None or fire > last) and fire <= now:
            return fire
    return now


def due_now(entry: Any, settings: BeatSettings) -> float | None:
    """The due time (the slot, :data:`SLOT_HEADER`) of the tick ``entry`` is sent for now;
    None if it cannot be known, and the message then goes without it (the worker falls back to
    the publish time) rather than not at all."""
    spec = entry.schedule
    try:
        now = _timestamp(spec, spec.now())
        last = None if entry.last_run_at is None else _timestamp(spec, entry.last_run_at)
        anchor = settings.align_anchor if settings.align_intervals and alignable(spec) else None
        fire = intended_fire(spec, last, now, anchor=anchor)
        if fire is None:
            fire = _estimated_fire(spec, entry.last_run_at, last, now)
    except Exception:
        logger.warning(
            "%s: the slot it is due for cannot be computed; sent unstamped", entry.name, exc_info=True
        )
        return None
    return fire


class Stamps:
    """The entry last reserved and the due time it was found due for, until its send takes it."""

    def __init__(self, settings: BeatSettings) -> None:
        self._settings = settings
        self._held: tuple[Any, float | None] | None = None

    def fix(self, entry: Any) -> None:
        """``entry`` was reserved: its send is for the due time it is found due for now."""
        self._held = (entry, due_now(entry, self._settings))

    def fix_at(self, entry: Any, due: float) -> None:
        """``entry`` was reserved to send a tick let pass earlier: its send is for ``due``."""
        self._held = (entry, due)

    def take(self, entry: Any) -> float | None:
        """The due time ``entry`` is sent for: the one its reservation fixed, or, without a
        reservation of ours (a caller's own apply_async), the one it is due for now."""
        held, self._held = self._held, None
        if held is not None and held[0] is entry:
            return held[1]
        return due_now(entry, self._settings)


@contextmanager
def stamped(entry: Any, due: float | None) -> Iterator[None]:
    """For the length of one send, ``entry``'s options carry the slot header for ``due``.

    Every wrapped scheduler sends through the base ``apply_async``, which passes the entry's
    options to the task's ``apply_async``; put back afterwards, so that a scheduler that stores
    its entries never stores the stamp.
    """
    if due is None:
        yield
        return
    options = entry.options
    entry.options = {**options, "headers": {**(options.get("headers") or {}), SLOT_HEADER: render(due)}}
    try:
        yield
    finally:
        entry.options = options
