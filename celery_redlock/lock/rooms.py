"""The rules of waiting woken by the release, with no I/O: who waits, which notice wakes whom,
and how long a refused waiter sleeps.

The threaded :mod:`.subscriber` (a thread, blocking links) and the asyncio one
(``aio.subscriber``: a task, asyncio links) keep these rooms over links of their own; the
threaded ``Lock`` and the ``AsyncLock`` plan their sleeps with :func:`plan`. One copy of each rule.

Words: a *notice* is one master's message "I just deleted this key" (the release scripts
``PUBLISH`` on a channel named after the key, in the step that deletes it: ``*``, or a fair
lock's new head's member, see :mod:`.scripts`); a *room* is one process's subscription to one
key's channel together with its local *waiters*; a master's subscription to a room is
*confirmed* once the master acknowledged the SUBSCRIBE.

INVARIANT (no waiter sleeps through a release it did not see): a waiter relies only on masters
whose subscription was confirmed before its latest attempt began (:func:`mark`), and counts
only notices that arrived after that. A confirmed master publishes every deletion of the key,
so each deletion after the attempt reached the master is followed by a notice. A notice can
still be lost (the listening link dropped, the master was blackholed): the sleep is then bounded
by the fallback poll (:func:`plan`), and every (re)subscription counts as a notice from that
master to every waiter of the room (:func:`confirm`), since anything may have happened while it
was not listening.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import Vote
from . import wire

if TYPE_CHECKING:
    from .settings import Settings


class Waiter:
    """One blocked acquisition's place in a room: the masters it was noticed by since its mark."""

    __slots__ = ("confirmed", "credits", "member", "refusers")

    def __init__(self, member: bytes | None = None) -> None:
        # A fair waiter's member (see fair.py): it is woken only by notices naming it (or '*');
        # any other waiter by every notice.
        self.member = member
        self.credits: set[int] = set()
        # The masters whose refusal the waiter waits to see end (None: any master, until its
        # attempt says which refused), and those confirmed before its attempt began.
        self.refusers: frozenset[int] | None = None
        self.confirmed: frozenset[int] = frozenset()

    def woken(self, refusers: frozenset[int], needed: int) -> bool:
        """Whether notices from ``needed`` of ``refusers`` came since the mark."""
        return len(self.credits & refusers) >= needed


class Room:
    """One key's channel in one process: its waiters, and the masters that confirmed it."""

    __slots__ = ("confirmed", "empty_since", "key", "waiters")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.waiters: list[Waiter] = []
        self.confirmed: set[int] = set()  # masters that acknowledged the SUBSCRIBE
        self.empty_since: float | None = None


def enter(rooms: dict[bytes, Room], channel: bytes, member: str | None) -> tuple[Room, Waiter]:
    """A new waiter in ``channel``'s room (made if there is none); a fair waiter has its
    ``member``. The caller then has the room subscribed and waits for its confirmations."""
    waiter = Waiter(None if member is None else member.encode())
    room = rooms.get(channel)
    if room is None:
        room = rooms[channel] = Room(channel)
    room.waiters.append(waiter)
    room.empty_since = None
    return room, waiter


def mark(room: Room | None, waiter: Waiter) -> None:
    """Just before an attempt: notices before this point are forgotten; the masters confirmed
    now are those the attempt may rely on."""
    waiter.credits.clear()
    waiter.refusers = None
    waiter.confirmed = frozenset(room.confirmed) if room is not None else frozenset()


def sleep_bound(
    waiter: Waiter, refusers: frozenset[int], needed: int, until: float, deaf_until: float
) -> float:
    """When a sleep for ``needed`` notices of ``refusers`` must end at the latest. When fewer
    than ``needed`` refusers were confirmed listeners at the mark, their notices cannot all
    come: the sleep ends by ``deaf_until`` (a poll's delay), so a waiter without listeners is
    never slower than a polling one."""
    waiter.refusers = refusers
    if len(refusers & waiter.confirmed) < needed:
        return min(until, deaf_until)
    return until


def confirm(room: Room, i: int) -> None:
    """Master i acknowledged the room's SUBSCRIBE: whatever happened before it listened is
    unknown, so it counts as a notice to every waiter."""
    room.confirmed.add(i)
    for waiter in room.waiters:
        waiter.credits.add(i)


def notice(room: Room, i: int, payload: bytes) -> None:
    """A release notice from master i: one credit to the earliest waiter of the room that can
    use it, only (20 waiters of one process on one name cost one attempt per release, not 20)."""
    named = payload if payload != b"*" else None  # a fair release names the new head
    for waiter in room.waiters:
        if named is not None and waiter.member is not None and waiter.member != named:
            continue
        if i not in waiter.credits and (waiter.refusers is None or i in waiter.refusers):
            waiter.credits.add(i)
            return


def deaf(rooms: Iterable[Room], i: int) -> None:
    """Master i's listening link is gone: no room may rely on it until it confirms again."""
    for room in rooms:
        room.confirmed.discard(i)


def dispatch(rooms: dict[bytes, Room], i: int, push: Any) -> str:
    """Apply one push from master i's listening link to the rooms; what the link's keeper must
    handle itself: ``"pong"``, ``"error"`` (a refusal, e.g. NOPERM for SUBSCRIBE), else ``""``."""
    if push == b"PONG":  # a link with nothing subscribed answers PING as any connection does
        return "pong"
    if not isinstance(push, list) or not push:
        return "error" if isinstance(push, wire.ReplyError) else ""
    kind = push[0]
    if kind == b"message" and len(push) == 3:
        room = rooms.get(push[1])
        if room is not None:
            notice(room, i, push[2])
    elif kind == b"subscribe" and len(push) == 3:
        room = rooms.get(push[1])
        if room is not None:
            confirm(room, i)
    elif kind == b"pong":
        return "pong"
    return ""


def lingered(rooms: dict[bytes, Room], now: float, linger: float) -> set[bytes]:
    """Drop the rooms nobody waited in for ``linger`` seconds; their channels."""
    gone = {key for key, room in rooms.items() if room.empty_since and now - room.empty_since > linger}
    for key in gone:
        del rooms[key]
    return gone


def leave(room: Room | None, waiter: Waiter, now: float) -> None:
    if room is not None and waiter in room.waiters:
        room.waiters.remove(waiter)
        if not room.waiters:
            room.empty_since = now


@dataclass(frozen=True)
class Plan:
    """How a refused waiter sleeps (see :func:`plan`)."""

    refusers: frozenset[int]
    needed: int
    until: float
    deaf_until: float
    split: bool  # some master granted the refused attempt: its losers spread their next tries


def plan(settings: Settings, votes: Sequence[Vote], deadline: float, free_at: float, t: float) -> Plan:
    """The sleep after a refused attempt whose ``votes`` are given, begun at ``t``.

    The attempt was granted by ``yes`` masters (and retracted); ``quorum - yes`` of those that
    refused it must free the key before a new attempt can win, so that many notices are waited
    for: waking on any one would make every split vote's retraction (each one that deleted
    publishes) wake every waiter. Never longer than a jittered ``wait_poll`` (a notice may be
    lost), nor than when a quorum's keys could have expired (``free_at``: an abandoned lock), nor
    than a poll's delay when too few refusers listened (see :func:`sleep_bound`).
    """
    yes = sum(1 for vote in votes if vote.kind == "yes")
    refusers = frozenset(i for i, vote in enumerate(votes) if vote.kind == "held")
    until = min(deadline, free_at, t + random.uniform(0.5, 1.0) * settings.wait_poll)
    deaf_until = t + random.uniform(0, settings.retry_delay)
    return Plan(refusers, max(1, settings.quorum - yes), until, deaf_until, bool(yes))


def spread(settings: Settings) -> float:
    """After a split vote, how long a woken loser waits before its next try: spread as polling
    does, but never past the bound a waiter keeps (``wait_poll``)."""
    return random.uniform(0, min(settings.retry_delay, settings.wait_poll / 2))
