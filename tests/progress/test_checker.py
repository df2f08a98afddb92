"""The progress checker on hand-made histories: a good one passes, and each kind of violation is
found under its own rule, so the checker cannot be one that never fails."""

from __future__ import annotations

from typing import Any

import pytest

from .checker import TOLERANCE, Published, Report, Result, check, holder_task_id

K = "t.k"


class History:
    """A history written the way the workers write it (see progressapp.py)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.published: list[Published] = []
        self.results: dict[str, Result] = {}

    def publish(
        self, task_id: str, *, key: str = K, after: tuple[str, ...] = (), t: float | None = None
    ) -> None:
        self.published.append(Published(task_id, key, after, after, t))

    def ran(
        self,
        task_id: str,
        start: float,
        end: float | None,
        *,
        key: str = K,
        visible: float | None = None,
        released: float | None = None,
        run: str | None = None,
    ) -> None:
        """A body from ``start`` to ``end`` (None: it died), its lock granted 5 ms before it
        started by a round that took 2 ms; visible and released just after its end by default."""
        run = run or f"{task_id}@{start}"
        self.events.append(
            {
                "event": "start",
                "task_id": task_id,
                "key": key,
                "run": run,
                "t": start,
                "t_try": start - 0.01,
                "t_acquired": start - 0.005,
                "elapsed": 0.002,
            }
        )
        if end is None:
            return
        self.events.append({"event": "end", "task_id": task_id, "key": key, "run": run, "t": end})
        self.events.append(
            {"event": "released", "task_id": task_id, "key": key, "t": released or end + 0.001}
        )
        self.events.append({"event": "visible", "task_id": task_id, "key": key, "t": visible or end + 0.002})
        self.results.setdefault(task_id, Result("SUCCESS"))

    def refused(
        self,
        task_id: str,
        policy: str,
        t_try: float,
        t: float,
        holder: str | None,
        *,
        key: str = K,
        held: bool = True,
        result: bool = True,
    ) -> None:
        self.events.append(
            {
                "event": "refused",
                "task_id": task_id,
                "key": key,
                "policy": policy,
                "t_try": t_try,
                "t": t,
                "holder": holder,
                "held": held,
            }
        )
        if result and policy == "skip":
            self.results[task_id] = Result("SUCCESS", skipped=True, holder=holder)
        elif result and policy in ("fail", "exhausted"):
            self.results[task_id] = Result("FAILURE", holder=holder, error="LockNotAcquired")

    def check(self) -> Report:
        return check(self.published, self.events, self.results)


def good() -> History:
    h = History()
    for task_id in "abcdefghij":
        h.publish(task_id)
    h.publish("c2", after=("c1",))  # a chain: c1 -> c2 -> c3
    h.publish("c1")
    h.publish("c3", after=("c2",))
    h.ran("a", 1.0, 2.0)
    h.refused("b", "skip", 1.2, 1.25, "a")  # skipped while a ran
    h.refused("c", "fail", 1.9, 2.0 + TOLERANCE, "a")  # a ended, its release within the tolerance
    h.refused("d", "retry", 1.5, 1.51, None)  # retried while a ran ...
    h.ran("d", 2.2, 2.3)  # ... and ran once a was done
    # e died holding its lock (no end); its redelivered copy waits for that lock, then runs.
    h.ran("e", 3.0, None, key="t.e")
    h.refused("e", "retry", 3.5, 3.51, "e", key="t.e")
    h.ran("e", 13.0, 13.5, key="t.e")
    h.ran("f", 4.0, 4.5, key="t.f")
    h.ran("g", 4.5, 5.0, key="t.f")  # touching windows are no overlap
    h.refused("h", "retry", 4.6, 4.61, None, key="t.h", held=False)  # no quorum: not judged
    h.ran("h", 4.7, 4.8, key="t.h")
    h.refused("i", "exhausted", 4.1, 4.2, "f", key="t.f")
    # j was published while f was queued (at 3.9, before it ran) and deduplicated against it.
    h.events.append({"event": "deduplicated", "task_id": "j", "key": "t.f", "t": 3.95, "existing": "f"})
    h.published[5] = Published("f", "t.f", t=3.9)
    h.ran("c1", 6.0, 6.1, key="t.c")
    h.ran("c2", 6.2, 6.3, key="t.c")
    h.ran("c3", 6.4, 6.5, key="t.c")
    return h


def test_a_good_history_passes_with_every_outcome_counted() -> None:
    report = good().check()
    assert report.problems() == []
    assert report.outcomes == {"ran": 9, "skipped": 1, "failed": 2, "deduplicated": 1}
    assert report.refusals == {"skip": 1, "fail": 1, "retry": 3, "exhausted": 1}
    assert report.lost == 0 and report.late_releases == 0
    assert report.summary().startswith("13 tasks: deduplicated 1, failed 2, ran 9, skipped 1;")


def test_a_chain_stopped_by_a_failure_cancels_its_later_links() -> None:
    h = History()
    h.publish("a")
    h.publish("x")
    h.publish("y", after=("x",))
    h.publish("z", after=("y",))
    h.ran("a", 1.0, 2.0)
    h.refused("x", "fail", 1.1, 1.2, "a")
    # Celery stores x's failure for the links it never published; a chord body gets ChordError.
    h.results["y"] = Result("FAILURE", error="LockNotAcquired", holder="a")
    h.results["z"] = Result("FAILURE", error="ChordError")
    report = h.check()
    assert report.problems() == [] and report.outcomes == {"ran": 1, "failed": 1, "cancelled": 2}


def violations(h: History, rule: str, *, also: tuple[str, ...] = ()) -> list[str]:
    """The violations of ``rule`` (there must be some), and no problem under any other rule
    than those in ``also``."""
    report = h.check()
    found = [str(v) for v in report.of(rule)]
    assert found, f"expected a {rule} violation: {report.summary()}"
    others = [p for p in report.problems() if p.split(":")[0] not in (rule, *also)]
    assert others == [], others
    return found


def test_a_task_that_never_ended_is_lost() -> None:
    h = good()
    h.publish("lost")
    [found] = violations(h, "outcome")
    assert found == "outcome: lost: never ended (state PENDING, 0 run(s), refusals none)"
    assert h.check().lost == 1


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (Result("SUCCESS", skipped=True, holder="a"), "skipped, yet its body ran 1 time(s)"),
        (Result("FAILURE", error="ValueError"), "failed with ValueError"),
    ],
)
def test_a_result_the_history_does_not_bear_out_is_lost(result: Result, message: str) -> None:
    h = good()
    h.results["a"] = result
    assert f"outcome: a: {message}" in violations(h, "outcome")


def test_a_success_without_a_run_is_lost() -> None:
    h = good()
    h.publish("ghost")
    h.results["ghost"] = Result("SUCCESS")
    assert violations(h, "outcome") == ["outcome: ghost: SUCCESS without a finished run of its body"]


def test_a_skip_must_name_its_holder_and_the_same_one_as_its_refusal() -> None:
    h = good()
    h.results["b"] = Result("SUCCESS", skipped=True, holder=None)
    assert violations(h, "outcome") == [
        "outcome: b: skipped naming no holder (result None, refusal a)",
    ]
    h.results["b"] = Result("SUCCESS", skipped=True, holder="d")
    assert violations(h, "outcome") == ["outcome: b: skipped: the result names d, the refusal a"]


def test_a_skip_that_also_ran_or_was_never_refused_is_lost() -> None:
    h = good()
    h.refused("a", "skip", 0.5, 0.6, "d", result=False)  # a refusal of a, which then ran anyway
    assert "outcome: a: ran, yet also refused: skip" in h.check().problems()
    h = good()
    h.publish("s")
    h.results["s"] = Result("SUCCESS", skipped=True, holder="a")  # a skip marker, no refusal
    assert violations(h, "outcome") == ["outcome: s: skipped with refusals none: not exactly one skip/fail"]


def test_a_body_that_ran_twice_breaks_once() -> None:
    h = good()
    h.ran("a", 2.5, 2.6, run="again")
    [found] = violations(h, "once")
    assert found.startswith("once: a: its body ran 2 times")


def test_a_run_that_never_ended_without_a_redelivery_breaks_once() -> None:
    h = good()
    h.ran("a", 2.5, None, key="t.z")
    [found] = violations(h, "once")
    assert found.startswith("once: a: an execution started and never ended")


def test_a_skip_after_the_holder_finished_breaks_holding() -> None:
    h = good()
    # b's refusal begins just past a's end plus the tolerance: a was no longer holding.
    h.events = [e for e in h.events if not (e["event"] == "refused" and e["task_id"] == "b")]
    h.refused("b", "skip", 2.0 + TOLERANCE + 0.001, 2.2, "a")
    [found] = violations(h, "holding")
    assert found.startswith(
        "holding: b: skip of b on t.k in [2.101, 2.200] naming a: the holder was not holding"
    )


def test_a_refusal_before_the_holder_acquired_breaks_holding() -> None:
    h = good()
    h.refused("early", "fail", 0.5, 0.8, "a")  # a's acquire round began at 0.993
    h.publish("early")
    assert violations(h, "holding")[0].endswith("the holder was not holding: a (body 1.000..2.000)")


@pytest.mark.parametrize(
    ("holder", "message"),
    [
        ("nobody", "the holder it names never ran on this key"),
        (None, "no run of this key was holding"),
    ],
)
def test_a_refusal_with_no_holder_running_breaks_holding(holder: str | None, message: str) -> None:
    h = good()
    h.publish("z")
    h.refused("z", "skip" if holder else "retry", 8.0, 8.1, holder)
    if holder is None:
        h.ran("z", 8.2, 8.3)
    [found] = violations(h, "holding")
    assert found.endswith(message)


def test_a_copy_of_a_dead_run_that_skips_instead_of_waiting_breaks_holding() -> None:
    h = good()
    h.publish("dead")
    h.ran("dead", 9.0, None, key="t.dead")
    h.refused("dead", "skip", 9.5, 9.6, "dead", key="t.dead")
    assert violations(h, "holding", also=("outcome", "once")) == [
        "holding: dead: skip of dead on t.dead in [9.500, 9.600] naming dead: named an earlier run "
        "of itself, and did not wait for its lock"
    ]
    # Its work is lost: the run died and the copy did not run it.
    assert h.check().lost == 1


def test_a_chain_link_refused_by_its_predecessor_breaks_the_sequential_rule() -> None:
    h = good()
    # c2 was published after c1's completion; c1's release lags, within the tolerance.
    h.refused("c2", "retry", 6.105, 6.106, None, key="t.c")
    [found] = violations(h, "sequential")
    assert found.endswith("it was published after c1's completion")
    # Transitively: c3 was published after c2's, so after c1's too.
    h = good()
    h.refused("c3", "skip", 6.105, 6.106, "c1", key="t.c")
    h.events = [e for e in h.events if not (e["task_id"] == "c3" and e["event"] != "refused")]
    assert violations(h, "sequential")[0].endswith("it was published after c1's completion")


def test_an_attempt_begun_after_the_holders_completion_was_visible_breaks_the_sequential_rule() -> None:
    # No tolerance: one millisecond after a's completion became visible (at 2.002) is too late,
    # though a's window (its end plus the tolerance) still meets the refusal.
    h = good()
    h.publish("late")
    h.refused("late", "fail", 2.003, 2.004, "a")
    [found] = violations(h, "sequential")
    assert found.endswith("its attempt began 1.0 ms after a's completion was visible")
    h = good()
    h.publish("late")
    h.refused("late", "fail", 2.0015, 2.004, "a")
    assert h.check().problems() == []


def test_overlapping_bodies_of_one_key_break_exclusion() -> None:
    h = good()
    h.publish("o")
    h.ran("o", 1.5, 1.6)
    report = h.check()
    assert [str(o) for o in report.overlaps] == ["t.k: o acquired 100.0 ms before the window of a ended"]
    assert report.problems() == ["exclusion: t.k: o acquired 100.0 ms before the window of a ended"]


@pytest.mark.parametrize(
    ("existing", "at", "rule", "message"),
    [
        (
            "f",
            4.7,
            "sequential",
            "deduplicated at 4.700 naming f: the publish began 198.0 ms after f's completion was visible",
        ),
        ("f", 3.5, "holding", "deduplicated at 3.500 naming f, published only at 3.900"),
        ("nope", 4.7, "holding", "deduplicated at 4.700 naming nope, which is no task published here"),
    ],
)
def test_a_deduplication_against_a_task_not_queued_or_running_is_a_violation(
    existing: str, at: float, rule: str, message: str
) -> None:
    h = good()
    h.publish("j2")
    h.events.append({"event": "deduplicated", "task_id": "j2", "key": "t.f", "t": at, "existing": existing})
    assert violations(h, rule) == [f"{rule}: j2: {message}"]


def test_releases_after_the_completion_was_visible_are_counted() -> None:
    h = good()
    h.ran("a", 1.0, 2.0, visible=2.001, released=2.01)
    assert h.check().late_releases == 1


def test_the_holder_id_is_read_from_the_description_lock_not_acquired_carries() -> None:
    task_id = "0a1b2c3d" * 4
    assert holder_task_id(f"task progress.skip {task_id} on host-1 pid 4411 for 0.3 s") == task_id
    assert holder_task_id("") is None
    assert holder_task_id("'a plain client'") is None
