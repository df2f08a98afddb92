"""Each lock operation's rounds, written once, for threads and asyncio alike (no I/O here).

An operation is a generator: it *yields* what it asks of the masters (:class:`Call`: send these
commands and wait for the replies by a timeout; :class:`CallMany`: a pipelined batch per master;
:class:`Send`: send these, nobody waits) and is sent back the outcomes; every decision (the
votes, the validity, the drift, which masters a failed attempt retracts, which late master a
granted one does) is made here, between two yields. What carries the requests is the driver's:
:func:`drive` runs an operation over a blocking :class:`~.transport.interface.Exchange`, and
``celery_redlock.lock.aio.exchange.drive`` over an asyncio one. All of one operation's
requests go through one exchange, so they reach each master in the order they were yielded.
The acquire attempt, every lock's hot path, is also written as its two steps (:func:`acquiring`,
:func:`counted`), which the blocking ``Redlock.try_acquire`` runs without a generator.

An asyncio driver whose task is cancelled while a request is out throws :class:`Interrupted`
into the operation, which may yield a :class:`Send` of what undoes the round in flight (any
master may have applied it) before it lets the exception go; the blocking driver never throws.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, Protocol, TypeVar

from ..errors import Vote
from .clock import now
from .commands import PLAIN, Commands, milliseconds
from .tally import Tally, is_answer, is_ok, is_one, to_late, to_not_granted
from .tally import retraction as retraction_of
from .transport.commands import DELETED, GRANTED, HELD, Command, Outcome
from .transport.interface import Exchange

T = TypeVar("T")
# What an acquire attempt comes to: (validity, votes, elapsed); validity > 0 means acquired.
Attempted = tuple[float, list[Vote], float]


class Call:
    """Send ``commands[i]`` to master i and wait for the replies by ``timeout`` (see
    ``Exchange.call``); answered with one outcome per master."""

    __slots__ = ("commands", "enough", "keep", "timeout")

    def __init__(
        self, commands: Sequence[Command | None], timeout: float, keep: bool = False, enough: int = 0
    ) -> None:
        self.commands = commands
        self.timeout = timeout
        self.keep = keep
        self.enough = enough


class CallMany:
    """Send every command of ``batches[i]`` to master i, pipelined; answered with their outcomes."""

    __slots__ = ("batches", "timeout")

    def __init__(self, batches: Sequence[Sequence[Command]], timeout: float) -> None:
        self.batches = batches
        self.timeout = timeout


class Send:
    """Send ``commands[i]`` to master i; nobody waits (answered with None)."""

    __slots__ = ("commands", "timeout")

    def __init__(self, commands: Sequence[Command | None], timeout: float) -> None:
        self.commands = commands
        self.timeout = timeout


Request = Call | CallMany | Send
Steps = Generator[Request, Any, T]


class Interrupted(Exception):
    """Thrown into an operation whose caller stopped waiting mid-request (an asyncio
    cancellation): the request may have been applied by any master."""


class Rules(Protocol):
    """What the rounds read of a Redlock (``lock.settings.Settings`` has it all)."""

    tally: Tally
    quorum: int
    request_timeout: float
    fence_retention: float

    def drift(self, ttl: float) -> float: ...

    def _free_at(self, outcomes: Sequence[Outcome], t_end: float) -> float: ...


def drive(steps: Steps[T], exchange: Exchange, request: Request | None = None) -> T:
    """Run ``steps`` over a blocking ``exchange``; what the operation returns. ``request``: its
    first, if the caller started it already (``next(steps)``), as an attempt is started before
    its exchange is opened: its clock then counts the exchange's connects too."""
    if request is None:
        request = next(steps)
    while True:
        if isinstance(request, Call):
            reply: Any = exchange.call(
                request.commands, request.timeout, keep=request.keep, enough=request.enough
            )
        elif isinstance(request, Send):
            exchange.send(request.commands, request.timeout)
            reply = None
        else:
            reply = exchange.call_many(request.batches, request.timeout)
        try:
            request = steps.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


def attempt(
    redlock: Rules,
    key: str,
    token: str,
    ttl: float,
    commands: Commands = PLAIN,
    expiry: list[float] | None = None,
    *,
    acquires: Sequence[Command] | None = None,
    retraction: Command | None = None,
    seen: list[Outcome] | None = None,
    undo: Command | None = None,
    tidy: Command | None = None,
) -> Steps[Attempted]:
    """One acquire attempt: (validity, votes, elapsed); validity > 0 means acquired. See
    ``Redlock.try_acquire`` for the arguments, and for the same two steps (:func:`acquiring`,
    then :func:`counted`) run without a generator: every lock's hot path."""
    # Taken before the round makes any missing connection: all of the round, connects
    # included, is spent out of the TTL (and Lock counts its validity from earlier still).
    t_start = now()
    if acquires is None:
        acquires = acquiring(redlock, key, token, ttl, commands)
    try:
        outcomes = yield Call(acquires, redlock.request_timeout)
    except Interrupted:
        # Any master may have set the key: all of them get what undoes it.
        undone = undo or retraction or commands.release.pack(key, token)
        yield Send([undone] * len(acquires), redlock.request_timeout)
        raise
    result, follow = counted(
        redlock, outcomes, t_start, key, token, ttl, commands, expiry, seen, retraction, undo, tidy
    )
    if follow is not None:
        yield Send(follow, redlock.request_timeout)
    return result


def acquiring(redlock: Rules, key: str, token: str, ttl: float, commands: Commands) -> list[Command]:
    """An attempt's acquire, the same for every master."""
    return [commands.acquire.pack(key, token, milliseconds(ttl))] * len(redlock.tally.names)


def counted(
    redlock: Rules,
    outcomes: list[Outcome],
    t_start: float,
    key: str,
    token: str,
    ttl: float,
    commands: Commands,
    expiry: list[float] | None,
    seen: list[Outcome] | None,
    retraction: Command | None,
    undo: Command | None,
    tidy: Command | None,
) -> tuple[Attempted, list[Command | None] | None]:
    """An attempt begun at ``t_start`` whose masters answered ``outcomes``: its (validity, votes,
    elapsed), and what it then sends, nobody waiting for the replies (None: nothing)."""
    elapsed = now() - t_start
    votes, granted = _grants(redlock, outcomes)
    validity = ttl - elapsed - redlock.drift(ttl)
    if expiry is not None:
        expiry.append(redlock._free_at(outcomes, t_start + elapsed))
    if seen is not None:
        seen.extend(outcomes)
    won = granted >= redlock.quorum and validity > 0
    if won:
        if granted == len(votes):
            return (validity, votes, elapsed), None
        # A master that answered late may still set the key; retract it on the same link (not
        # waited for) so the key cannot outlive our release. A kind with a ``tidy`` sends it to
        # every master that did not grant: it retracts a late grant too, and undoes what the
        # grant would have done where it was refused.
        if tidy is not None:
            rest = to_not_granted(votes, tidy)
        else:
            rest = to_late(votes, retraction or commands.release.pack(key, token))
    elif granted == 0 and outcomes[0] is HELD and outcomes.count(HELD) == len(outcomes):
        # Refused by every master (a contended loop's usual round): nobody holds our token,
        # nothing is packed or sent.
        return (min(validity, 0.0), votes, elapsed), None
    else:
        rest = retraction_of(votes, undo or retraction or commands.release.pack(key, token))
    return (validity if won else min(validity, 0.0), votes, elapsed), (rest if any(rest) else None)


def _grants(redlock: Rules, outcomes: list[Outcome]) -> tuple[list[Vote], int]:
    """An acquire round's votes, and how many granted."""
    # The usual rounds, compared by identity: the first outcome tells which to count.
    first = outcomes[0]
    if first is GRANTED and outcomes.count(GRANTED) == len(outcomes):
        return list(redlock.tally.granted), len(outcomes)
    if first is HELD and outcomes.count(HELD) == len(outcomes):
        return list(redlock.tally.refused), 0
    return redlock.tally.votes(outcomes, is_ok)


def extend(
    redlock: Rules, key: str, token: str, ttl: float, commands: Commands = PLAIN
) -> Steps[tuple[float, list[Vote], float]]:
    """Reset the TTL on every master that still holds ``token``; (validity, votes, elapsed)."""
    command = commands.extend.pack(key, token, milliseconds(ttl))
    t_start = now()  # before the round's connects, as in attempt
    outcomes = yield Call([command] * len(redlock.tally.names), redlock.request_timeout)
    return extension(redlock, outcomes, ttl, now() - t_start)


def extension(
    redlock: Rules, outcomes: Sequence[Outcome], ttl: float, elapsed: float
) -> tuple[float, list[Vote], float]:
    """An extension's (validity, votes, elapsed) from every master's outcome of it."""
    votes, granted = redlock.tally.votes(outcomes, is_one)
    validity = ttl - elapsed - redlock.drift(ttl)
    return (validity if granted >= redlock.quorum else 0.0), votes, elapsed


def release(redlock: Rules, command: Command) -> Steps[list[Vote] | None]:
    """Compare-and-delete on every master, waiting for a quorum's replies: None when a quorum
    answered, else every master's vote (see ``Redlock.release_key`` for the invariant)."""
    # Kept for a master that could not be written to: it goes out on that master's next
    # link, so the key does not outlive the release there until its TTL.
    outcomes = yield Call(
        [command] * len(redlock.tally.names), redlock.request_timeout, keep=True, enough=redlock.quorum
    )
    if quorum_answered(outcomes, redlock.quorum):
        return None  # the hot path builds no votes
    return redlock.tally.votes(outcomes, is_answer)[0]


def quorum_answered(outcomes: list[Outcome], quorum: int) -> bool:
    """Whether at least ``quorum`` masters answered a release. The usual release's replies
    (1: deleted) are one shared outcome, counted first by identity at C speed."""
    return outcomes.count(DELETED) >= quorum or sum(1 for o in outcomes if o.kind == "ok") >= quorum


def send_release(redlock: Rules, command: Command) -> Steps[None]:
    """A release nobody waits for (a retraction, ``release_without_waiting``)."""
    yield Send([command] * len(redlock.tally.names), redlock.request_timeout)
