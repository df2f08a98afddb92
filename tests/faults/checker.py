"""Checks a run from its recorded history alone, the way Jepsen checks a lock service.

A hold's window is ``[t_acquired, end)`` where ``end`` is the earlier of its validity end and its
release: the span in which its holder was entitled to act. Two windows of one resource that
intersect are an overlap (a mutual-exclusion violation), whatever the holders did inside them;
that rule is ``celery_redlock.testing.overlap``'s, the one the demo and the other suites use.
The register shows the consequences: every write appends to a log, so a write that collided with
another (both read the same value) is a lost update.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    lost_holds: int = 0  # holds whose ensure() raised: the holder stopped before writing

    def problems(self) -> list[str]:
        """Safety violations: empty when the run kept mutual exclusion."""
        found = [f"overlap {pair}" for pair in self.overlaps]
        if self.lost_updates:
            found.append(f"{self.lost_updates} lost update(s) in the register")
        found += [
            f"{hold.client} held {hold.resource} with {hold.yes} votes < quorum {hold.quorum}"
            for hold in self.without_quorum
        ]
        return found


def lost_updates(log: Sequence[int], final: int) -> int:
    """Writes that another write made vanish: the log has one entry per write, each should have
    raised the counter by one from the value it read."""
    duplicates = len(log) - len(set(log))
    return max(duplicates, len(log) - final)


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
) -> Report:
    """``records``: hold and summary records; ``logs``: per resource, the values written in order;
    ``counters``: per resource, the register's final value."""
    report = Report()
    holds = []
    for record in records:
        if record["kind"] == "hold":
            holds.append(Hold.from_record(record))
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
    return report
