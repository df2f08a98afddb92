"""Fencing tokens from the quorum: ``Redlock.lock(name, fenced=True)``.

A lock with expiry cannot stop a holder that pauses (a GC, SIGSTOP, a slow disk) after its last
check and writes after its lease ended; only the resource can, by refusing a number lower than
one it has already seen. So each fenced grant gets a *fence*, an integer strictly greater than
the fence of every earlier grant of the same name, and the resource keeps the highest it saw
(see :mod:`celery_redlock.fenced` for a SQL row and a Redis key).

**How.** Each master keeps a counter for the name beside the lock key (``<key>~fence``).

1. Round 1 (``FENCED_ACQUIRE``, one script per master): ``SET NX PX``, and where it was set,
   answer ``c = max(counter, the master's clock in µs)``. Q = the masters that granted.
2. ``F = max(c over Q) + 1``. Round 2 (``FENCE_WRITE_BACK``), to Q only: raise the counter to F,
   but only while the lock key still holds our token. W = the masters of Q that did.
3. Granted iff |Q| and |W| are quorums and validity is left, counted from before round 1.

**Why the fence only grows** (assumptions: Q and W are quorums of distinct masters; each master
runs a script atomically and holds one token per key at a time; a counter never goes below a
fence it acknowledged, because of ``appendfsync always`` or because a master that lost its data
comes back with a clock floor above the fences it had): for grants A and B, W_A and W_B share a
master m. On m the two grants' intervals are disjoint; say A's came first. A's write-back ran in
A's interval (it checks the token), so from then on m's counter is >= F_A. B's acquire script on m
read the counter in the same step that set B's key, after A's interval: it read >= F_A, and m is
in Q_B (W_B is a subset of Q_B, since round 2 goes only to Q), so F_B >= F_A + 1. With the lock's
own timing assumptions (bounded clock drift, delayed restarts), this order is also real time: a
grant that returned before another began has the smaller fence.

**What each rule is for.** The counter is read inside the acquire script (read earlier, it could
precede the end of the previous holder's interval); the write-back goes only to Q (a master
outside Q could be in W without its reading counted); it checks the token (else a late write-back
needs timing to be harmless); W must be a quorum (a fence recorded by a minority is not recorded:
a later quorum may miss it).

**What breaks it** (outside the assumptions): a master that loses its counter (no fsync,
FLUSHALL, eviction) while its clock is behind the clock that issued recent fences by more than
its downtime; a counter retained (``fence_retention``) for less than the worst clock error; two
lock names, or two master sets, guarding one resource. A clock stepped forward makes fences jump
ahead and stay there: still increasing.

**Cost.** Two round trips per grant instead of one, both within the one ``request_timeout`` an
attempt may take, the transport's resend of a script a master lost (NOSCRIPT) included (so an
acquire keeps the bound of every kind: its timeout plus one ``request_timeout``): masters must
answer within half of it, and a slower quorum fails fenced attempts rather than overrun. A
refused first round costs what an unfenced attempt does. Extensions and the heartbeat do not
touch the counter. Fences grow by at least one per grant, not by exactly one: retries and failed
write-backs leave gaps.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .._fork import pid
from ..errors import RedlockError, Vote
from . import scripts
from .clock import now
from .commands import RELEASE, milliseconds
from .resource import FENCE_SUFFIX, Lock
from .rounds import Call, Interrupted, Rules, Send, Steps, drive
from .tally import is_one, is_positive, retraction
from .transport.commands import Command, Outcome, common_outcome, script_template

if TYPE_CHECKING:
    from .redlock import Redlock

ACQUIRE = script_template(scripts.FENCED_ACQUIRE, 2, 2)  # key counter token <ms>
WRITE_BACK = script_template(scripts.FENCE_WRITE_BACK, 2, 3)  # key counter token fence <ms>

# The suffix of a lock key's fence counter (lock_key refuses names ending in it).
COUNTER_SUFFIX = FENCE_SUFFIX
# Fences must stay exact in Lua's doubles (a master clock past the year 2255 would pass it).
MAX_FENCE = 2**53
_RECORDED = common_outcome(1)  # a write-back's usual answer, shared: counted by identity


def try_acquire_fenced(
    redlock: Redlock, key: str, token: str, ttl: float, expiry: list[float] | None = None
) -> tuple[float, list[Vote], float, int]:
    """One fenced attempt: (validity, votes, elapsed, fence); validity > 0 means acquired.
    ``expiry``, if given, receives when a quorum could be free at the earliest (as
    ``Redlock.try_acquire`` gives it a waiting lock). See :func:`fenced_attempt`."""
    steps = fenced_attempt(redlock, key, token, ttl, expiry)
    first = next(steps)  # its clock starts here, before the round takes or makes any link
    with redlock._round() as rnd:
        return drive(steps, rnd, first)


def fenced_attempt(
    redlock: Rules, key: str, token: str, ttl: float, expiry: list[float] | None = None
) -> Steps[tuple[float, list[Vote], float, int]]:
    """One fenced attempt's two rounds (see :mod:`.rounds`): (validity, votes, elapsed, fence).

    Both rounds run in one exchange, on the same links, so a retraction always travels behind
    whatever of ours it must follow. They share one deadline, ``request_timeout`` from the start,
    as one unfenced round does; round 1 has its first half. The votes of a failure are round 2's
    for the masters of Q (a fence write-back refused or late) and round 1's for the others.
    """
    counter = key + COUNTER_SUFFIX
    n = len(redlock.tally.names)
    ms = milliseconds(ttl)
    t_start = now()
    deadline = time.monotonic() + redlock.request_timeout  # the exchange's clock
    # INVARIANT: round 1 ends by half the deadline, leaving round 2 the other half: a minority
    # master that does not answer (paused, partitioned) then costs a fenced attempt what it costs
    # a plain one, time, never the grant (waited for until the deadline, it left round 2 none).
    halfway = deadline - redlock.request_timeout / 2
    release = RELEASE.pack(key, token)
    try:
        first = yield Call([ACQUIRE.pack(key, counter, token, ms)] * n, max(0.0, halfway - time.monotonic()))
    except Interrupted:
        yield Send([release] * n, redlock.request_timeout)  # any master may have set the key
        raise
    votes, granted, fence = _round_one(redlock, first)
    if expiry is not None:
        expiry.clear()
        expiry.append(redlock._free_at([_as_pttl(o) for o in first], now()))
    if len(granted) < redlock.quorum or ttl - (now() - t_start) - redlock.drift(ttl) <= 0:
        # As any failed attempt: every master but those that refused gets the retraction.
        retract = retraction(votes, release)
        if any(retract):
            yield Send(retract, redlock.request_timeout)
        return 0.0, votes, now() - t_start, 0
    if fence >= MAX_FENCE:
        yield Send(retraction(votes, release), redlock.request_timeout)
        raise RedlockError(f"fence {fence} for {key!r} is past 2^53: a master's clock is far ahead")
    decimal = str(fence)
    retention = milliseconds(redlock.fence_retention)
    write_back = WRITE_BACK.pack(key, counter, token, decimal, retention)
    # Sent even when no time is left: its replies are then late, the attempt fails, and the
    # retraction below follows the write-backs on the same links.
    try:
        outcomes = yield Call(
            _round_two(votes, granted, write_back, release), max(0.0, deadline - time.monotonic())
        )
    except Interrupted:
        yield Send([release] * n, redlock.request_timeout)
        raise
    elapsed = now() - t_start
    recorded = _recorded(redlock, outcomes, granted, votes)
    validity = ttl - elapsed - redlock.drift(ttl)
    if recorded >= redlock.quorum and validity > 0:
        return validity, votes, elapsed, fence
    # The fence reached too few masters (or the time ran out): a failed attempt. The masters
    # that recorded F keep it (raising a counter is always safe): a gap in the fences.
    retract = [None if v.kind == "held" and i not in granted else release for i, v in enumerate(votes)]
    yield Send(retract, redlock.request_timeout)
    return 0.0, votes, elapsed, 0


def _round_one(redlock: Rules, first: list[Outcome]) -> tuple[list[Vote], list[int], int]:
    """Round 1's votes, the masters that granted (Q), and the fence F = max(c over Q) + 1."""
    readings = [o.value for o in first if o.kind == "ok" and type(o.value) is int and o.value > 0]
    if len(readings) == len(first):  # the usual round: every master granted
        return list(redlock.tally.granted), list(range(len(first))), max(readings) + 1
    votes, _ = redlock.tally.votes(first, is_positive)
    granted = [i for i, vote in enumerate(votes) if vote.kind == "yes"]
    return votes, granted, (max(readings) + 1 if readings else 0)


def _round_two(
    votes: list[Vote], granted: list[int], write_back: Command, release: Command
) -> list[Command | None]:
    """Round 2's commands: the write-back to Q only. A master late in round 1 gets its
    retraction in the same call, queued behind its late SET (its outcome is not waited for),
    and so does one that answered an error (the script may have set the key before it failed)."""
    if len(granted) == len(votes):
        return [write_back] * len(votes)
    return [
        write_back if i in granted else (None if votes[i].kind == "held" else release)
        for i in range(len(votes))
    ]


def _recorded(redlock: Rules, outcomes: list[Outcome], granted: list[int], votes: list[Vote]) -> int:
    """How many masters of Q recorded the fence; their votes in ``votes`` become round 2's."""
    if outcomes.count(_RECORDED) == len(outcomes):  # the usual round: recorded everywhere
        return len(outcomes)
    for i in granted:
        votes[i] = redlock.tally.vote(i, outcomes[i], is_one)
    return sum(1 for i in granted if votes[i].kind == "yes")


def _as_pttl(outcome: Outcome) -> Outcome:
    """A FENCED_ACQUIRE outcome as ACQUIRE_WAIT would answer: ``OK`` for a grant, the PTTL for a
    refusal (what ``Redlock._free_at`` reads)."""
    value = outcome.value if outcome.kind == "ok" else None
    if isinstance(value, int):
        return Outcome("ok", b"OK" if value > 0 else -1 - value)
    return outcome


class _Grant:
    """One acquire call's fence, set by its successful attempt (no queue place: ``member``)."""

    __slots__ = ("fence", "member")

    def __init__(self) -> None:
        self.fence = 0
        self.member = None


class FencedLock(Lock):
    """A :class:`Lock` whose every grant carries a :attr:`fence` (see the module docstring)."""

    fenced = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fence: int | None = None
        self._fence_owner = 0

    @property
    def fence(self) -> int | None:
        """The fence of this lock's current grant: an int strictly above every earlier grant's
        fence of the same name. None before the first grant, after ``release()`` and in a forked
        child; kept after the lock is lost or expired (judging a stale fence is the resource's
        job)."""
        return self._fence if self._fence_owner == pid() else None

    def _entry(self) -> Any:
        return _Grant()

    def _attempt(
        self, token: str, waiting: bool, expiry: list[float], entry: Any
    ) -> tuple[float, list[Vote], float]:
        validity, votes, elapsed, fence = try_acquire_fenced(
            self.redlock, self.key, token, self.ttl, expiry if waiting else None
        )
        entry.fence = fence
        return validity, votes, elapsed

    def _granted(self, entry: Any) -> None:
        self._fence = entry.fence
        self._fence_owner = pid()

    def _release_command(self, token: str) -> Command | None:
        self._fence = None
        return None
