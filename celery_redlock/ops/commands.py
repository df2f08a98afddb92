"""What each operator command does and prints, and its exit status: one implementation, run by
both front ends (``celery redlock ...`` and ``celery-redlock ...``, see :mod:`.cli`).

Each command takes a :class:`Session` (where its masters come from: the front end's business),
an :class:`~.output.Output`, and its options, and returns its exit status (:mod:`.exits`). The
work itself is :mod:`celery_redlock.lock.admin`'s (the same functions are the Python API); this
module decides what an answer means and how it reads, as text or as ``--json`` (docs/cli.md
lists the fields).
"""

from __future__ import annotations

import datetime as dt
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..lock import admin
from ..lock.redlock import Redlock
from . import exits
from .leader import read_leader_record
from .output import Output
from .views import health_rows, print_view, seconds, unanswered


class Session(Protocol):
    """Where one command's masters come from; the front end's, not the command's, business."""

    program: str  # how the command was run ("celery-redlock"): a force-release's log names it

    def redlock(self) -> AbstractContextManager[Redlock]:
        """A Redlock over the masters, closed after the command."""

    def leader(self, lock_name: str | None) -> AbstractContextManager[tuple[Redlock, str]]:
        """A Redlock over the beat's masters, and the beat's leader lock name (``lock_name``,
        when given, else the front end's default)."""


# -- ls -----------------------------------------------------------------------------------------
def ls(session: Session, out: Output, *, pattern: str, limit: int, partial: bool, timeout: float) -> int:
    """The locks whose resource matches ``pattern``: 0 a complete listing; 1 an incomplete one
    (stopped at a bound, or a master did not answer the scan); 3 fewer than a quorum answered."""
    with session.redlock() as locks:
        listing = admin.list_locks(locks, pattern, limit=limit, partial=partial, timeout=timeout)
        masters, quorum = len(locks.masters), locks.quorum
    answered = masters - len(listing.errors)
    code = exits.UNAVAILABLE if answered < quorum else exits.OK if listing.complete else exits.NO
    out.document(
        {
            "locks": [view.as_dict() for view in listing.locks],
            "complete": listing.complete,
            "stopped_at": listing.stopped_at,
            "limit": limit,
            "errors": listing.errors,
            "answered": answered,
            "masters": masters,
            "quorum": quorum,
        }
    )
    if out.as_json:
        return code
    rows = [
        (
            view.name,
            "-" if view.token is None else view.describe_holder(),
            seconds(view.age),
            seconds(view.ttl_left),
            f"{view.agree}/{len(view.masters)}" + (f" +{view.queued} queued" if view.queued else ""),
        )
        for view in listing.locks
    ]
    out.table(("RESOURCE", "HOLDER", "AGE", "TTL LEFT", "MASTERS"), rows)
    if not rows and answered < quorum:
        out.line(f"no lock seen matching {pattern!r} (only {answered} of {masters} masters answered)")
    elif not rows:
        held = "held on any master" if partial else "held on a quorum"
        out.line(f"no lock {held} matches {pattern!r}")
    _explain_incomplete(out, listing, pattern, limit, answered, masters, quorum)
    return code


def _explain_incomplete(
    out: Output, listing: admin.Listing, pattern: str, limit: int, answered: int, masters: int, quorum: int
) -> None:
    """Say plainly why a listing is incomplete: which bound stopped it, which masters failed."""
    for master, why in listing.errors.items():
        out.warn(f"{master} did not answer the scan: {why}")
    if listing.errors:
        out.warn(
            f"listing incomplete: {masters - answered} of {masters} masters did not answer the scan; "
            "a lock they hold may be missing, or shown on fewer masters than hold it"
            + (
                f" (only {answered} answered, quorum {quorum}: nothing can be told)"
                if answered < quorum
                else ""
            )
        )
    if listing.stopped_at == "limit":
        out.warn(
            f"listing incomplete: stopped after --limit {limit} keys; more keys match {pattern!r} "
            "(raise --limit, or narrow the pattern)"
        )
    elif listing.stopped_at == "steps":
        out.warn(
            f"listing incomplete: stopped after {admin.MAX_SCAN_STEPS} SCAN steps on a master; more "
            f"keys may match {pattern!r} (narrow the pattern)"
        )


# -- show ---------------------------------------------------------------------------------------
def show(session: Session, out: Output, *, resource: str, timeout: float) -> int:
    """One lock on every master: 0 held on a quorum; 1 not; 3 fewer than a quorum answered."""
    with session.redlock() as locks:
        view = admin.show(locks, resource, timeout=timeout)
    answered = len(view.masters) - len(unanswered(view))
    out.document({**view.as_dict(), "answered": answered})
    if not out.as_json:
        print_view(out, view)
    if answered < view.quorum:
        _no_quorum(out, answered, view, "whether it is held")
        return exits.UNAVAILABLE
    return exits.OK if view.held else exits.NO


def _no_quorum(out: Output, answered: int, view: admin.LockView, what: str) -> None:
    out.warn(
        f"only {answered} of {len(view.masters)} masters answered (quorum {view.quorum}): "
        f"{what} cannot be told"
    )


# -- release ------------------------------------------------------------------------------------
def release(
    session: Session,
    out: Output,
    *,
    resource: str,
    yes: bool,
    force: bool,
    watch: float,
    timeout: float,
) -> int:
    """Release the lock on ``resource``, by the rule of :mod:`celery_redlock.lock.liveness`
    unless ``force``: 0 released, or nothing held; 1 refused or declined; 3 fewer than a quorum
    answered the first look (nothing is done then, unless ``force``)."""
    with session.redlock() as locks:
        view = admin.show(locks, resource, timeout=timeout)
        if not out.as_json:
            print_view(out, view)
        result = _Release(out, view)
        code = result.run(locks, session.program, yes=yes, force=force, watch=watch, timeout=timeout)
    out.document(result.as_dict())
    return code


class _Release:
    """One release's steps and what became of it (``outcome``), for the text and the JSON."""

    def __init__(self, out: Output, view: admin.LockView) -> None:
        self.out = out
        self.view = view
        self.answered = len(view.masters) - len(unanswered(view))
        self.outcome = "refused"
        self.reason = ""
        self.alive: admin.Liveness | None = None
        self.done: admin.Released | None = None

    def run(
        self, locks: Redlock, program: str, *, yes: bool, force: bool, watch: float, timeout: float
    ) -> int:
        view, out = self.view, self.out
        if view.token is None:
            if self.answered < view.quorum:
                _no_quorum(out, self.answered, view, "whether it is held")
                return self._end("unavailable", "no master that answered holds it, but too few answered")
            out.line(f"nothing to release: no master holds a lock on {view.name!r}")
            return self._end("nothing_held", "no master holds it", exits.OK)
        if self.answered < view.quorum and not force:
            _no_quorum(out, self.answered, view, "who holds it")
            return self._end(
                "unavailable", "fewer than a quorum of masters answered; --force releases anyway"
            )
        if view.marker and not force:
            # Refused before asking: a marker's answer needs no watch, and a question whose
            # answer cannot change anything is noise.
            return self._refuse(admin.liveness(locks, view, watch=0, timeout=timeout))
        if not yes and not out.confirm(self._question(force)):
            return self._end("declined", "not confirmed", exits.NO, say="not released: not confirmed")
        if not force:
            if not view.marker:
                out.line(f"watching whether its holder is shown dead (at most {watch:g} s)...")
            alive = admin.liveness(locks, view, watch=watch, timeout=timeout)
            if not alive.releasable:
                return self._refuse(alive)
            self.alive = alive
            out.line(f"holder is {alive.state}: {alive.reason}")
        # The audit line tells a checked release from a forced one.
        by = f"{admin.operator_identity()} ({program} release{' --force' if force else ''})"
        self.done = admin.force_release(locks, view, by=by, timeout=timeout)
        out.line(
            f"released {view.key} (token {self.done.token[:12]}...) on {self.done.deleted} of "
            f"{self.done.masters} masters, by {self.done.by}"
        )
        return self._end("released", self.alive.reason if self.alive else "--force", exits.OK)

    def _question(self, force: bool) -> str:
        """The confirmation prompt; under ``force`` the warning comes first, as part of it."""
        lock = f"{self.view.key} (token {self.view.token and self.view.token[:12]}...)"
        if not force:
            return f"release {lock} if its holder is shown dead?"
        return (
            "WARNING: --force releases it whatever its holder is doing: a holder still running "
            "(or a queued message's marker) loses its lock, and a duplicate may start beside it.\n"
            f"release {lock} now?"
        )

    def _refuse(self, alive: admin.Liveness) -> int:
        self.alive = alive
        self.out.line(f"holder is {alive.state}: {alive.reason}")
        return self._end(
            "refused",
            alive.reason,
            exits.NO,
            say=f"refused: its holder is {alive.state}; --force releases anyway",
        )

    def _end(self, outcome: str, reason: str, code: int = exits.UNAVAILABLE, say: str = "") -> int:
        self.outcome, self.reason = outcome, reason
        if say:
            self.out.fail(say)
        return code

    def as_dict(self) -> dict[str, Any]:
        alive = self.alive
        return {
            "outcome": self.outcome,
            "released": self.done is not None,
            "reason": self.reason,
            "name": self.view.name,
            "key": self.view.key,
            "token": self.view.token,
            "liveness": None
            if alive is None
            else {"state": alive.state, "reason": alive.reason, "watched": alive.watched},
            "deleted": None if self.done is None else self.done.deleted,
            "by": None if self.done is None else self.done.by,
            "answered": self.answered,
            "lock": self.view.as_dict(),
        }


# -- health -------------------------------------------------------------------------------------
def health(session: Session, out: Output, *, timeout: float) -> int:
    """The masters' fitness: 0 every master sound; 1 degraded; 3 fewer than a quorum sound."""
    with session.redlock() as locks:
        report = admin.health(locks, timeout=timeout)
        request_timeout = locks.request_timeout
    out.document({**report.as_dict(), "timeout": timeout, "request_timeout": request_timeout})
    if out.as_json:
        return report.exit_code
    out.table(
        ("MASTER", "STATE", "RTT", "VERSION", "ROLE", "PERSIST", "EVICTION", "CLOCK", "SCRIPTS"),
        health_rows(report),
    )
    for m in report.masters:
        for finding in m.findings:
            out.line(f"{m.master}: {finding}")
    sound = f"{report.sound} of {len(report.masters)} sound, quorum {report.quorum}"
    out.line(f"fleet: {report.status} ({sound})")
    return report.exit_code


# -- leader -------------------------------------------------------------------------------------
def leader(session: Session, out: Output, *, lock_name: str | None, timeout: float) -> int:
    """The beat process that holds the leader lock: 0 a quorum names one; 1 none does; 3 fewer
    than a quorum answered."""
    with session.leader(lock_name) as (locks, name):
        reading = read_leader_record(locks, name, timeout=timeout)
    out.document(reading.as_dict())
    record = reading.record
    if reading.answered < reading.quorum:
        out.warn(
            f"only {reading.answered} of {reading.masters} masters answered (quorum "
            f"{reading.quorum}): who leads cannot be told"
        )
        return exits.UNAVAILABLE
    if record is None:
        out.line(f"no beat leader: no quorum of masters names one for {reading.lock}")
        return exits.NO
    since = dt.datetime.fromtimestamp(float(record["since"]), tz=dt.timezone.utc)
    out.line(
        f"beat leader for {reading.lock}: {record['hostname']} pid {record['pid']}, "
        f"since {since.isoformat(timespec='seconds')} (lock ttl {record['ttl']:g}s)"
    )
    return exits.OK
