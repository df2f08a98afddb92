"""The checker on hand-written histories: it must see every kind of violation it claims to."""

from __future__ import annotations

from typing import Any

import pytest

from celery_redlock.testing import find_overlaps

from .checker import (
    Hold,
    Report,
    check,
    fence_violations,
    fenced_lost_updates,
    lost_updates,
    lost_work,
    max_unavailable,
)


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


def grant(client: str, invoked: float, acquired: float, fence: int | None, *, resource: str = "f") -> Hold:
    """A fenced grant: acquire() called at ``invoked``, returned at ``acquired``."""
    return Hold(
        client,
        resource,
        f"{client}@{acquired}",
        acquired,
        acquired + 1.0,
        None,
        3,
        3,
        fence=fence,
        t_invoked=invoked,
    )


def test_fences_that_follow_real_time_are_not_flagged() -> None:
    holds = [grant("a", 0.0, 0.1, 5), grant("b", 0.2, 0.3, 9), grant("c", 0.4, 0.5, 10)]
    assert fence_violations(holds) == []
    # Calls that overlap in time are not ordered: either fence order is a linearization.
    assert fence_violations([grant("a", 0.0, 1.0, 10), grant("b", 0.5, 1.2, 5)]) == []
    # Touching is not before: b was invoked at the instant a returned.
    assert fence_violations([grant("a", 0.0, 1.0, 10), grant("b", 1.0, 1.2, 5)]) == []
    # Only grants of one resource are compared, and unfenced holds are ignored.
    assert fence_violations([grant("a", 0.0, 0.1, 10), grant("b", 0.2, 0.3, 5, resource="g")]) == []
    assert fence_violations([grant("a", 0.0, 0.1, 10), grant("b", 0.2, 0.3, None)]) == []


def test_a_later_grant_with_a_lower_fence_is_flagged() -> None:
    [found] = fence_violations([grant("a", 0.0, 0.1, 10), grant("b", 0.2, 0.3, 5)])
    assert found.kind == "order" and (found.earlier.client, found.later.client) == ("a", "b")
    assert str(found) == (
        "f: a was granted fence 10 at 0.100, before b called acquire at 0.200 "
        "and was granted the lower fence 5"
    )
    # Paired with the largest fence returned before it, not the latest grant (c's call overlaps
    # a's, so c itself is not ordered after a).
    holds = [grant("a", 0.0, 0.1, 20), grant("c", 0.05, 0.3, 12), grant("b", 0.4, 0.5, 15)]
    [found] = fence_violations(holds)
    assert (found.earlier.client, found.later.client) == ("a", "b")
    # Each grant that breaks the order is reported once.
    holds = [grant("a", 0.0, 0.1, 20), grant("b", 0.2, 0.3, 5), grant("c", 0.4, 0.5, 6)]
    assert [(v.earlier.client, v.later.client) for v in fence_violations(holds)] == [("a", "b"), ("a", "c")]


def test_a_fence_granted_twice_is_flagged_once_as_a_duplicate() -> None:
    # In real time order or overlapping, equal fences are a duplicate, not an order violation.
    for holds in (
        [grant("a", 0.0, 0.1, 7), grant("b", 0.2, 0.3, 7)],
        [grant("a", 0.0, 1.0, 7), grant("b", 0.5, 1.2, 7)],
    ):
        [found] = fence_violations(holds)
        assert found.kind == "duplicate"
        assert str(found) == "f: a and b were both granted fence 7"


@pytest.mark.timeout(20)
def test_the_fence_check_is_a_sweep_not_a_pairwise_search() -> None:
    # 20000 grants in order plus one out of order at the end: found, in well under the timeout.
    holds = [grant(f"c{i}", i * 1.0, i * 1.0 + 0.5, i + 10) for i in range(20_000)]
    holds.append(grant("late", 30_000.0, 30_000.5, 3))
    [found] = fence_violations(holds)
    assert (found.earlier.client, found.later.client) == ("c19999", "late")


def test_the_fenced_history_must_be_serial_in_fence_order() -> None:
    assert fenced_lost_updates([(1, 5), (2, 7), (3, 9)], 3) == 0
    assert fenced_lost_updates([(2, 7), (1, 5), (3, 9)], 3) == 0  # log order does not matter
    assert fenced_lost_updates([], 0) == 0
    # A stale writer (fence 6) read 1 and wrote 2 after fence 7 had: one write lost.
    assert fenced_lost_updates([(1, 5), (2, 7), (2, 6)], 2) == 1
    # Accepted out of fence order (3 under fence 7 before 2 under fence 9): both break the sequence.
    assert fenced_lost_updates([(1, 5), (3, 7), (2, 9)], 2) == 2
    # A write the log shows but the register does not end with.
    assert fenced_lost_updates([(1, 5), (2, 7)], 1) == 1


def test_check_reports_fences_refusals_and_stale_writes() -> None:
    def record(h: Hold) -> dict[str, Any]:
        return {
            "kind": "hold",
            "client": h.client,
            "resource": h.resource,
            "token": h.token,
            "t_acquired": h.t_acquired,
            "validity_end": h.t_acquired + 0.1,
            "t_released": None,
            "yes": 3,
            "quorum": 3,
            "wrote": True,
            "lost": "",
            "fence": h.fence,
            "t_invoked": h.t_invoked,
        }

    records = [record(grant("a", 0.0, 0.1, 9)), record(grant("b", 0.2, 0.3, 4))]
    events: list[dict[str, Any]] = [
        {"kind": "stale-paused", "fence": 9},
        {"kind": "stale-write", "fence": None, "accepted": True},
        {"kind": "stale-write", "fence": 9, "accepted": False},
        {"kind": "stale-write", "fence": 4, "accepted": True},
    ]
    report = check(
        records,
        {"r": [1, 1]},
        {"r": 1, "f": 1},
        fenced_logs={"f": [(1, 9), (2, 4)]},
        refused={"f": 3},
        events=events,
    )
    assert report.fenced_holds == 2 and report.writes == 4 and report.refused == 3
    assert [v.kind for v in report.fence_violations] == ["order"]
    assert report.lost_updates == 1 and report.lost_updates_fenced == 2
    assert (report.stale_plain, report.stale_fenced_refused, report.stale_fenced_accepted) == (1, 1, 1)
    # A stale writer's plain lost update may be required; fence problems never are.
    assert report.problems(plain_lost="required") == [
        f"fence violation {report.fence_violations[0]}",
        "2 lost update(s) in the fenced register",
    ]
    assert "1 lost update(s) in the register" in report.problems()


def test_a_scenario_built_to_break_fences_fails_if_the_check_finds_nothing() -> None:
    from celery_redlock.testing.overlap import Overlap

    from .scenarios import BY_NAME, Result

    def result(name: str, holds: list[Hold]) -> Result:
        report = Report(holds=len(holds), fenced_holds=len(holds), fence_violations=fence_violations(holds))
        if BY_NAME[name].expect == "violation":
            first, second = (h.window() for h in holds[:2])
            report.overlaps = [Overlap(first, second)]
        return Result(BY_NAME[name], 11.0, 7, report, [], [], {"kill": 1})

    backwards = [grant("a", 0.0, 0.1, 60_000_010), grant("b", 0.2, 0.3, 10)]
    forwards = [grant("a", 0.0, 0.1, 10), grant("b", 0.2, 0.3, 60_000_010)]
    assert result("fence-clock-ahead", backwards).problems() == []
    assert result("fence-clock-ahead", forwards).problems() == [
        "expected the fence check to find a fence gone backwards; it found none"
    ]
    # Its control, with the counters kept, must show none.
    assert result("fence-clock-ahead-fsync", forwards).problems() == []
    [problem] = result("fence-clock-ahead-fsync", backwards).problems()
    assert problem.startswith("fence violation f: a was granted fence 60000010")


def test_lost_work_counts_published_tasks_that_did_not_end_exactly_once() -> None:
    published = ["ran", "refused", "never", "twice", "both"]
    ran = ["ran", "twice", "twice", "both", "not-published"]
    refused = ["refused", "both"]
    # never: no ending; twice: two runs; both: a run and a refusal. The rest ended once.
    assert lost_work(published, ran, refused) == 3
    assert lost_work(["a", "b"], ["a", "b"], []) == 0
    assert lost_work([], ["a"], []) == 0


def test_check_reports_lost_work_from_the_published_events() -> None:
    def record(client: str, task_id: str, start: float) -> dict[str, Any]:
        h = hold(client, start, start + 1.0, start + 0.5)
        return {
            "kind": "hold",
            "client": h.client,
            "task_id": task_id,
            "resource": h.resource,
            "token": h.token,
            "t_acquired": h.t_acquired,
            "validity_end": h.validity_end,
            "t_released": h.t_released,
            "yes": 3,
            "quorum": 3,
            "wrote": True,
            "lost": "",
        }

    records = [record("w1", "t1", 0.0), record("w2", "t2", 1.0)]
    events: list[dict[str, Any]] = [
        {"kind": "published", "task_id": "t1"},
        {"kind": "published", "task_id": "t2"},
        {"kind": "published", "task_id": "t3"},
        {"kind": "gave-up", "task_id": "t3", "policy": "skip"},
    ]
    report = check(records, {"r": [1, 2]}, {"r": 2}, events=events)
    assert (report.published, report.lost_work, report.problems()) == (3, 0, [])
    events.append({"kind": "published", "task_id": "t4"})  # never ended
    records.append(record("w1", "t1", 2.0))  # ran a second time
    report = check(records, {"r": [1, 2, 3]}, {"r": 3}, events=events)
    assert report.lost_work == 2
    assert report.problems() == ["lost work: 2 of 4 published task(s) did not end exactly once"]
    # Runs that publish nothing (the client workloads) have no lost work to count.
    assert check(records, {"r": [1, 2, 3]}, {"r": 3}).lost_work == 0
