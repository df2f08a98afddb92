"""Checks a run from its recorded history alone, the way Jepsen checks a lock service.

A hold's window is ``[t_acquired, end)`` where ``end`` is the earlier of its validity end and its
release: the span in which its holder was entitled to act. Two windows of one resource that
intersect are an overlap (a mutual-exclusion violation), whatever the holders did inside them;
that rule is ``celery_redlock.testing.overlap``'s, the one the demo and the other suites use.
The register shows the consequences: every write appends to a log, so a write that collided with
another (both read the same value) is a lost update.

Fenced holds (``fence`` set) get the fence check, Jepsen's fenced mutex split into two checks
that need no search (``fence_violations``): no two grants of a resource share a fence, and a grant
that returned before another was invoked (``A.t_acquired < B.t_invoked``) has the smaller fence.
Both times bracket the library's own instant of grant, so the check is sound; calls that overlap
in time are not ordered. With both kept, ordering the grants by fence is a linearization that
agrees with real time. A fenced register's accepted writes, replayed in fence order, must then
read 1, 2, ..., n (``fenced_lost_updates``): that catches a lost update and any write accepted
out of fence order, whatever order the log shows.

Lost work (the Celery scenarios): every task the producer published (a ``published`` event) must
end exactly one way: run once (one hold record carries its task id, whatever the hold saw: a
lost lock, a refused fenced write), or be refused for good (a ``gave-up`` event: skip, fail, or
its lock retries exhausted). A task that never ended, ran twice, or ran and was refused too is
lost work (``lost_work``). The full rule, that a refusal names a holder that was holding, is
checked on real workers by ``tests/progress``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from celery_redlock.testing import overlap


@dataclass(frozen=True)
class Hold:
    client: str
    resource: str
    token: str
    t_acquired: float
    validity_end: float
    t_released: float | None
    yes: int
    quorum: int
    wrote: bool = False
    lost: str = ""
    fence: int | None = None  # a fenced grant's fence
    t_invoked: float | None = None  # just before the acquire call (t_acquired: just after it)
    stale: bool = False  # paused by the stale-writer nemesis before its write

    @property
    def end(self) -> float:
        if self.t_released is None:
            return self.validity_end
        return min(self.validity_end, self.t_released)

    def window(self) -> overlap.Hold:
        return overlap.Hold(self.resource, self.t_acquired, self.end, owner=self.client, info=self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Hold:
        return cls(
            client=record["client"],
            resource=record["resource"],
            token=record["token"],
            t_acquired=record["t_acquired"],
            validity_end=record["validity_end"],
            t_released=record["t_released"],
            yes=record["yes"],
            quorum=record["quorum"],
            wrote=record["wrote"],
            lost=record["lost"],
            fence=record.get("fence"),
            t_invoked=record.get("t_invoked"),
            stale=record.get("stale", False),
        )


@dataclass(frozen=True)
class FenceViolation:
    """Two fenced grants of one resource: ``duplicate``, one fence given twice; ``order``,
    ``earlier`` returned from acquire before ``later`` called it, yet has the larger fence."""

    kind: Literal["duplicate", "order"]
    earlier: Hold
    later: Hold

    def __str__(self) -> str:
        a, b = self.earlier, self.later
        if self.kind == "duplicate":
            return f"{a.resource}: {a.client} and {b.client} were both granted fence {a.fence}"
        return (
            f"{a.resource}: {a.client} was granted fence {a.fence} at {a.t_acquired:.3f}, before "
            f"{b.client} called acquire at {b.t_invoked:.3f} and was granted the lower fence {b.fence}"
        )


@dataclass
class Report:
    operations: int = 0
    holds: int = 0
    overlaps: list[overlap.Overlap] = field(default_factory=list)
    lost_updates: int = 0
    writes: int = 0
    without_quorum: list[Hold] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    max_unavailable: float = 0.0
    lost_holds: int = 0  # holds whose ensure() raised, or whose fenced access was refused
    # Fencing: the checks of the fenced holds and of the fenced register (``fres<i>``).
    fenced_holds: int = 0
    fence_violations: list[FenceViolation] = field(default_factory=list)
    lost_updates_fenced: int = 0  # breaks in the fenced register's fence-ordered history
    refused: int = 0  # fenced reads and writes the register refused (StaleFence)
    # Stale writes (the stale-writer nemesis): accepted on a plain resource; accepted or refused
    # on a fenced one.
    stale_plain: int = 0
    stale_fenced_accepted: int = 0
    stale_fenced_refused: int = 0
    # Celery runs: tasks published, and of them those that did not end exactly once.
    published: int = 0
    lost_work: int = 0

    def problems(self, plain_lost: Literal["forbidden", "required"] = "forbidden") -> list[str]:
        """Safety and progress violations: empty when the run kept mutual exclusion and the
        fences' order, and lost no published task. ``plain_lost="required"``: lost updates on
        the plain resources are the point (a stale writer's), not a violation."""
        found = [f"overlap {pair}" for pair in self.overlaps]
        if self.lost_work:
            found.append(
                f"lost work: {self.lost_work} of {self.published} published task(s) did not end exactly once"
            )
        if self.lost_updates and plain_lost == "forbidden":
            found.append(f"{self.lost_updates} lost update(s) in the register")
        found += [
            f"{hold.client} held {hold.resource} with {hold.yes} votes < quorum {hold.quorum}"
            for hold in self.without_quorum
        ]
        return found + self.fence_problems()

    def fence_problems(self) -> list[str]:
        found = [f"fence violation {violation}" for violation in self.fence_violations]
        if self.lost_updates_fenced:
            found.append(f"{self.lost_updates_fenced} lost update(s) in the fenced register")
        return found


def lost_updates(log: Sequence[int], final: int) -> int:
    """Writes that another write made vanish: the log has one entry per write, each should have
    raised the counter by one from the value it read."""
    duplicates = len(log) - len(set(log))
    return max(duplicates, len(log) - final)


def lost_work(published: Iterable[str], ran: Iterable[str], refused: Iterable[str]) -> int:
    """Published task ids that did not end exactly one way: ``ran`` has a task id once per
    execution that recorded its hold, ``refused`` once per run refused for good."""
    endings = Counter(ran) + Counter(refused)
    return sum(1 for task_id in set(published) if endings[task_id] != 1)


def fenced_lost_updates(entries: Iterable[tuple[int, int]], final: int) -> int:
    """``entries``: a fenced register's accepted writes as (value written, fence). Replayed in
    fence order they must read 1, 2, ..., n, and the register must end at n: each write that
    breaks the sequence (a lost update, or a write accepted out of fence order) counts once, and
    so does a final value that is not the last write's."""
    values = [value for value, _ in sorted(entries, key=lambda entry: entry[1])]
    breaks = sum(1 for before, value in zip([0, *values], values, strict=False) if value != before + 1)
    return breaks + (final != (values[-1] if values else 0))


def fence_violations(holds: Iterable[Hold]) -> list[FenceViolation]:
    """Per resource, fenced grants that share a fence, and grants ordered in real time whose
    fences are not (``A.t_acquired < B.t_invoked`` with ``F_A > F_B``; equal fences are already
    duplicates). Sorting by both times and sweeping once, with the largest fence among the
    grants returned so far, makes it O(n log n); each later grant is reported at most once,
    paired with that largest fence."""
    by_resource: dict[str, list[Hold]] = {}
    for hold in holds:
        if hold.fence is not None:
            by_resource.setdefault(hold.resource, []).append(hold)
    found: list[FenceViolation] = []
    for group in by_resource.values():
        returned = sorted(group, key=lambda h: h.t_acquired)
        first_with: dict[int, Hold] = {}
        for hold in returned:
            if _fence(hold) in first_with:
                found.append(FenceViolation("duplicate", first_with[_fence(hold)], hold))
            else:
                first_with[_fence(hold)] = hold
        largest: Hold | None = None
        i = 0
        for later in sorted(group, key=_invoked):
            while i < len(returned) and returned[i].t_acquired < _invoked(later):
                if largest is None or _fence(returned[i]) > _fence(largest):
                    largest = returned[i]
                i += 1
            if largest is not None and _fence(largest) > _fence(later):
                found.append(FenceViolation("order", largest, later))
    return found


def _invoked(hold: Hold) -> float:
    # A record without t_invoked orders nothing after it (sound: only pairs known apart count).
    return hold.t_invoked if hold.t_invoked is not None else hold.t_acquired


def _fence(hold: Hold) -> int:
    assert hold.fence is not None
    return hold.fence


def max_unavailable(holds: Iterable[Hold]) -> float:
    """The longest time, per resource, between the end of every window so far and the next
    acquisition, while the clients kept trying."""
    worst = 0.0
    by_resource: dict[str, list[Hold]] = {}
    for hold in holds:
        by_resource.setdefault(hold.resource, []).append(hold)
    for group in by_resource.values():
        group.sort(key=lambda h: h.t_acquired)
        reach = group[0].end
        for hold in group[1:]:
            worst = max(worst, hold.t_acquired - reach)
            reach = max(reach, hold.end)
    return worst


def check(
    records: Iterable[Mapping[str, Any]],
    logs: Mapping[str, Sequence[int]],
    counters: Mapping[str, int],
    *,
    fenced_logs: Mapping[str, Sequence[tuple[int, int]]] | None = None,
    refused: Mapping[str, int] | None = None,
    events: Iterable[Mapping[str, Any]] = (),
) -> Report:
    """``records``: hold and summary records; ``logs``: per plain resource, the values written in
    order; ``counters``: per resource, the register's final value; ``fenced_logs``: per fenced
    resource, (value, fence) per accepted write; ``refused``: per fenced resource, the register's
    refusals; ``events``: the nemeses' events (here, the stale writes) and, in a Celery run, the
    tasks published and the runs refused for good (lost work)."""
    report = Report()
    holds = []
    ran = []
    for record in records:
        if record["kind"] == "hold":
            holds.append(Hold.from_record(record))
            if "task_id" in record:
                ran.append(record["task_id"])
        elif record["kind"] == "summary":
            report.failures.update(record["failures"])
    report.holds = len(holds)
    report.operations = report.holds + sum(report.failures.values())
    report.overlaps = overlap.find_overlaps(hold.window() for hold in holds)
    report.without_quorum = [hold for hold in holds if hold.yes < hold.quorum]
    report.writes = sum(len(log) for log in logs.values())
    report.lost_updates = sum(lost_updates(log, counters.get(resource, 0)) for resource, log in logs.items())
    report.max_unavailable = max_unavailable(holds) if holds else 0.0
    report.lost_holds = sum(1 for hold in holds if hold.lost)
    fenced_logs = fenced_logs or {}
    report.fenced_holds = sum(1 for hold in holds if hold.fence is not None)
    report.fence_violations = fence_violations(holds)
    report.writes += sum(len(log) for log in fenced_logs.values())
    report.lost_updates_fenced = sum(
        fenced_lost_updates(log, counters.get(resource, 0)) for resource, log in fenced_logs.items()
    )
    report.refused = sum((refused or {}).values())
    events = list(events)
    published = [e["task_id"] for e in events if e["kind"] == "published"]
    report.published = len(published)
    final = [e["task_id"] for e in events if e["kind"] == "gave-up"]
    report.lost_work = lost_work(published, ran, final)
    for event in events:
        if event["kind"] != "stale-write":
            continue
        if event["fence"] is None:
            report.stale_plain += 1
        elif event["accepted"]:
            report.stale_fenced_accepted += 1
        else:
            report.stale_fenced_refused += 1
    return report
