"""Bad ``redlock_beat_*`` settings fail at start-up, naming the setting; a scheduler whose state
it cannot tell is refused unless declared process-local; and the leader lock is kept by the
heartbeat thread, not by ticks (in-process schedulers on the 5 real masters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_redlock import ConfigError
from celery_redlock.beat import (
    BeatSettings,
    RedlockScheduler,
    beat_leader_elected,
    beat_leader_lost,
    read_leader,
)
from celery_redlock.testing import ServerSet
from celery_redlock.testing.celery import CeleryBeat

from .conftest import APP, ROOT, Beats, Records, count_slots, slot_of, wait_until
from .test_ha import CONF, SCHEDULER

GOOD = {"redlock_beat_lock_ttl": 3.0}
IN_MEMORY = "tests.beat.schedulers:InMemoryScheduler"
BAD = [
    ({"redlock_beat_lock_ttl": 0}, "redlock_beat_lock_ttl"),
    ({"redlock_beat_lock_ttl": "10"}, "redlock_beat_lock_ttl"),
    ({"redlock_beat_min_validity": 2.5}, "redlock_beat_min_validity"),
    # At or above half the TTL a fresh extension leaves less (the heartbeat counts ttl/3 plus
    # half of it): a healthy leader would refuse to send.
    ({"redlock_beat_min_validity": 1.6}, "redlock_beat_min_validity"),
    ({"redlock_beat_standby_interval": -1}, "redlock_beat_standby_interval"),
    ({"redlock_beat_standby_interval": 5.0}, "redlock_beat_standby_interval"),
    ({"redlock_beat_scheduler": "no_such_module:Scheduler"}, "redlock_beat_scheduler"),
    ({"redlock_beat_scheduler": "celery.app.base:Celery"}, "redlock_beat_scheduler"),
    ({"redlock_beat_scheduler": "celery_redlock.beat:RedlockScheduler"}, "redlock_beat_scheduler"),
    # A scheduler it does not know how to follow, unless told its state is process-local.
    ({"redlock_beat_scheduler": "tests.beat.schedulers:InMemoryScheduler"}, "redlock_beat_scheduler"),
    ({"redlock_beat_scheduler_state": "shared"}, "redlock_beat_scheduler_state"),
    (
        {"redlock_beat_scheduler": "redbeat:RedBeatScheduler", "redlock_beat_scheduler_state": "local"},
        "redlock_beat_scheduler_state",
    ),
    ({"redlock_beat_lock_name": 42}, "redlock_beat_lock_name"),
    ({"redlock_beat_lock_name": ""}, "redlock_beat_lock_name"),
    ({"redlock_beat_lock_tl": 3.0}, "redlock_beat_lock_tl"),  # misspelt: refused, not ignored
    # redbeat decides due entries itself: alignment would not happen while stamps assumed it.
    (
        {"redlock_beat_scheduler": "redbeat:RedBeatScheduler", "redlock_beat_align_intervals": True},
        "redlock_beat_align_intervals",
    ),
    ({"redlock_beat_align_intervals": "yes"}, "redlock_beat_align_intervals"),
    ({"redlock_masters": None}, "redlock_masters"),
    ({"redlock_masters": ["http://127.0.0.1:1"]}, "redlock_masters"),
]


def make_app(masters: list[str], **conf: Any) -> Celery:
    app = Celery("beatunit", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(redlock_masters=masters, beat_schedule={}, **GOOD)
    app.conf.update(conf)
    return app


@pytest.mark.parametrize(("conf", "setting"), BAD, ids=[f"{s}={c[s]!r}" for c, s in BAD])
def test_bad_setting_is_named(conf: dict[str, Any], setting: str, tmp_path: Path) -> None:
    app = make_app(["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"], **conf)
    with pytest.raises(ConfigError, match=setting):
        RedlockScheduler(app, schedule_filename=str(tmp_path / "s"), lazy=True)


def test_min_validity_must_stay_below_half_the_ttl() -> None:
    """Just after an extension a healthy leader has about half the TTL left (the heartbeat's
    interval, TTL/3, plus half of it): a minimum at or above that would stop it sending."""
    masters = ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0", "redis://127.0.0.1:3/0"]
    with pytest.raises(ConfigError, match=r"redlock_beat_min_validity .*half .*\(1\.5 s\).*got 1\.6"):
        BeatSettings.from_conf(make_app(masters, redlock_beat_min_validity=1.6).conf)
    assert BeatSettings.from_conf(make_app(masters, redlock_beat_min_validity=1.45).conf).min_validity == 1.45


@pytest.mark.timeout(60)
def test_a_scheduler_that_fails_to_load_is_named(tmp_path: Path) -> None:
    """django-celery-beat without Django configured: its import raises Django's
    ImproperlyConfigured, reported as the setting that named it (a fresh process: this one may
    have configured Django for the PostgreSQL tests)."""
    code = (
        "from celery import Celery\n"
        "from celery_redlock import ConfigError\n"
        "from celery_redlock.beat import RedlockScheduler\n"
        "app = Celery('x', broker='redis://127.0.0.1:1/0', set_as_current=False)\n"
        "app.conf.update(redlock_masters=['redis://127.0.0.1:1/0'], beat_schedule={},\n"
        "    redlock_beat_scheduler='django_celery_beat.schedulers:DatabaseScheduler')\n"
        "try:\n"
        f"    RedlockScheduler(app, schedule_filename={str(tmp_path / 's')!r}, lazy=True)\n"
        "except ConfigError as exc:\n"
        "    print('CONFIG', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    assert done.stdout.startswith("CONFIG redlock_beat_scheduler: cannot import"), done.stdout + done.stderr
    assert "ImproperlyConfigured" in done.stdout


@pytest.mark.timeout(60)
def test_celery_beat_exits_at_start_naming_the_setting(beat_env: dict[str, str], tmp_path: Path) -> None:
    beat = CeleryBeat(
        APP,
        scheduler="celery_redlock.beat:RedlockScheduler",
        pythonpath=[ROOT],
        env={**beat_env, "BEAT_TEST_CONF": '{"redlock_beat_lock_ttl": -1}'},
        log_dir=tmp_path,
    )
    beat.start(wait=False)
    try:
        code = wait_until(lambda: beat.returncode is not None, 30, "celery beat to exit")
        assert code and beat.returncode != 0
        assert "redlock_beat_lock_ttl must be > 0" in beat.log_text()
        assert "beat: Starting" not in beat.log_text()
    finally:
        beat.stop()


@pytest.mark.timeout(60)
def test_celery_beat_refuses_a_scheduler_it_cannot_follow(beat_env: dict[str, str], tmp_path: Path) -> None:
    beat = CeleryBeat(
        APP,
        scheduler="celery_redlock.beat:RedlockScheduler",
        pythonpath=[ROOT],
        env={**beat_env, "BEAT_TEST_CONF": json.dumps({"redlock_beat_scheduler": IN_MEMORY})},
        log_dir=tmp_path,
    )
    beat.start(wait=False)
    try:
        code = wait_until(lambda: beat.returncode is not None, 30, "celery beat to exit")
        assert code and beat.returncode != 0
        log = beat.log_text()
        assert f"does not know how a standby may follow {IN_MEMORY!r}" in log
        assert "django_celery_beat.schedulers:DatabaseScheduler" in log and "redbeat:RedBeatScheduler" in log
        assert "redlock_beat_scheduler_state = 'local'" in log
        assert "beat: Starting" not in log
    finally:
        beat.stop()


@pytest.mark.timeout(60)
def test_a_scheduler_declared_process_local_runs_in_ha(beats: Beats, records: Records) -> None:
    conf = {**CONF, "redlock_beat_scheduler": IN_MEMORY, "redlock_beat_scheduler_state": "local"}
    beats.start(2, conf=conf, scheduler=SCHEDULER)
    wait_until(lambda: len(records.sent()) >= 5, 20, "5 sends")
    sent = records.sent()
    doubled, _ = count_slots(sent, min(slot_of(s["t"]) for s in sent), max(slot_of(s["t"]) for s in sent))
    assert doubled == []
    assert len({s["pid"] for s in sent}) == 1


@pytest.fixture
def scheduler_factory(redlock_masters: ServerSet, tmp_path: Path) -> Iterator[Any]:
    made: list[RedlockScheduler] = []

    def make(**conf: Any) -> RedlockScheduler:
        app = make_app(redlock_masters.urls, **conf)
        sched = RedlockScheduler(app, schedule_filename=str(tmp_path / f"s{len(made)}"))
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.close()


@pytest.mark.timeout(30)
def test_leader_lock_outlives_a_long_loop_interval(scheduler_factory: Any) -> None:
    """No tick for 3 TTLs (as with a long beat_max_loop_interval): the heartbeat keeps it."""
    leader = scheduler_factory(redlock_beat_lock_ttl=1.0, redlock_beat_standby_interval=0.2)
    standby = scheduler_factory(redlock_beat_lock_ttl=1.0, redlock_beat_standby_interval=0.2)
    leader.tick()
    assert leader.leading
    started = time.monotonic()
    while time.monotonic() - started < 3.0:
        standby.tick()
        assert not standby.leading
        time.sleep(0.2)
    assert leader.leading and leader._lock is not None and leader._lock.owned()
    record = read_leader(leader._redlock, leader.settings.lock_name)
    assert record is not None and record["since"] > 0


@pytest.mark.timeout(30)
def test_leader_cut_off_from_a_majority_steps_down_and_signals(
    scheduler_factory: Any, redlock_masters: ServerSet
) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    lost = threading.Event()

    def on_elected(sender: Any, **kw: Any) -> None:
        events.append(("elected", kw))

    def on_lost(sender: Any, **kw: Any) -> None:
        events.append(("lost", kw))
        lost.set()

    beat_leader_elected.connect(on_elected)
    beat_leader_lost.connect(on_lost)
    try:
        leader = scheduler_factory(redlock_beat_lock_ttl=1.5)
        leader.tick()
        assert leader.leading
        for server in redlock_masters[:3]:
            server.pause()
        # Found by the heartbeat thread, with no tick at all, before the TTL is out.
        assert lost.wait(1.5 + 1.0)
        assert not leader.leading
        for server in redlock_masters[:3]:
            server.resume()
        wait_until(lambda: leader.tick() is not None and leader.leading, 5, "re-election")
    finally:
        beat_leader_elected.disconnect(on_elected)
        beat_leader_lost.disconnect(on_lost)
    assert [name for name, _ in events] == ["elected", "lost", "elected"]
    assert events[1][1]["reason"] and events[1][1]["lock_name"] == "beat:beatunit"
