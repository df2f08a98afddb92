"""The errors of celery-redlock: one base class, and the per-master account of a failed vote.

Every exception here keeps its constructor arguments, in JSON-friendly types, as its ``args``:
Celery serializes a task's exception into the result backend (pickle or JSON) and
``AsyncResult.get()`` rebuilds it as ``cls(*args)`` on the caller's side, so a
``LockNotAcquired`` raised in a worker arrives as a ``LockNotAcquired``, votes included.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

VoteKind = Literal["yes", "held", "error", "timeout"]


@dataclass(frozen=True)
class Vote:
    """What one master answered in one round.

    ``kind`` is ``yes`` (it granted), ``held`` (another token holds the key), ``error`` (it
    answered with an error, or its connection failed; ``detail`` says which) or ``timeout`` (no
    answer within ``request_timeout``).
    """

    master: str
    kind: VoteKind
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.master}: {self.kind}" + (f" ({self.detail})" if self.detail else "")

    def as_dict(self) -> dict[str, str]:
        return {"master": self.master, "kind": self.kind, "detail": self.detail}


#: The votes of masters that did not answer: an error (a failed connection included), or no
#: reply within ``request_timeout``.
UNANSWERED: tuple[VoteKind, ...] = ("error", "timeout")
#: The votes of masters that did not grant: those that did not answer, and those that refused.
AGAINST: tuple[VoteKind, ...] = ("held", *UNANSWERED)


def name_masters(votes: Iterable[Vote], kinds: Collection[str] = AGAINST) -> list[str]:
    """The masters whose vote is one of ``kinds``, each as its vote reads (``master: kind
    (detail)``): what an error or a warning names when a round missed its quorum."""
    return [str(vote) for vote in votes if vote.kind in kinds]


class RedlockError(Exception):
    """Base class of every error celery-redlock raises."""


class ConfigError(RedlockError, ValueError):
    """A setting or argument is invalid; the message names it and the bad value."""


class LockNotAcquired(RedlockError):
    """No quorum of masters granted the lock.

    ``votes`` holds one :class:`Vote` per master from the last attempt; ``elapsed`` is how long that
    attempt took and ``validity`` what would have been left of the TTL (seconds). ``holder``, when
    a quorum of masters agreed on who holds the lock and someone asked them (a contender that
    gives up, see the Celery layer), says who: ``task charge_invoice 8c1f... on worker-3 pid 4411
    for 12.4 s`` (``lock.holder.describe_holder``); "" when unknown.

    ``args`` are exactly the constructor's arguments, in plain types: Celery's JSON result backend
    rebuilds an exception as ``cls(*args)``, and the votes must survive that trip.
    """

    def __init__(
        self,
        resource: str,
        votes: Sequence[Vote | dict[str, str]] = (),
        attempts: int = 1,
        elapsed: float = 0.0,
        validity: float = 0.0,
        quorum: int = 0,
        holder: str = "",
    ) -> None:
        self.resource = resource
        self.votes: tuple[Vote, ...] = tuple(
            v if isinstance(v, Vote) else Vote(**v)  # type: ignore[arg-type]
            for v in votes
        )
        self.attempts = attempts
        self.elapsed = elapsed
        self.validity = validity
        self.quorum = quorum
        self.holder = holder
        super().__init__(
            resource, [v.as_dict() for v in self.votes], attempts, elapsed, validity, quorum, holder
        )

    def __str__(self) -> str:
        yes = sum(1 for v in self.votes if v.kind == "yes")
        lines = [
            f"lock {self.resource!r} not acquired after {self.attempts} attempt(s): "
            f"{yes} of {len(self.votes)} masters granted it, quorum is {self.quorum}; "
            f"last attempt took {self.elapsed * 1000:.1f} ms, "
            f"validity {self.validity * 1000:.1f} ms"
        ]
        if self.holder:
            lines[0] += f"; held by {self.holder}"
        lines += [f"  {vote}" for vote in self.votes]
        return "\n".join(lines)

    def naming(self, holder: str) -> LockNotAcquired:
        """This error, saying who holds the lock (``holder`` as ``describe_holder`` reads it)."""
        return LockNotAcquired(
            self.resource,
            self.votes,
            attempts=self.attempts,
            elapsed=self.elapsed,
            validity=self.validity,
            quorum=self.quorum,
            holder=holder,
        )

    @property
    def held_by_other(self) -> bool:
        """True when the masters that refused did so because another token holds the key."""
        return any(v.kind == "held" for v in self.votes)

    @property
    def contended(self) -> bool:
        """True when the masters holding another token deny the quorum on their own: the lock is
        held elsewhere, whatever the masters that did not answer would have said. False means
        the quorum was missed because masters failed or did not answer: unavailability, which
        must never be taken for a duplicate (see :attr:`unavailable_masters`)."""
        held = sum(1 for v in self.votes if v.kind == "held")
        return held > len(self.votes) - self.quorum

    @property
    def unavailable_masters(self) -> list[str]:
        """The masters that failed or did not answer in the last attempt."""
        return name_masters(self.votes, UNANSWERED)


class NotLocked(RedlockError):
    """``self.redlock`` was read outside a locked run, e.g. in a direct call ``charge(42)``, which
    is the plain function (as everywhere in Celery) and takes no lock."""


class LockLost(RedlockError):
    """A lock this process held is no longer held: it expired, or an extension lost the quorum."""

    def __init__(self, resource: str, reason: str = "") -> None:
        self.resource = resource
        self.reason = reason
        super().__init__(resource, reason)

    def __str__(self) -> str:
        return f"lock {self.resource!r} lost" + (f": {self.reason}" if self.reason else "")


class LockKindMismatch(ConfigError):
    """One name used as a reentrant lock and as a plain one at the same time: the masters hold
    it in the other kind's form. Use one kind per name."""


class AlreadyQueued(RedlockError):
    """A task with ``lock_enqueue="raise"`` was not published: a task for the same resource is
    already queued or running. ``task_id`` names it (None when the key's holder records no task
    id: something other than a task holds it)."""

    def __init__(self, resource: str, task_id: str | None = None, task_name: str = "") -> None:
        self.resource = resource
        self.task_id = task_id
        self.task_name = task_name
        super().__init__(resource, task_id, task_name)

    def __str__(self) -> str:
        who = f"task {self.task_id}" if self.task_id else "a holder that records no task id"
        of = f"task {self.task_name!r}: " if self.task_name else ""
        return f"{of}{self.resource!r} is already queued or running as {who}; not published"


class MastersUnavailable(RedlockError):
    """A question about a resource that the masters' answers cannot settle: too few of them
    answered to rule out what a quorum may hold (``is_queued``, ``queued_task_id``). Reading
    "not queued" then would be a guess; ``masters`` names those that failed or did not answer."""

    def __init__(self, resource: str, masters: list[str], question: str = "") -> None:
        self.resource = resource
        self.masters = masters
        self.question = question
        super().__init__(resource, masters, question)

    def __str__(self) -> str:
        what = f"{self.question} of {self.resource!r}" if self.question else repr(self.resource)
        return (
            f"cannot tell {what}: too few masters answered to rule out a quorum; not answering: "
            + ", ".join(self.masters)
        )


class NotFenced(RedlockError):
    """``lock.fence`` was asked of a lock taken without ``fenced=True``."""


class StaleFence(RedlockError):
    """A fenced write was refused: the resource has seen a higher fence (a later holder's), so
    this holder's lock is no longer valid. Carries the resource, this fence and the stored one."""

    def __init__(self, resource: str, fence: int, current: int) -> None:
        super().__init__(resource, fence, current)
        self.resource = resource
        self.fence = fence
        self.current = current

    def __str__(self) -> str:
        return (
            f"stale fence for {self.resource}: this write carries fence {self.fence}, but the "
            f"resource has already seen {self.current} (a later holder's); the lock was lost"
        )
