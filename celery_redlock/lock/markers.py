"""Markers: a resource's lock taken before the work exists, then handed over to the work's lock.

A *marker* is a lock value (``<40 hex random>|<holder text>``, as any lock stores) set on a
quorum of masters by the usual validity rules, but held by no :class:`~.resource.Lock` object:
whoever sets it passes its value on (the Celery layer puts it in the message it publishes, see
``celery_redlock.celery.enqueue``), and the work that later runs presents that value to take the
key over.

A marker belongs to its *owner* (the Celery layer: the task that placed it). It sits on the lock
key when that is free; while another holder has the lock key, it waits beside it on the owner's
own *side key* (:func:`side_key`), so that the owner is still told "already queued" by its own
marker, and another owner never is.

- :func:`place` sets a marker on the lock key (PLACE, one round, like
  ``Lock.acquire(blocking=False)``), and says, when refused, what it found: the owner's own
  marker beside the key, or the lock key's holder; :func:`place_beside` sets it on the side key
  (BESIDE) while the holder read is still there. A failed attempt is retracted on every master
  that may hold it.
- :func:`keep` extends a placed marker to its full TTL and marks it published (a marker is placed
  for the short time its message needs to reach the broker, see the Celery layer, and kept once
  it has): it swaps the value for its :func:`published` form, whose holder record says so.
- :class:`HandoverLock` is a Lock whose acquire is HANDOVER (see ``scripts.py``): it takes the key
  when it is free *or* holds the marker it was given, in one step on each master, deleting the
  marker from the side key in that step. The key is never free on a master between the marker
  and the lock (no gap), and the lock is never refused by its own marker, in either of its forms
  (placed, or kept as published): no self-block. An
  attempt that no quorum granted puts the marker back (beside the key) where it took it, so a
  message whose run is refused stays marked. Extension and release are a plain lock's.
- :func:`hand_back` swaps a held lock's token for a new marker (REQUEUE): the work re-published
  itself (a retry) and the new message must find the key kept for it.
- :func:`drop` deletes a marker by its value (the message it was taken for will not run).

Knows nothing of Celery.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from ..errors import Vote
from . import scripts, wire
from .commands import PLAIN, milliseconds
from .holder import parse
from .resource import HOLDER_SEPARATOR, Lock, lock_key
from .tally import is_one
from .transport.commands import Command, Outcome, script_template

logger = logging.getLogger("celery_redlock.markers")

if TYPE_CHECKING:
    from .fair import Entry
    from .redlock import Redlock

REQUEUE = script_template(scripts.REQUEUE, 1, 3)  # key token marker <ms>
HANDOVER_RETRACT = script_template(scripts.HANDOVER_RETRACT, 2, 3)  # key side token marker <ms>
HANDOVER_TIDY = script_template(scripts.HANDOVER_TIDY, 2, 3)  # key side token marker published
PLACE = script_template(scripts.PLACE, 2, 2)  # key side marker <ms>
BESIDE = script_template(scripts.BESIDE, 2, 3)  # side key marker <ms> holder-read
# What the side key of an owner is named: the lock key, this, then the owner's name.
SIDE_SEPARATOR = "~enqueued:"
# PLACE and BESIDE answer a refusal with {kind, value}: the owner's own marker beside the key...
_BESIDE = 1
# ... or the lock key's value (another holder's).
_HOLDER = 2


class Placed(NamedTuple):
    """One attempt to set a marker.

    ``value`` is the marker's value if a quorum granted it (else None), and ``key`` the key it
    was set on: the lock key or the owner's side key. A refused attempt says what a quorum of
    masters answered instead: ``beside``, the value of the owner's own marker on its side key;
    ``holder``, the lock key's value (another holder's; "" when it is not a plain lock). Neither,
    when the masters did not agree (a split vote, a master down).
    """

    value: str | None
    key: str | None
    votes: list[Vote]
    validity: float
    elapsed: float
    beside: str | None = None
    holder: str | None = None


def new_value(holder: str) -> str:
    """A fresh marker value: 20 random bytes in hex, then the holder text (one line)."""
    if "\n" in holder or "\r" in holder:
        raise ValueError(f"holder must be one line, got {holder!r}")
    return os.urandom(20).hex() + HOLDER_SEPARATOR + holder


def side_key(prefix: str, name: str, owner: str) -> str:
    """The key ``owner``'s marker for resource ``name`` waits on while another holds the lock."""
    return lock_key(prefix, name) + SIDE_SEPARATOR + owner


def place(redlock: Redlock, name: str, side: str, value: str, ttl: float) -> Placed:
    """Set ``value`` as the marker of resource ``name`` for ``ttl`` seconds if the lock key is
    free and the owner's ``side`` key is too, on a quorum; one round (its retraction, when it
    fails, rides on the same links)."""
    key = lock_key(redlock.key_prefix, name)
    command = PLACE.pack(key, side, value, milliseconds(redlock.check_ttl("ttl", ttl)))
    seen: list[Outcome] = []
    validity, votes, elapsed = redlock.try_acquire(
        key, value, ttl, acquires=[command] * len(redlock.masters), seen=seen
    )
    if validity > 0:
        return Placed(value, key, votes, validity, elapsed)
    return Placed(
        None, None, votes, validity, elapsed, _agreed(redlock, seen, _BESIDE), _agreed(redlock, seen, _HOLDER)
    )


def place_beside(redlock: Redlock, name: str, side: str, value: str, ttl: float, holder: str) -> Placed:
    """Set ``value`` as the owner's marker on its ``side`` key for ``ttl`` seconds, on a quorum
    of the masters whose lock key of ``name`` still holds ``holder`` (the value :func:`place`
    found there); one round. Refused: ``beside`` names the owner's own marker found there."""
    key = lock_key(redlock.key_prefix, name)
    command = BESIDE.pack(side, key, value, milliseconds(redlock.check_ttl("ttl", ttl)), holder)
    seen: list[Outcome] = []
    validity, votes, elapsed = redlock.try_acquire(
        side,
        value,
        ttl,
        acquires=[command] * len(redlock.masters),
        retraction=PLAIN.release.pack(side, value),
        seen=seen,
    )
    if validity > 0:
        return Placed(value, side, votes, validity, elapsed)
    return Placed(None, None, votes, validity, elapsed, _agreed(redlock, seen, _BESIDE))


def _agreed(redlock: Redlock, outcomes: Sequence[Outcome], kind: int) -> str | None:
    """The value a quorum of refusals of ``kind`` answered, if they agree on one."""
    counts: dict[bytes, int] = {}
    for outcome in outcomes:
        reply = outcome.value
        if outcome.kind == "ok" and isinstance(reply, list) and len(reply) == 2 and reply[0] == kind:
            found = reply[1] if isinstance(reply[1], bytes) else b""
            counts[found] = counts.get(found, 0) + 1
    for found, count in counts.items():
        if count >= redlock.quorum:
            return found.decode("utf-8", "surrogateescape")
    return None


def published(value: str) -> str:
    """The form :func:`keep` gives the marker ``value`` once its work is published: the same
    token, its holder record with ``published`` set. A holder text that is no record (a label of
    one's own) is its own published form. One rule, used by every side that compares a marker."""
    token, separator, text = value.partition(HOLDER_SEPARATOR)
    record = parse(text)
    if record is None or record.published:
        return value
    return token + separator + dataclasses.replace(record, published=True).to_text()


def keep(redlock: Redlock, key: str, value: str, ttl: float) -> tuple[bool, list[Vote]]:
    """The work the marker ``value`` on ``key`` was placed for is published: swap it for its
    :func:`published` form with ``ttl`` seconds from now, where it still is (REQUEUE, compared on
    the whole value: a marker that expired or was taken over is not brought back); whether a
    quorum did, and every master's vote (a refusal is a master that no longer holds ``value``).
    Until then the marker names work nothing is known to carry."""
    return _requeue(redlock, key, value, published(value), ttl)


def drop(redlock: Redlock, name: str, value: str, side: str | None = None) -> list[str]:
    """Delete the marker ``value`` of resource ``name`` wherever it still is, on the lock key and
    on the owner's ``side`` key if given (compare-and-delete, one round, replies waited for, so
    the next publish of the resource does not find it): a key already handed over or expired is
    left alone. Both forms of the marker (as placed, and :func:`published`).

    INVARIANT (a dropped marker is gone, or said not to be): a marker left behind answers every
    later publish of the resource with the id of a message that will never run, until its TTL
    (an hour by default) runs out. The masters that did not confirm the delete are logged at
    WARNING, naming them and the marker, and returned (empty: deleted, or absent, everywhere).
    A slow master's delete is already on its link and takes effect when it answers; one that
    could not be reached keeps the marker until its TTL."""
    key = lock_key(redlock.key_prefix, name)
    forms = dict.fromkeys((value, published(value)))
    batch = [PLAIN.release.pack(where, form) for where in (key, side) if where is not None for form in forms]
    with redlock._round() as rnd:
        replies = rnd.call_many([batch] * len(redlock.masters), redlock.request_timeout)
    names = [
        master.name
        for master, mine in zip(redlock.masters, replies, strict=True)
        if any(outcome.kind != "ok" for outcome in mine)
    ]
    if names:
        logger.warning(
            "marker of %s (%s) not confirmed deleted by %d of %d masters: %s; while it is still "
            "on a quorum, publishes of %s are deduplicated against a message that will not run",
            name,
            value.partition(HOLDER_SEPARATOR)[2] or value[:12],
            len(names),
            len(redlock.masters),
            ", ".join(names),
            name,
        )
    return names


def hand_back(redlock: Redlock, key: str, token: str, value: str, ttl: float) -> bool:
    """Swap the lock ``token`` holds on ``key`` for the marker ``value`` with ``ttl`` seconds, on
    every master that still holds the token; True if a quorum did."""
    return _requeue(redlock, key, token, value, ttl)[0]


def _requeue(redlock: Redlock, key: str, token: str, value: str, ttl: float) -> tuple[bool, list[Vote]]:
    command = REQUEUE.pack(key, token, value, milliseconds(redlock.check_ttl("ttl", ttl)))
    with redlock._round() as rnd:
        outcomes = rnd.call([command] * len(redlock.masters), redlock.request_timeout)
    votes, swapped = redlock.tally.votes(outcomes, is_one)
    return swapped >= redlock.quorum, votes


class HandoverLock(Lock):
    """A plain lock that takes its key over from the marker ``marker`` (a value :func:`place`
    set, in either form: as placed, or as :func:`keep` made it :func:`published`), or takes it
    free as any lock does; with ``side``, the owner's side key, a marker :func:`place_beside`
    set there is deleted by the same step that takes the key.

    Every attempt, the first and a waiting one's alike, is HANDOVER: a waiting attempt that
    took a plain ``SET NX`` instead would be refused by its own marker on the masters a failed
    first attempt did not reach, and wait out the marker's TTL. Refusals answer the holder's
    PTTL, as a waiting plain lock's do. A failed attempt is retracted by HANDOVER_RETRACT, which
    sets the marker beside the key again where the attempt had taken it (see :meth:`_retraction`).
    """

    def __init__(
        self,
        redlock: Redlock,
        name: str,
        ttl: float | None = None,
        *,
        marker: str,
        side: str | None = None,
        timeout: float | None = None,
        blocking: bool = True,
        holder: str = "",
    ) -> None:
        super().__init__(redlock, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        # The marker's value (and the side key it may wait on) are fixed for this lock: packed
        # once into its acquire command, between the key, token and TTL each attempt fills in.
        keys = (wire.SLOT,) if side is None else (wire.SLOT, side)
        self._published = published(marker)
        take = script_template(scripts.HANDOVER, keys, (wire.SLOT, wire.SLOT, marker, self._published))
        self._commands = dataclasses.replace(PLAIN, acquire=take)
        self._waiting_commands = self._commands
        self.marker = marker
        self._side = side
        # When the marker runs out (epoch seconds, from its holder record: its publish time and
        # TTL); its side-key copy that a failed attempt puts back lasts no longer.
        record = parse(marker.partition(HOLDER_SEPARATOR)[2])
        self._marker_ends: float | None = None
        if record is not None and record.since is not None and record.ttl is not None:
            self._marker_ends = record.since + record.ttl

    def _attempt(
        self, token: str, waiting: bool, expiry: list[float], entry: Entry | None
    ) -> tuple[float, list[Vote], float]:
        """One HANDOVER attempt; failed, it gives the marker back (see :meth:`_retraction`)."""
        if waiting:
            expiry.clear()
        return self.redlock.try_acquire(
            self.key,
            token,
            self.ttl,
            self._commands,
            expiry if waiting else None,
            undo=self._retraction(token, entry),
            tidy=self._tidy(token),
        )

    def _tidy(self, token: str) -> Command:
        """What a granted attempt sends to the masters that did not grant it: HANDOVER_TIDY,
        which deletes the marker there, on the lock key or beside it (see scripts.py), and
        retracts a late grant. Without a side key (no owner known) the marker's key is the
        lock key alone, and its ``side`` is a name no marker is ever set on."""
        side = self._side if self._side is not None else self.key + SIDE_SEPARATOR
        return HANDOVER_TIDY.pack(self.key, side, token, self.marker, self._published)

    def _retraction(self, token: str, entry: Entry | None) -> Command | None:
        """What a failed attempt sends where it may have taken the key: HANDOVER_RETRACT, which
        deletes the token and sets the marker beside the key again. A failed attempt took over
        (or deleted beside the key) the marker on the masters that granted it: retracted by a
        plain release, those masters would hold no marker, and a few split attempts (the run and
        another task's contending as the key is freed) leave fewer than a quorum marked while
        the message still waits: its task's next publish is then accepted, a duplicate. Without
        a side key (no owner known), a plain release."""
        if self._side is None:
            return None
        left = self.ttl if self._marker_ends is None else self._marker_ends - time.time()
        # Put back as published: this run's message was.
        return HANDOVER_RETRACT.pack(
            self.key, self._side, token, self._published, milliseconds(max(left, 0.0))
        )
