"""The checker on hand-written histories: it must see every kind of violation it claims to."""

from __future__ import annotations

from typing import Any

from celery_redlock.testing import find_overlaps

from .checker import Hold, check, lost_updates, max_unavailable


def hold(
    client: str,
    start: float,
    validity_end: float,
    released: float | None = None,
    *,
    resource: str = "r",
    yes: int = 3,
    token: str = "",
) -> Hold:
    return Hold(client, resource, token or f"{client}@{start}", start, validity_end, released, yes, 3)


def test_an_abandoned_hold_lasts_until_its_validity_ends() -> None:
    # Never released: the window is the validity, so a successor before it ends overlaps.
    assert find_overlaps([hold("a", 0.0, 1.0).window(), hold("b", 0.99, 2.0, 1.5).window()])
    assert not find_overlaps([hold("a", 0.0, 1.0).window(), hold("b", 1.0, 2.0, 1.5).window()])
    # Released early: the window ends at the release, not at the validity.
    assert not find_overlaps([hold("a", 0.0, 1.0, 0.5).window(), hold("b", 0.5, 1.5).window()])


def test_lost_updates_are_counted_from_the_log_and_the_final_value() -> None:
    assert lost_updates([1, 2, 3], 3) == 0
    assert lost_updates([1, 2, 2, 3], 3) == 1  # two holders read 1 and both wrote 2
    assert lost_updates([1, 2, 3], 2) == 1  # a write the log shows but the register lost


def test_max_unavailability_is_the_longest_gap_between_windows() -> None:
    holds = [hold("a", 0.0, 1.0, 0.2), hold("b", 0.5, 1.5, 0.6), hold("c", 1.6, 2.6, 1.7)]
    assert abs(max_unavailable(holds) - 1.0) < 1e-9


def test_check_reports_everything_from_records() -> None:
    def record(h: Hold) -> dict[str, Any]:
        return {
            "kind": "hold",
            "client": h.client,
            "resource": h.resource,
            "token": h.token,
            "t_acquired": h.t_acquired,
            "validity_end": h.validity_end,
            "t_released": h.t_released,
            "yes": h.yes,
            "quorum": h.quorum,
            "wrote": True,
            "lost": "",
        }

    records = [
        record(hold("a", 0.0, 1.0, 0.5)),
        record(hold("b", 0.4, 1.4, 0.8, yes=2)),
        {"kind": "summary", "client": "a", "holds": 1, "failures": {"contended": 4}},
        {"kind": "summary", "client": "b", "holds": 1, "failures": {"unreachable": 1}},
    ]
    report = check(records, {"r": [1, 1]}, {"r": 1})
    assert report.holds == 2 and report.operations == 7
    assert len(report.overlaps) == 1 and report.lost_updates == 1
    assert str(report.overlaps[0]) == "r: b acquired 100.0 ms before the window of a ended"
    assert [h.client for h in report.without_quorum] == ["b"]
    assert report.failures == {"contended": 4, "unreachable": 1}
    assert len(report.problems()) == 3
