"""The mutual-exclusion check every suite and the demo share: do two holds of one resource overlap?

A hold is the window ``[start, end)`` in which its holder was entitled to act on ``resource``:
from when it had the lock to the earlier of its release and the end of its validity, on a clock
every holder shares (``time.monotonic()`` on one machine). The invariant a lock must keep:

    No hold of a resource starts before an earlier-starting hold of that resource has ended.

The window is half-open, so a hold that starts at the very instant the previous one ends (touching
endpoints, ``later.start == earlier.end``) is no overlap: a release followed at once by the next
acquisition is the lock working. Holds that start at the same instant are ordered by their ends.

The check needs nothing but the windows, so it reads any recorded history (a fault run's records,
a demo ledger, a Celery test's intervals) after the fact, the way Jepsen checks a lock service,
and loads no Celery and no Redis client.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Hold:
    """One holder's window on one resource.

    ``owner`` names the holder in reports (a client, a task id); ``info`` carries whatever record
    the caller built the hold from, so an overlap leads back to it. ``info`` takes no part in
    equality or hashing, so a hold may carry an unhashable record such as a dict.
    """

    resource: str
    start: float
    end: float
    owner: str = ""
    info: Any = field(default=None, compare=False)

    def __str__(self) -> str:
        return self.owner or f"[{self.start:.3f}, {self.end:.3f})"


@dataclass(frozen=True)
class Overlap:
    """``second`` started while ``first``, which started no later, still held the resource."""

    first: Hold
    second: Hold

    @property
    def resource(self) -> str:
        return self.first.resource

    @property
    def seconds(self) -> float:
        """How long the two windows were both open."""
        return min(self.first.end, self.second.end) - self.second.start

    def __str__(self) -> str:
        return (
            f"{self.resource}: {self.second} acquired {self.seconds * 1000:.1f} ms "
            f"before the window of {self.first} ended"
        )


def find_overlaps(holds: Iterable[Hold]) -> list[Overlap]:
    """Every hold that starts inside the window of an earlier hold of the same resource.

    Empty exactly when the module's invariant holds, which for windows of positive length means
    no two windows of one resource intersect. Each offending hold is reported once, paired with
    the earlier hold whose window reaches furthest (it started inside that one if it started
    inside any), so n holds yield at most n - 1 overlaps, sorted by resource, then start.
    Sorting each resource's holds by start and sweeping them once with that furthest end makes
    the check O(n log n): it stays cheap on a fault run's many thousand holds.
    """
    by_resource: dict[str, list[Hold]] = {}
    for hold in holds:
        by_resource.setdefault(hold.resource, []).append(hold)
    found: list[Overlap] = []
    for resource in sorted(by_resource):
        ordered = sorted(by_resource[resource], key=lambda hold: (hold.start, hold.end))
        furthest = ordered[0]
        for hold in ordered[1:]:
            if hold.start < furthest.end:  # strict: touching endpoints are no overlap
                found.append(Overlap(furthest, hold))
            if hold.end > furthest.end:
                furthest = hold
    return found
