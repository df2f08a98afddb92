"""``admin.release`` without ``force`` on real masters (issue 25, item 1): a holder is released
only when it is *shown* dead (its recorded pid is gone on this host, or no extension was seen for
longer than its recorded heartbeat interval plus a margin, by watching its PTTL on a quorum), or
when its validity has run out anyway. Whatever its record says about its TTL, a holder that
extends, a holder with validity left and no heartbeat, and a holder that cannot be checked are
refused.

The holders that take locks in other processes run this file as a script (``hold`` and
``client`` below), so a test can SIGKILL or SIGSTOP exactly the process that holds the lock.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from celery_redlock import Redlock
from celery_redlock.lock import admin
from celery_redlock.lock.holder import HolderRecord, process_identity
from celery_redlock.lock.resource import Lock
from celery_redlock.testing import Hold, ServerSet, find_overlaps

pytestmark = pytest.mark.one_binary

HOST = socket.gethostname()
TASK_ID = "8c1f0000-0000-4000-8000-000000000001"


def record(*, ttl: float, heartbeat: float | None = None, host: str = "worker-3", pid: int = 4242) -> str:
    """A holder record as the Celery layer writes it (``heartbeat`` None: not recorded); a
    process of this host's records its identity too."""
    return HolderRecord(
        task=TASK_ID,
        name="charge_invoice",
        host=host,
        pid=pid,
        proc=process_identity() if pid == os.getpid() else None,
        since=time.time(),
        ttl=ttl,
        heartbeat=heartbeat,
    ).to_text()


def released_everywhere(masters: ServerSet, released: admin.Released, *, key: str) -> bool:
    # Imported here, not at the top: this module also runs as the holder processes' script,
    # outside the package.
    from .conftest import released_everywhere as check

    return check(masters, released, key=key)


def take(lock: Lock) -> bool:
    """The suite's ``take``, imported here for the reason above: the attempt is not the subject."""
    from .conftest import take as retried

    return retried(lock)


@pytest.fixture
def rl(masters: ServerSet) -> Iterator[Redlock]:
    with Redlock(masters.urls, retry_count=0) as instance:
        yield instance


def held_by(masters: ServerSet, name: str) -> tuple[str | None, int]:
    """(the value most masters hold for lock ``name``, on how many), read off each server: a
    lock round under load may count a slow master's reply as late, which says nothing of what
    it holds."""
    values = []
    for master in masters:
        try:
            with master.client() as client:
                raw = client.get("redlock:" + name)  # the rl fixture's key prefix
        except redis.RedisError:
            raw = None  # a stopped master holds nothing anyone can read
        values.append(None if raw is None else raw.decode())
    held = [v for v in values if v is not None]
    if not held:
        return None, 0
    token = max(set(held), key=held.count)
    return token, held.count(token)


def acquire_everywhere(masters: ServerSet, lock: Lock) -> None:
    """Acquire ``lock`` on every master: a grant on a quorum only (one master's reply late
    under load, and so retracted) is released and taken again, for tests whose premise is a
    lock on all five."""
    deadline = time.monotonic() + 20
    while True:
        # Refused right after its own release (a late reply, a delete still on its way) is
        # tried again too; by the deadline, it fails.
        if lock.acquire(blocking=False):
            if held_by(masters, lock.name) == (lock.token, len(list(masters))):
                return
            lock.release()
        assert time.monotonic() < deadline, f"never granted by every master: {lock.last_error}"


@contextmanager
def extending(lock: Lock, every: float, to: float | None = None) -> Iterator[list[float]]:
    """Extend ``lock`` (to ``to`` seconds) every ``every`` seconds in a thread; yields the times
    of the extensions that failed."""
    stop = threading.Event()
    failed: list[float] = []

    def run() -> None:
        while not stop.wait(every):
            if not lock.extend(to):
                failed.append(time.monotonic())

    thread = threading.Thread(target=run, name="extender", daemon=True)
    thread.start()
    try:
        yield failed
    finally:
        stop.set()
        thread.join(5)


# -- the reviewer's three holders ------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("heartbeat", [None, 1.0], ids=["no-interval-recorded", "interval-recorded"])
def test_a_holder_extending_to_5_s_every_second_under_a_record_saying_30_s_is_refused(
    masters: ServerSet, rl: Redlock, heartbeat: float | None
) -> None:
    lock = rl.lock("ext5", ttl=30, holder=record(ttl=30, heartbeat=heartbeat))
    acquire_everywhere(masters, lock)
    assert lock.extend(5)  # what it does every second from now on
    with extending(lock, 1.0, to=5) as failed:
        with pytest.raises(admin.ReleaseRefused, match="holder is alive"):
            admin.release(rl, "ext5", watch=10)
        assert lock.owned() and not failed
        assert held_by(masters, "ext5") == (lock.token, 5)
    lock.release()


@pytest.mark.timeout(60)
def test_a_holder_without_heartbeat_and_2_7_s_left_is_refused_until_its_validity_runs_out(
    masters: ServerSet, rl: Redlock
) -> None:
    lock = rl.lock("nobeat", ttl=6, holder=record(ttl=6))  # no interval: it never extends
    acquire_everywhere(masters, lock)
    deadline = time.monotonic() + 10
    while lock.validity > 2.7 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(admin.ReleaseRefused, match=r"cannot show it dead within --watch 1 s"):
        admin.release(rl, "nobeat", watch=1)
    assert time.monotonic() - started < 0.8  # nothing a 1 s watch could show: refused at once
    assert lock.owned() and held_by(masters, "nobeat") == (lock.token, 5)

    # A watch long enough waits for its validity to run out: a quorum of masters answers without
    # the token. What is left on the others (keys outlive the validity by the drift allowance)
    # holds nothing, and may be deleted: on fewer masters than a quorum, never on one more.
    released, alive = admin.release(rl, "nobeat", watch=10)
    assert alive is not None and alive.state == "expired", alive
    assert not lock.owned() and released.deleted <= len(masters) - rl.quorum, released
    assert held_by(masters, "nobeat") == (None, 0)
    assert take(rl.lock("nobeat", ttl=5))


# -- unknown means refuse --------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_holder_that_cannot_be_checked_is_refused_and_force_still_works(
    masters: ServerSet, rl: Redlock
) -> None:
    lock = rl.lock("label", ttl=30, holder="a cron script")  # no record: no interval, no pid
    acquire_everywhere(masters, lock)
    started = time.monotonic()
    with pytest.raises(admin.ReleaseRefused, match=r"unknown.*cannot show it dead within --watch 5 s"):
        admin.release(rl, "label", watch=5)
    assert time.monotonic() - started < 1.0
    assert lock.owned() and held_by(masters, "label") == (lock.token, 5)
    released, alive = admin.release(rl, "label", force=True)
    assert released_everywhere(masters, released, key="redlock:label") and alive is None


@pytest.mark.timeout(60)
def test_a_watch_shorter_than_interval_plus_margin_is_refused_at_once_naming_what_it_needs(
    masters: ServerSet, rl: Redlock
) -> None:
    lock = rl.lock("long", ttl=30, holder=record(ttl=30, heartbeat=10))
    acquire_everywhere(masters, lock)
    started = time.monotonic()
    with pytest.raises(admin.ReleaseRefused, match=r"within --watch 3 s.*needs 15 s"):
        admin.release(rl, "long", watch=3)
    assert time.monotonic() - started < 1.0
    assert held_by(masters, "long") == (lock.token, 5)


@pytest.mark.timeout(60)
def test_a_lock_a_quorum_does_not_answer_for_is_refused(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("dark", ttl=30, holder=record(ttl=30, heartbeat=0.5))  # never extended
    acquire_everywhere(masters, lock)
    for server in masters[:3]:
        server.pause()
    try:
        with pytest.raises(admin.ReleaseRefused):
            admin.release(rl, "dark", watch=2, timeout=0.3)
    finally:
        for server in masters[:3]:
            server.resume()
    deadline = time.monotonic() + 10  # the resumed masters work off what was sent meanwhile
    while held_by(masters, "dark") != (lock.token, 5) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held_by(masters, "dark") == (lock.token, 5)


# -- shown dead ------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_recorded_interval_with_no_extension_seen_for_interval_plus_margin_is_released(
    masters: ServerSet, rl: Redlock
) -> None:
    lock = rl.lock("quiet", ttl=30, holder=record(ttl=30, heartbeat=0.5))  # on another host
    assert take(lock)
    started = time.monotonic()
    released, alive = admin.release(rl, "quiet", watch=10)
    waited = time.monotonic() - started
    assert alive is not None and alive.state == "stale", alive
    assert 1.0 <= waited < 3.0, waited  # interval 0.5 s + margin 0.5 s of watching, no less
    assert released_everywhere(masters, released, key="redlock:quiet")


@pytest.mark.timeout(60)
def test_the_expired_remains_of_a_lock_are_released(masters: ServerSet, rl: Redlock) -> None:
    token = "ab" * 20 + "|" + record(ttl=30, heartbeat=1.0)
    for server in masters[:2]:  # on two masters of five: no quorum can hold it
        client = server.client()
        try:
            client.set("redlock:remains", token, px=30000)
        finally:
            client.close()
    released, alive = admin.release(rl, "remains", watch=5)
    assert alive is not None and alive.state == "expired", alive
    assert released.deleted == 2


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"pid {proc.pid} said nothing within {timeout} s")
    return proc.stdout.readline().strip()


@contextmanager
def holder_process(masters: ServerSet, name: str, ttl: float, every: float) -> Iterator[tuple[Any, str]]:
    """A process that takes ``name`` (its record: this host, its pid, heartbeat ``every``) and
    extends it every ``every`` seconds; yields (its Popen, its token). Killed by pid after."""
    spec = {"urls": masters.urls, "name": name, "ttl": ttl, "every": every}
    proc = subprocess.Popen(
        [sys.executable, __file__, "hold", json.dumps(spec)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = _read_line(proc, 20)
        assert line.startswith("ready "), line
        yield proc, line.split()[1]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(60)
def test_a_sigkilled_holder_on_this_host_is_released_without_watching(
    masters: ServerSet, rl: Redlock
) -> None:
    with holder_process(masters, "killed", ttl=60, every=20) as (proc, token):
        assert admin.show(rl, "killed").token == token
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        started = time.monotonic()
        released, alive = admin.release(rl, "killed", watch=30)
        assert alive is not None and alive.state == "gone", alive
        assert time.monotonic() - started < 1.0 and released_everywhere(
            masters, released, key="redlock:killed"
        )
    assert take(rl.lock("killed", ttl=5))


@pytest.mark.timeout(60)
def test_a_holder_that_stopped_extending_is_released_once_the_watch_shows_it(
    masters: ServerSet, rl: Redlock
) -> None:
    with holder_process(masters, "stopped", ttl=10, every=1.0) as (proc, token):
        with pytest.raises(admin.ReleaseRefused, match="holder is alive"):
            admin.release(rl, "stopped", watch=5)
        assert held_by(masters, "stopped") == (token, 5)

        os.kill(proc.pid, signal.SIGSTOP)  # its pid still runs; it no longer extends
        started = time.monotonic()
        released, alive = admin.release(rl, "stopped", watch=10)
        waited = time.monotonic() - started
        assert alive is not None and alive.state == "stale", alive
        # At least interval (1 s) + margin (0.5 s) watched; long before its 10 s TTL ran out.
        assert 1.5 <= waited < 4.0, waited
        assert released_everywhere(masters, released, key="redlock:stopped")
        assert take(rl.lock("stopped", ttl=5))

        os.kill(proc.pid, signal.SIGCONT)  # its next extension tells it the lock is gone
        assert _read_line(proc, 5) == "lost"


# -- the reviewer's loop ---------------------------------------------------------------------------
# Four clients on one resource, each keeping its lock its own way, while an operator loops
# release without force. Each: (ttl, extend every, extend to, holder text kind, longest hold).
CLIENTS: list[dict[str, Any]] = [
    {"ttl": 3.0, "every": 2.0, "to": None, "record": "interval", "hold": 3.0},  # interval 2 on ttl 3
    {"ttl": 30.0, "every": 1.0, "to": 5.0, "record": "ttl-only", "hold": 3.0},  # says 30, keeps 5
    {"ttl": 4.0, "every": None, "to": None, "record": "ttl-only", "hold": 2.5},  # no heartbeat
    {"ttl": 3.0, "every": 1.0, "to": None, "record": "label", "hold": 3.0},  # a script's label
]
LOOP_SECONDS = 15.0


@pytest.mark.explore
@pytest.mark.timeout(120)
def test_an_operator_looping_release_never_deletes_a_live_holders_token(
    masters: ServerSet, rl: Redlock
) -> None:
    procs = []
    outcomes: dict[str, int] = {}
    done = threading.Event()

    def operator() -> None:
        while not done.is_set():
            try:
                released, alive = admin.release(rl, "loop", watch=4)
                key = f"released {alive.state if alive else '?'} deleted={released.deleted}"
            except admin.ReleaseRefused as exc:
                key = "refused " + (str(exc).partition("holder is ")[2].partition(":")[0] or "(not held)")
            outcomes[key] = outcomes.get(key, 0) + 1
            time.sleep(0.05)

    try:
        for index, config in enumerate(CLIENTS):
            spec = {
                "urls": masters.urls,
                "name": "loop",
                "index": index,
                "seed": index,
                "seconds": LOOP_SECONDS,
            }
            spec.update(config)
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "client", json.dumps(spec)], stdout=subprocess.PIPE, text=True
                )
            )
        thread = threading.Thread(target=operator, name="operator", daemon=True)
        thread.start()
        results = [json.loads(proc.communicate(timeout=LOOP_SECONDS + 30)[0]) for proc in procs]
        done.set()
        thread.join(30)
    finally:
        done.set()
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
    violations = [v for result in results for v in result["violations"]]
    holds = [
        Hold("loop", start, end, owner=f"client {i} hold {j}")
        for i, result in enumerate(results)
        for j, (start, end) in enumerate(result["holds"])
    ]
    attempts = sum(outcomes.values())
    assert attempts >= 5, outcomes  # the operator really ran beside them
    assert len(holds) >= 4, results  # the clients really held it (one may be starved by the others)
    assert not violations, f"{violations}; operator: {outcomes}"
    assert not find_overlaps(holds), [str(o) for o in find_overlaps(holds)]
    # Every holder was alive: a release may only have swept what a holder's own release left
    # on fewer masters than a quorum (its replies still in flight), never a held token.
    releases = [k for k in outcomes if k.startswith("released")]
    assert all(k.startswith("released expired deleted=") for k in releases), outcomes
    assert all(int(k.rpartition("=")[2]) < rl.quorum for k in releases), outcomes


# -- the processes ---------------------------------------------------------------------------------
def _hold_main(spec: dict[str, Any]) -> int:
    """Take the lock, say ``ready <token>``, then extend it every ``every`` s until lost."""
    with Redlock(spec["urls"], retry_count=0) as redlock:
        text = record(ttl=spec["ttl"], heartbeat=spec["every"], host=HOST, pid=os.getpid())
        lock = redlock.lock(spec["name"], ttl=spec["ttl"], holder=text)
        if not lock.acquire(timeout=10):
            print("failed", flush=True)
            return 1
        print("ready", lock.token, flush=True)
        while True:
            time.sleep(spec["every"])
            if not lock.extend():
                print("lost", flush=True)
                return 0


def _client_text(spec: dict[str, Any]) -> str:
    if spec["record"] == "label":
        return f"loop client {spec['index']}"
    heartbeat = spec["every"] if spec["record"] == "interval" else None
    return record(ttl=spec["ttl"], heartbeat=heartbeat, host=HOST, pid=os.getpid())


def _client_main(spec: dict[str, Any]) -> int:
    """Loop acquire / hold (extending as configured) / release for ``seconds``; print the holds
    (monotonic start, end) and every time the lock was found deleted while the client owned it."""
    rng = random.Random(spec["seed"])
    holds: list[tuple[float, float]] = []
    violations: list[str] = []
    name, every = spec["name"], spec["every"]
    with Redlock(spec["urls"], retry_count=0) as redlock:
        end_at = time.monotonic() + spec["seconds"]
        while time.monotonic() < end_at:
            lock = redlock.lock(name, ttl=spec["ttl"], holder=_client_text(spec))
            if not lock.acquire(timeout=1.0):
                continue
            start = time.monotonic()
            valid_until = start + lock.validity
            hold_until = start + rng.uniform(0.3, spec["hold"])
            while (left := hold_until - time.monotonic()) > 0:
                time.sleep(min(left, every) if every else left)
                if every and time.monotonic() < hold_until:
                    believed = lock.owned()
                    if not lock.extend(spec["to"]):
                        if believed:
                            violations.append(f"client {spec['index']}: extension refused while owned")
                        break
                    validity = lock.validity
                    valid_until = time.monotonic() + validity
            stop = time.monotonic()
            if lock.owned():
                view = admin.show(redlock, name)
                if not (view.held and view.token == lock.token):
                    violations.append(f"client {spec['index']}: token deleted while owned ({view.token})")
            elif not violations:
                violations.append(f"client {spec['index']}: validity ran out during a hold")
            holds.append((start, min(stop, valid_until)))
            lock.release()
    print(json.dumps({"holds": holds, "violations": violations}), flush=True)
    return 0


if __name__ == "__main__":
    role, raw = sys.argv[1], sys.argv[2]
    sys.exit(_hold_main(json.loads(raw)) if role == "hold" else _client_main(json.loads(raw)))
