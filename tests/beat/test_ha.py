"""Several real ``celery beat`` processes with RedlockScheduler over 5 real masters: exactly one
dispatches, failover after SIGKILL is bounded, and a paused leader never sends after it lost.

Slots are counted from what the beats actually published (recorded at ``before_task_publish``);
the shared real worker runs every message, checked where it adds something.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from celery_redlock import Redlock

from .conftest import APP, ROOT, Beats, Records, count_slots, current_leader, slot_of, wait_until

TTL = 3.0
STANDBY = 0.5
PERIOD = 1.0
# Scheduling noise on a shared 2-core machine; the bounds below are TTL + one standby tick.
SLACK = 1.0
# The steady-state test's length: about seven TTLs, each lived through by the leader's
# extensions with two standbys contending for every slot.
STEADY_SLOTS = 20
# Aligned intervals: every beat ticks on the same second boundaries, so a successor's first send is
# the slot after the old leader's last (slot_of counts sends by those boundaries). Unaligned, each
# beat ticks from its own start and a handover may send a tick early or late by up to a period.
CONF = {
    "redlock_beat_lock_ttl": TTL,
    "redlock_beat_standby_interval": STANDBY,
    "redlock_beat_align_intervals": True,
}
SCHEDULER = "celery_redlock.beat:RedlockScheduler"


# `celery redlock leader`, registered by hand until the celery.commands entry point is installed.
CLI = (
    "import sys; from celery.bin.celery import celery, main; "
    "from celery_redlock.celery.command import redlock; "
    "'redlock' in celery.commands or celery.add_command(redlock); sys.exit(main())"
)


def leader_pid(redlock: Redlock, beats: Beats, timeout: float = 10.0) -> int:
    record = wait_until(lambda: current_leader(redlock), timeout, "a leader record")
    pid = int(record["pid"])
    assert pid in [p.pid for p in beats.procs], record
    return pid


def new_leader(redlock: Redlock, old: int, timeout: float) -> tuple[int, float]:
    def other() -> int | None:
        record = current_leader(redlock)
        return int(record["pid"]) if record and int(record["pid"]) != old else None

    pid = wait_until(other, timeout, "another beat to take the leader lock")
    return pid, time.time()


def wait_sends(records: Records, pid: int, count: int, timeout: float, after: float = 0.0) -> None:
    wait_until(
        lambda: len([s for s in records.sent_by(pid) if s["t"] > after]) >= count,
        timeout,
        f"{count} sends from beat pid {pid}",
    )


@pytest.mark.timeout(90)
def test_three_beats_send_each_slot_exactly_once(
    beats: Beats,
    records: Records,
    redlock: Redlock,
    beat_worker: object,
    beat_env: dict[str, str],
) -> None:
    # Two choose the scheduler on the command line, one through the beat_scheduler setting.
    beats.start(2, conf=CONF, scheduler=SCHEDULER)
    beats.start(1, conf={**CONF, "beat_scheduler": SCHEDULER})
    first = slot_of(time.time()) + 2
    last = first + STEADY_SLOTS - 1
    wait_until(lambda: any(slot_of(s["t"]) > last for s in records.sent()), 45, f"slot {last + 1} to be sent")

    window = [s for s in records.sent() if first <= slot_of(s["t"]) <= last]
    doubled, missed = count_slots(window, first, last)
    print(
        f"\n[beat] 3 beats, {STEADY_SLOTS} slots: {len(window)} sent, "
        f"doubled {len(doubled)}, missed {len(missed)}"
    )
    assert doubled == [] and missed == []
    senders = {s["pid"] for s in window}
    assert len(senders) == 1, f"more than one beat dispatched: {senders}"
    assert leader_pid(redlock, beats) in senders
    # Anyone can ask who leads.
    shown = subprocess.run(
        [sys.executable, "-c", CLI, "-A", APP, "redlock", "leader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, **beat_env, "PYTHONPATH": str(ROOT)},
    )
    assert shown.returncode == 0, shown.stderr
    assert f"pid {senders.pop()}," in shown.stdout
    # The real worker ran every one of them.
    records.wait_all_done()
    assert sorted(r["id"] for r in records.runs() if r["id"] in {s["id"] for s in window}) == sorted(
        s["id"] for s in window
    )


@pytest.mark.timeout(60)
def test_sigkill_leader_standby_takes_over_within_ttl_plus_one_tick(
    beats: Beats, records: Records, redlock: Redlock
) -> None:
    beats.start(2, conf=CONF, scheduler=SCHEDULER)
    old = leader_pid(redlock, beats)
    wait_sends(records, old, 2, timeout=10)

    killed_at = time.time()
    beats.by_pid(old).kill()
    new, elected_at = new_leader(redlock, old, timeout=TTL + STANDBY + 10)
    wait_sends(records, new, 3, timeout=10)

    sent = records.sent()
    first_new = min(s["t"] for s in sent if s["pid"] == new)
    last_old = max(slot_of(s["t"]) for s in sent if s["pid"] == old)
    doubled, _ = count_slots(sent, min(slot_of(s["t"]) for s in sent), max(slot_of(s["t"]) for s in sent))
    missed = slot_of(first_new) - last_old - 1
    print(
        f"\n[beat] SIGKILL failover: elected {elected_at - killed_at:.2f} s, first send "
        f"{first_new - killed_at:.2f} s after the kill (bound {TTL + STANDBY:.1f} s + one "
        f"{PERIOD:.0f} s slot); missed {missed} slots, doubled {len(doubled)}"
    )
    assert doubled == []
    assert elected_at - killed_at <= TTL + STANDBY + SLACK
    assert first_new - killed_at <= TTL + STANDBY + PERIOD + SLACK
    assert not [s for s in sent if s["pid"] == old and s["t"] > killed_at]


@pytest.mark.timeout(60)
def test_sigstopped_leader_never_sends_after_its_validity(
    beats: Beats, records: Records, redlock: Redlock
) -> None:
    beats.start(2, conf=CONF, scheduler=SCHEDULER)
    old = leader_pid(redlock, beats)
    wait_sends(records, old, 2, timeout=10)
    paused = beats.by_pid(old)

    paused_at = time.time()
    paused.pause()
    new, elected_at = new_leader(redlock, old, timeout=TTL + STANDBY + 10)
    wait_sends(records, new, 2, timeout=10)
    assert time.time() - paused_at > TTL

    resumed_at = time.time()
    paused.resume()
    # It finds out (from its heartbeat or its next tick), says so, and stays a standby.
    paused.wait_for_log(r"beat leader lock \S+ lost", timeout=TTL + 5)
    wait_sends(records, new, 3, timeout=10, after=resumed_at)

    sent = records.sent()
    late = [s for s in sent if s["pid"] == old and s["t"] > paused_at]
    doubled, _ = count_slots(sent, min(slot_of(s["t"]) for s in sent), max(slot_of(s["t"]) for s in sent))
    print(
        f"\n[beat] SIGSTOP {resumed_at - paused_at:.1f} s (TTL {TTL:.0f} s): standby elected "
        f"{elected_at - paused_at:.2f} s after the pause; old leader sent {len(late)} after it, "
        f"doubled {len(doubled)}"
    )
    assert late == []
    assert doubled == []
    assert current_leader(redlock)["pid"] == new  # type: ignore[index]
