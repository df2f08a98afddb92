"""Outcomes to votes to a decision: the one place a master's answer becomes a vote.

Every lock operation sends one command per master and gets one outcome each (see
:mod:`.transport.interface`). A master that answered votes ``yes`` when its reply is a grant by
the operation's own predicate (``b"OK"`` for SET NX, 1 for a compare-and-pexpire, a counter > 0
for a fenced acquire), ``held`` when it answered anything else (the key is someone else's, or
gone); a master that did not answer votes its error or timeout. The operation succeeds on a
quorum of ``yes`` (N // 2 + 1), and the rest of each kind's decision (validity, retraction)
reads the votes.

The retraction rule is here too, for every kind: a failed attempt's release goes to every
master that may hold our token, which is every master but those that refused it (``held``):
one that granted, failed or did not answer in time may have set the key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import Vote
from .transport.commands import Outcome

C = TypeVar("C")


def is_ok(value: Any) -> bool:
    """SET NX's grant."""
    return bool(value == b"OK")


def is_one(value: Any) -> bool:
    """A compare-and-pexpire's (or compare-and-delete's) success."""
    return bool(value == 1)


def is_answer(value: Any) -> bool:
    """A release's: any reply took effect (1 deleted our key, 0 found it already gone)."""
    return True


def is_positive(value: Any) -> bool:
    """A count or counter above zero: a reentrant re-entry's depth, a fenced acquire's reading."""
    return type(value) is int and value > 0


class Tally:
    """The votes of one Redlock's masters, with the two answers a healthy master gives shared
    (votes are immutable: the usual rounds build none)."""

    __slots__ = ("granted", "names", "quorum", "refused")

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.quorum = len(self.names) // 2 + 1
        self.granted = [Vote(name, "yes") for name in self.names]
        self.refused = [Vote(name, "held") for name in self.names]

    def vote(self, i: int, outcome: Outcome, granted: Callable[[Any], bool]) -> Vote:
        """Master i's vote on ``outcome``."""
        if outcome.kind == "ok":
            return self.granted[i] if granted(outcome.value) else self.refused[i]
        return Vote(self.names[i], outcome.kind, outcome.detail)

    def votes(self, outcomes: Sequence[Outcome], granted: Callable[[Any], bool]) -> tuple[list[Vote], int]:
        """Every master's vote, and how many said yes."""
        votes = [self.vote(i, outcome, granted) for i, outcome in enumerate(outcomes)]
        return votes, sum(1 for vote in votes if vote.kind == "yes")


def retraction(votes: Sequence[Vote], release: C) -> list[C | None]:
    """A failed attempt's release, for every master that may hold our token (all but ``held``)."""
    return [None if vote.kind == "held" else release for vote in votes]


def to_late(votes: Sequence[Vote], release: C) -> list[C | None]:
    """A granted attempt's release for the masters whose answer was late: each may still set
    the key after our release, so the retraction follows its SET on the same link."""
    return [release if vote.kind == "timeout" else None for vote in votes]


def to_not_granted(votes: Sequence[Vote], command: C) -> list[C | None]:
    """A granted attempt's ``command`` for every master that did not grant it (refused, late,
    or not answering: kept for its next link)."""
    return [None if vote.kind == "yes" else command for vote in votes]
