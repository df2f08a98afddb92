"""Periodic jobs through real beats and the shared real worker (4 threads, so runs could overlap).

- A job that takes 3 periods, ``base=RedlockTask``: its runs never overlap; the sends that
  find it running are skipped.
- ``lock_slot`` with ``lock_release="on_expiry"``: two plain ``PersistentScheduler`` beats (the
  mistake this mode is for) both send every tick, and each slot still runs exactly once.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter

import pytest

from celery_redlock.testing import Hold, find_overlaps

from .conftest import Beats, Records, wait_until

JOB_SECONDS = 3.0


@pytest.mark.timeout(60)
def test_job_taking_three_periods_never_overlaps(beats: Beats, records: Records, beat_worker: object) -> None:
    beats.start(1, task="tests.beat.beatapp.long_job", args=[JOB_SECONDS])
    wait_until(lambda: len(records.runs()) >= 3, 30, "three runs of the 3-second job")
    for beat in beats.procs:
        beat.stop()
    records.wait_all_done()

    runs = records.runs()
    overlaps = find_overlaps(Hold("long_job", r["start"], r["end"], owner=r["id"]) for r in runs)
    sent = len(records.published())
    print(
        f"\n[beat] 3-period job: {sent} sent, {len(runs)} ran, {sent - len(runs)} skipped, "
        f"{len(overlaps)} overlaps"
    )
    assert overlaps == []
    # The beat did send while a run was in progress: the lock is what kept them apart.
    assert sent > len(runs)
    # Every send ended SUCCESS: the runs, and the skips (a skip succeeds with its marker). (A
    # beat stopped by SIGTERM between a publish and its record leaves a run with no record.)
    done = records.done()
    assert {d["state"] for d in done} == {"SUCCESS"}
    assert {p["id"] for p in records.published()} <= {d["id"] for d in done}
    assert sum(1 for d in done if not d["skipped"]) == len(runs)


@pytest.mark.timeout(60)
def test_two_plain_beats_by_mistake_one_run_per_slot(
    beats: Beats, records: Records, beat_worker: object
) -> None:
    beats.start(2, task="tests.beat.beatapp.slot_job")  # celery's own PersistentScheduler
    wait_until(lambda: len({r["lock"] for r in records.runs()}) >= 8, 30, "8 slots to run")
    for beat in beats.procs:
        beat.stop()
    records.wait_all_done()

    runs = records.runs()
    per_slot = Counter(r["lock"] for r in runs)
    sent = records.sent()
    print(
        f"\n[beat] once per slot, 2 plain beats: {len(sent)} sent, {len(per_slot)} slots, "
        f"{len(runs)} runs, doubled {sum(1 for c in per_slot.values() if c > 1)}"
    )
    assert [lock for lock, count in per_slot.items() if count > 1] == []
    seconds = sorted(int(dt.datetime.fromisoformat(lock.rsplit("@", 1)[1]).timestamp()) for lock in per_slot)
    assert seconds == list(range(seconds[0], seconds[-1] + 1)), "a slot ran nowhere"
    assert {s["pid"] for s in sent} == {b.pid for b in beats.procs}, "both beats sent"
    assert len(sent) > len(runs), "the duplicates were sent and then suppressed"
