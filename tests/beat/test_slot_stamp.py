"""The beat's slot stamp on real parts: ``celery beat`` processes with RedlockScheduler over the
5 real masters, a real worker running a ``lock_slot`` task, and messages sent by hand with and
without the stamp.

- A leader stamps every message with the due time it fired for; the worker's lock name carries
  exactly that instant.
- A leader that fell several ticks behind sends the overdue entry at once, stamped with the tick
  it was due for (by celery's interval meaning, or the aligned boundary), and the next real tick
  still runs in a slot of its own.
- Stamped vs unstamped: a stamp wins over the publish time and is never recomputed; an unstamped
  message is placed by its publish time, a late one in its own slot rather than the next.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redlock.celery.slots import PUBLISHED_HEADER, SLOT_HEADER, render
from celery_redlock.testing import RedisServer, ServerSet
from celery_redlock.testing.celery import CeleryBeat, CeleryWorker

from .conftest import ROOT, wait_until

APP = "tests.beat.stampapp"
QUEUE = "stamptests"  # stampapp's task_default_queue
PERIOD = 4.0  # seconds: long enough that a beat's start-up fits well inside one slot
SCHEDULER = "celery_redlock.beat:RedlockScheduler"
BEAT_CONF = {"redlock_beat_lock_ttl": 3.0, "redlock_beat_standby_interval": 0.5}


class Log:
    """What the processes of one test recorded under its own key."""

    def __init__(self, broker: RedisServer) -> None:
        self.key = f"s-{uuid.uuid4().hex[:12]}"
        self.client = redis.Redis(host=broker.host, port=broker.port, db=2, socket_timeout=5)

    def _list(self, suffix: str) -> list[dict[str, Any]]:
        return [json.loads(item) for item in self.client.lrange(f"{self.key}:{suffix}", 0, -1)]

    def sent(self) -> list[dict[str, Any]]:
        return self._list("sent")

    def runs(self) -> list[dict[str, Any]]:
        return self._list("runs")

    def done(self) -> list[dict[str, Any]]:
        return self._list("done")

    def wait_done(self, ids: set[str], timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        wait_until(lambda: ids <= {d["id"] for d in self.done()}, timeout, f"{len(ids)} messages to finish")
        return {d["id"]: d for d in self.done() if d["id"] in ids}


@pytest.fixture
def log(beat_broker: RedisServer) -> Iterator[Log]:
    rec = Log(beat_broker)
    yield rec
    rec.client.close()


@pytest.fixture(scope="module")
def stamp_worker(
    beat_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryWorker]:
    env = {**beat_env, "STAMP_TEST_EVERY": str(PERIOD)}
    worker = CeleryWorker(
        APP, pool="threads", concurrency=2, env=env, pythonpath=[ROOT], log_dir=tmp_path_factory.mktemp("w")
    )
    with worker:
        yield worker


def make_beat(beat_env: dict[str, str], log: Log, tmp: Path, conf: dict[str, Any]) -> CeleryBeat:
    env = {
        **beat_env,
        "STAMP_TEST_KEY": log.key,
        "STAMP_TEST_EVERY": str(PERIOD),
        "STAMP_TEST_CONF": json.dumps({**BEAT_CONF, **conf}),
    }
    return CeleryBeat(APP, scheduler=SCHEDULER, env=env, pythonpath=[ROOT], log_dir=tmp, name="beat")


def stamp_of(send: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(send["stamp"]).timestamp()


@pytest.mark.timeout(90)
def test_leader_stamps_each_aligned_tick_and_the_worker_locks_exactly_that_slot(
    beat_env: dict[str, str], log: Log, tmp_path: Path, stamp_worker: CeleryWorker, redlock_masters: ServerSet
) -> None:
    # A lock TTL well above a load spike: a leader that lost its 3 s lock on a loaded CI machine
    # followed again before leading, and missed the ticks this test counts (stamps, not failover).
    conf = {"redlock_beat_align_intervals": True, "redlock_beat_lock_ttl": 15.0}
    beat = make_beat(beat_env, log, tmp_path, conf)
    with beat:
        wait_until(lambda: len(log.sent()) >= 4, 12 * PERIOD, "four sends")
        # Done before the beat is stopped: a send is noted when it begins, and a beat stopped
        # at once may not have finished writing its last one.
        sent = log.sent()[:4]
        done = log.wait_done({s["id"] for s in sent})
    runs = {r["id"]: r for r in log.runs()}
    print(f"\n[stamp] aligned leader: {[(s['stamp'], round(s['t'] - stamp_of(s), 3)) for s in sent]}")
    for send in sent:
        # The boundary the tick was due at: the last multiple of the period before the send.
        assert send["stamp"] == render(math.floor(send["t"] / PERIOD) * PERIOD), send
        assert not done[send["id"]]["skipped"]
        assert runs[send["id"]]["lock"] == f"%task:tests.beat.stampapp.slotted@{send['stamp']}"
        assert runs[send["id"]]["stamp"] == send["stamp"]
    stamps = [stamp_of(s) for s in sent]
    assert [b - a for a, b in itertools.pairwise(stamps)] == [PERIOD] * (len(stamps) - 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("aligned", [False, True], ids=["celery-intervals", "aligned"])
def test_leader_that_fell_behind_stamps_the_overdue_tick_and_the_next_tick_still_runs(
    beat_env: dict[str, str],
    log: Log,
    tmp_path: Path,
    stamp_worker: CeleryWorker,
    redlock_masters: ServerSet,
    aligned: bool,
) -> None:
    """The leader cannot tick for 2.6 periods (SIGSTOP; its lock TTL outlasts the pause), then
    catches up as celery does: one late send for the ticks it missed, at once.

    (A *restarted* RedlockScheduler over a process-local schedule starts as a standby and follows
    the overdue entry without sending it; it sends it, once, on taking the lead, unless a leader's
    record said it was sent: celery_redlock/celery/catchup.py.)
    """
    conf = {
        "redlock_beat_align_intervals": aligned,
        "redlock_beat_lock_ttl": 60.0,
        "redlock_beat_min_validity": 5.0,
    }
    beat = make_beat(beat_env, log, tmp_path, conf)
    with beat:
        wait_until(lambda: len(log.sent()) >= 2, 4 * PERIOD, "two sends before the pause")
        beat.pause()
        before = log.sent()
        time.sleep(2.6 * PERIOD)  # misses two ticks or more
        beat.resume()
        wait_until(lambda: len(log.sent()) >= len(before) + 2, 4 * PERIOD, "the catch-up send and one tick")
        sent = log.sent()
        catch_up, following = sent[len(before)], sent[len(before) + 1]
        # Both run before the beat is stopped: a send is noted when it begins (before_task_publish),
        # and a beat stopped at once may not have finished writing it (seen under load).
        done = log.wait_done({catch_up["id"], following["id"]})
    late_by = catch_up["t"] - stamp_of(catch_up)
    print(
        f"\n[stamp] fell behind ({'aligned' if aligned else 'celery intervals'}): last before "
        f"{before[-1]['stamp']}, catch-up sent {late_by:.2f} s after its stamp {catch_up['stamp']}, "
        f"then {following['stamp']}"
    )
    if aligned:
        # The boundary in progress when it was sent: the one the overdue tick stands for.
        assert catch_up["stamp"] == render(math.floor(catch_up["t"] / PERIOD) * PERIOD)
    else:
        # Celery's meaning: one period after the last run before the pause, long past, and
        # more than half a period (here: a whole one) before the send.
        assert abs(stamp_of(catch_up) - (before[-1]["t"] + PERIOD)) < 0.5, (before[-1], catch_up)
        assert late_by > PERIOD
    assert stamp_of(catch_up) > stamp_of(before[-1])
    assert stamp_of(following) >= stamp_of(catch_up) + PERIOD - 0.5
    # Both ran, each in the slot of its stamp: the catch-up did not take the next tick's slot.
    assert not done[catch_up["id"]]["skipped"] and not done[following["id"]]["skipped"]
    locks = {r["id"]: r["lock"] for r in log.runs()}
    assert locks[catch_up["id"]].endswith(f"@{catch_up['stamp']}")
    assert locks[following["id"]].endswith(f"@{following['stamp']}")


@pytest.mark.timeout(60)
def test_stamped_and_unstamped_messages_on_a_real_worker(
    log: Log, stamp_worker: CeleryWorker, beat_broker: RedisServer, redlock_masters: ServerSet
) -> None:
    from celery import Celery

    sender = Celery("stampsender", broker=beat_broker.url, set_as_current=False)
    base = (math.floor(time.time() / PERIOD) + 1000) * PERIOD  # a boundary no other test uses
    late = base + 0.8 * PERIOD  # more than half a period after the boundary

    def send(headers: dict[str, Any]) -> str:
        result = sender.send_task("tests.beat.stampapp.slotted", args=[log.key], headers=headers, queue=QUEUE)
        return str(result.id)

    an_instant = "2031-05-06T07:08:09.500000+02:00"  # not on any boundary of the period
    stamped = send({SLOT_HEADER: an_instant, PUBLISHED_HEADER: base})
    # The same stamp, published a period later (a second beat's copy): the same slot.
    copy = send({SLOT_HEADER: an_instant, PUBLISHED_HEADER: base + PERIOD})
    unstamped_late = send({PUBLISHED_HEADER: late})
    # The next slot, published exactly on its boundary: a slot of its own.
    unstamped_next = send({PUBLISHED_HEADER: base + PERIOD})
    unreadable = send({SLOT_HEADER: "yesterday", PUBLISHED_HEADER: base + 3 * PERIOD})
    ids = [stamped, copy, unstamped_late, unstamped_next, unreadable]
    done = log.wait_done(set(ids))
    locks = {r["id"]: r["lock"] for r in log.runs()}
    name = "%task:tests.beat.stampapp.slotted@"
    print(f"\n[stamp] by hand: {[locks.get(i, 'skipped') for i in ids]}")
    # One slot for the stamp and its copy: whichever of the two the worker's two threads got to
    # first ran, under the stamp's slot (in UTC), and the other was skipped.
    ran = [i for i in (stamped, copy) if i in locks]
    assert len(ran) == 1, ran
    assert locks[ran[0]] == name + "2031-05-06T05:08:09.500000+00:00"
    assert done[copy if ran[0] == stamped else stamped]["skipped"]
    assert locks[unstamped_late] == name + render(base)
    assert locks[unstamped_next] == name + render(base + PERIOD)
    assert locks[unreadable] == name + render(base + 3 * PERIOD)
    wait_until(lambda: "is not an ISO 8601 time" in stamp_worker.log_text(), 5, "the warning")
