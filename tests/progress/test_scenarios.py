"""The progress invariant (see ``checker.py``) on real workers of each pool over three real masters:
the sequences a user writes every day, where a finished step's lock must never stand in the way
of the next step of the same resource.

- a chain of ten links on one key in skip mode: none is skipped;
- twenty sequential ``delay(k).get()`` in fail mode: none fails with LockNotAcquired;
- a ten-link chain on one key in retry mode: no lock retry at all, and about as fast as the same
  chain in wait mode;
- groups and a chord on few keys in skip mode: skips happen, and each names a holder that was
  running when it was refused.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_redlock.testing import CeleryWorker

from .checker import Report
from .conftest import POOLS, live_queue
from .harness import Workload

Workers = dict[str, tuple[str, list[CeleryWorker]]]
PROGRESS_POOLS = sorted(POOLS)


def explain(report: Report, workload: Workload) -> str:
    problems = report.problems()
    shown = "\n  ".join(problems[:15])
    more = f"\n  ... and {len(problems) - 15} more" if len(problems) > 15 else ""
    return f"tag {workload.tag}: {report.summary()}\n  {shown}{more}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", PROGRESS_POOLS)
def test_a_chain_on_one_key_in_skip_mode_skips_no_link(
    progress_app: Any, progress_workers: Workers, pool: str
) -> None:
    w = Workload(progress_app, live_queue(progress_workers, pool))
    w.chain("skip", ["k"] * 10, [0.0] * 10)
    report = w.check()
    assert report.outcomes["skipped"] == 0, explain(report, w)
    assert report.outcomes["ran"] == 10 and not report.problems(), explain(report, w)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", PROGRESS_POOLS)
def test_sequential_gets_in_fail_mode_never_fail(
    progress_app: Any, progress_workers: Workers, pool: str
) -> None:
    w = Workload(progress_app, live_queue(progress_workers, pool))
    w.sequential([("fail", [("k", 0.0)] * 20)])
    report = w.check()
    assert report.outcomes["failed"] == 0, explain(report, w)
    assert report.outcomes["ran"] == 20 and not report.problems(), explain(report, w)


def _chain_wall_time(w: Workload, mode: str, name: str) -> float:
    """Seconds from publishing a ten-link no-op chain on one key to its last link's result."""
    started = time.monotonic()
    ids = w.chain(mode, [name] * 10, [0.0] * 10)
    w.app.AsyncResult(ids[-1]).get(timeout=60, propagate=False)
    return time.monotonic() - started


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", PROGRESS_POOLS)
def test_a_chain_in_retry_mode_needs_no_lock_retry(
    progress_app: Any, progress_workers: Workers, pool: str
) -> None:
    w = Workload(progress_app, live_queue(progress_workers, pool))
    waited = _chain_wall_time(w, "wait", "waits")
    retried = _chain_wall_time(w, "retry", "retries")
    report = w.check()
    times = f"retry mode {retried:.2f} s, wait mode {waited:.2f} s; "
    assert report.refusals["retry"] == 0, times + explain(report, w)
    assert report.outcomes["ran"] == 20 and not report.problems(), times + explain(report, w)
    # Comparable: a single lock retry costs up to 0.25 s of backoff plus a trip through the broker.
    assert retried <= 2 * waited + 0.5, times


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", PROGRESS_POOLS)
def test_groups_and_a_chord_in_skip_mode_skip_only_for_a_running_holder(
    progress_app: Any, progress_workers: Workers, pool: str
) -> None:
    w = Workload(progress_app, live_queue(progress_workers, pool))
    w.group("skip", [i % 3 for i in range(12)], [0.15, 0.0, 0.05] * 4)
    w.chord("skip", [i % 2 for i in range(6)], [0.1, 0.0] * 3, body=0)
    w.group("skip", ["a"] * 4, [0.2, 0.0, 0.0, 0.0])
    report = w.check()
    assert report.outcomes["skipped"] >= 1, f"no skip happened, so nothing was checked: {report.summary()}"
    assert not report.problems(), explain(report, w)
