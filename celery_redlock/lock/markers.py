"""Markers: a resource's lock taken before the work exists, then handed over to the work's lock.

A *marker* is a lock value (``<40 hex random>|<holder text>``, as any lock stores) set on a
quorum of masters with the usual ``SET NX PX`` and the usual validity rules, but held by no
:class:`~.resource.Lock` object: whoever sets it passes its value on (the Celery layer puts it in
the message it publishes, see ``celery_redlock.celery.enqueue``), and the work that later runs
presents that value to take the key over.

- :func:`place` sets a marker (one round, like ``Lock.acquire(blocking=False)``); a failed
  attempt is retracted on every master that may hold it.
- :class:`HandoverLock` is a Lock whose acquire is HANDOVER (see ``scripts.py``): it takes the key
  when it is free *or* holds the marker it was given, in one step on each master. The key is
  never free on a master between the marker and the lock (no gap), and the lock is never refused
  by its own marker (no self-block). Extension and release are a plain lock's.
- :func:`hand_back` swaps a held lock's token for a new marker (REQUEUE): the work re-published
  itself (a retry) and the new message must find the key kept for it.
- :func:`drop` deletes a marker by its value (the message it was taken for will not run).

Knows nothing of Celery.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, NamedTuple

from ..errors import Vote
from . import scripts, wire
from .commands import PLAIN, milliseconds
from .masters import script_template
from .resource import HOLDER_SEPARATOR, Lock, lock_key

if TYPE_CHECKING:
    from .redlock import Redlock

REQUEUE = script_template(scripts.REQUEUE, 1, 3)  # key token marker <ms>


class Placed(NamedTuple):
    """One attempt to set a marker: its value if a quorum granted it (else None), and the vote."""

    value: str | None
    votes: list[Vote]
    validity: float
    elapsed: float


def new_value(holder: str) -> str:
    """A fresh marker value: 20 random bytes in hex, then the holder text (one line)."""
    if "\n" in holder or "\r" in holder:
        raise ValueError(f"holder must be one line, got {holder!r}")
    return os.urandom(20).hex() + HOLDER_SEPARATOR + holder


def place(redlock: Redlock, name: str, value: str, ttl: float) -> Placed:
    """Set ``value`` as the marker of resource ``name`` for ``ttl`` seconds, if the key is free
    on a quorum; one round (its retraction, when it fails, rides on the same links)."""
    key = lock_key(redlock.key_prefix, name)
    validity, votes, elapsed = redlock.try_acquire(key, value, redlock.check_ttl("ttl", ttl))
    return Placed(value if validity > 0 else None, votes, validity, elapsed)


def drop(redlock: Redlock, name: str, value: str) -> None:
    """Delete the marker ``value`` of resource ``name`` wherever it still is (compare-and-delete,
    sent at once and not waited for): a key already handed over or expired is left alone."""
    redlock.release_key(lock_key(redlock.key_prefix, name), value, linger=False)


def hand_back(redlock: Redlock, key: str, token: str, value: str, ttl: float) -> bool:
    """Swap the lock ``token`` holds on ``key`` for the marker ``value`` with ``ttl`` seconds, on
    every master that still holds the token; True if a quorum did."""
    command = REQUEUE.pack(key, token, value, milliseconds(redlock.check_ttl("ttl", ttl)))
    with redlock._round() as rnd:
        outcomes = rnd.call([command] * len(redlock.masters), redlock.request_timeout)
    return sum(1 for o in outcomes if o.kind == "ok" and o.value == 1) >= redlock.quorum


class HandoverLock(Lock):
    """A plain lock that takes its key over from the marker ``marker`` (a value :func:`place`
    set), or takes it free as any lock does.

    Every attempt, the first and a waiting one's alike, is HANDOVER: a waiting attempt that
    took a plain ``SET NX`` instead would be refused by its own marker on the masters a failed
    first attempt did not reach, and wait out the marker's TTL. Refusals answer the holder's
    PTTL, as a waiting plain lock's do.
    """

    def __init__(
        self,
        redlock: Redlock,
        name: str,
        ttl: float | None = None,
        *,
        marker: str,
        timeout: float | None = None,
        blocking: bool = True,
        holder: str = "",
    ) -> None:
        super().__init__(redlock, name, ttl, timeout=timeout, blocking=blocking, holder=holder)
        # The marker's value is fixed for this lock: packed once into its acquire command.
        take = wire.Template(("EVAL", scripts.HANDOVER.source, 1, wire.SLOT, wire.SLOT, wire.SLOT, marker))
        self._commands = dataclasses.replace(PLAIN, acquire=take)
        self._waiting_commands = self._commands
        self.marker = marker
