"""The operators' tools (celery_redlock.lock.admin) on real masters: ls and show read what every
master holds, release deletes exactly the token shown and only when its holder is not alive,
and health tells a sound fleet from a replica, an evicting master, and a dead one."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from celery_redlock import LockNotAcquired, Redlock
from celery_redlock.lock import admin
from celery_redlock.lock.heartbeat import Heartbeat
from celery_redlock.lock.holder import describe_holder, process_identity
from celery_redlock.testing import RedisServer, ServerSet

from .conftest import released_everywhere, take, take_everywhere


def record(ttl: float, *, pid: int = 4242, host: str = "worker-3", since: float | None = None) -> str:
    """A holder record as the Celery layer writes it."""
    return json.dumps(
        {
            "task": "8c1f0000-0000-4000-8000-000000000001",
            "name": "charge_invoice",
            "host": host,
            "pid": pid,
            "since": time.time() if since is None else since,
            "ttl": ttl,
        }
    )


@pytest.fixture
def rl(masters: ServerSet) -> Iterator[Redlock]:
    # These tests read what every master holds (agree == 5 and the like): a request_timeout a
    # loaded host keeps, so that no acquire lands on a quorum only and no read comes back late.
    # The health checks' own timeouts are passed to them; no test here times a round.
    with Redlock(masters.urls, retry_count=0, request_timeout=1.0) as instance:
        yield instance


@pytest.mark.timeout(30)
def test_ls_lists_plain_and_reentrant_locks_held_on_a_quorum_and_skips_what_is_not_a_lock(
    masters: ServerSet, rl: Redlock
) -> None:
    plain = rl.lock("invoice:1", ttl=20, holder=record(20))
    again = rl.lock("re:1", ttl=20, reentrant=True, holder="nightly export")
    other = rl.lock("other:1", ttl=20)
    for lock in (plain, again, other):
        take_everywhere(lock)  # the listing below reads every master's
    assert again.acquire(blocking=False)  # depth 2: the masters' count says so too
    first = masters[0].client()
    try:
        first.set("redlock:leader-like:leader", '{"hostname": "h"}')  # a record beside a lock
        first.set("redlock:stray", "not a token")
        first.zadd("redlock:invoice:1~queue", {"a": 1, "b": 2})  # a fair lock's queue
        first.set("redlock:minority", "f" * 40 + "|left on one master", px=20000)
    finally:
        first.close()

    listing = admin.list_locks(rl)
    assert listing.complete and listing.errors == {}
    by_name = {view.name: view for view in listing.locks}
    assert sorted(by_name) == ["invoice:1", "other:1", "re:1"]

    view = by_name["invoice:1"]
    assert view.kind == "plain" and view.held and view.agree == 5 and view.token == plain.token
    assert view.holder is not None and view.holder.name == "charge_invoice" and view.holder.pid == 4242
    assert view.holder.describe().startswith(
        "task charge_invoice 8c1f0000-0000-4000-8000-000000000001 on worker-3"
    )
    assert view.queued == 2
    assert view.ttl_left is not None and 15 < view.ttl_left <= 20
    assert view.age is not None and 0 <= view.age < 5

    reentrant = by_name["re:1"]
    assert reentrant.kind == "reentrant" and reentrant.held and reentrant.holder is None  # not a record
    assert reentrant.holder_text == "nightly export" and reentrant.describe_holder() == "'nightly export'"
    assert all(m.tokens[0][1] == 2 for m in reentrant.masters)

    assert by_name["other:1"].holder is None and by_name["other:1"].describe_holder() == "an unnamed holder"

    # A glob over the resource names; --all shows what a minority holds.
    assert [v.name for v in admin.list_locks(rl, "invoice:*").locks] == ["invoice:1"]
    partial = {v.name: v for v in admin.list_locks(rl, partial=True).locks}
    assert partial["minority"].agree == 1 and not partial["minority"].held
    json.dumps([v.as_dict() for v in listing.locks])  # what --json prints


@pytest.mark.timeout(30)
def test_ls_is_bounded_by_its_limit(masters: ServerSet, rl: Redlock) -> None:
    locks = [rl.lock(f"many:{i}", ttl=20) for i in range(30)]
    for lock in locks:
        assert take(lock)
    listing = admin.list_locks(rl, "many:*", limit=10)
    assert len(listing.locks) <= 10 and not listing.complete
    assert len(admin.list_locks(rl, "many:*").locks) == 30


@pytest.mark.timeout(30)
def test_show_gives_the_per_master_view_with_one_master_down(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("shown", ttl=20, holder=record(20))
    assert take(lock)
    masters[4].kill()
    view = admin.show(rl, "shown")
    assert view.held and view.agree == 4 and view.token == lock.token
    assert [m.kind for m in view.masters] == ["plain"] * 4 + ["error"]
    assert view.masters[4].error
    assert all(m.pttl is not None and 15 < m.pttl <= 20 for m in view.masters[:4])
    free = admin.show(rl, "never-taken")
    assert free.kind == "free" and not free.held and free.token is None and free.holder is None


@pytest.mark.timeout(30)
def test_force_release_deletes_only_the_token_shown_and_wakes_a_waiter(
    masters: ServerSet, rl: Redlock
) -> None:
    holder = rl.lock("stuck", ttl=30, holder=record(30))
    assert take(holder)
    view = admin.show(rl, "stuck")

    with Redlock(masters.urls, retry_count=0) as other:
        # A stale view (its token released since, and the lock taken by another) deletes nothing.
        holder.release()
        taker = other.lock("stuck", ttl=30)
        assert take(taker)
        done = admin.force_release(rl, view)
        assert done.deleted == 0
        assert admin.show(rl, "stuck").token == taker.token
        with pytest.raises(admin.ReleaseRefused, match="no longer held by the token shown"):
            admin.release(rl, "stuck", token=view.token, force=True)

        # The view of the current holder: a contender waiting for it gets in at once.
        current = admin.show(rl, "stuck")
        waiter = rl.lock("stuck", ttl=30)
        got: list[float] = []

        def wait() -> None:
            started = time.monotonic()
            if waiter.acquire(timeout=20):
                got.append(time.monotonic() - started)

        import threading

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.3)  # the waiter's first attempt is refused and it sleeps on the release
        released_at = time.monotonic()
        assert released_everywhere(masters, admin.force_release(rl, current, by="test"))
        thread.join(20)
        assert got, "the waiter never got the lock"
        assert time.monotonic() - released_at < 2.0  # woken by the release, not by the 30 s TTL
        waiter.release()


@pytest.mark.timeout(30)
def test_release_of_a_reentrant_lock_deletes_its_hash(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("re-stuck", ttl=30, reentrant=True)
    assert take(lock)
    released, alive = admin.release(rl, "re-stuck", force=True)
    assert released_everywhere(masters, released, key="redlock:re-stuck") and alive is None
    assert admin.show(rl, "re-stuck").kind == "free"


@pytest.mark.timeout(30)
def test_release_is_refused_while_the_holder_extends_it(masters: ServerSet) -> None:
    # Its own request_timeout: a heartbeat keeps a 1.5 s lock only if 2 x request_timeout leaves
    # room for its 0.5 s interval (the fixture's 1 s does not).
    with Redlock(masters.urls, retry_count=0, request_timeout=0.3) as rl:
        _refused_while_extended(masters, rl)


def _refused_while_extended(masters: ServerSet, rl: Redlock) -> None:
    heartbeat = Heartbeat("test-admin-heartbeat")
    lock = rl.lock("alive", ttl=1.5, holder=record(1.5, host=socket.gethostname(), pid=1))
    assert take(lock)
    heartbeat.keep(lock)  # extended every 0.5 s
    try:
        with pytest.raises(admin.ReleaseRefused, match="holder is alive"):
            admin.release(rl, "alive", watch=5)
        assert lock.owned() and admin.show(rl, "alive").token == lock.token
        # --force does it anyway; the holder then loses its lock at its next extension.
        released, _ = admin.release(rl, "alive", force=True)
        assert released_everywhere(masters, released, key="redlock:alive")
        deadline = time.monotonic() + 5
        while lock.extend() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not lock.extend()
    finally:
        heartbeat.forget(lock)
        heartbeat.stop()


@pytest.mark.timeout(30)
def test_a_lock_not_extended_past_its_recorded_interval_is_stale_and_released(
    masters: ServerSet, rl: Redlock
) -> None:
    """Shown dead by watching: its record says it is extended every 0.5 s, and no master saw an
    extension for longer than that plus the margin."""
    holder = json.dumps({**json.loads(record(30.0)), "heartbeat": 0.5})
    lock = rl.lock("stale", ttl=30.0, holder=holder)  # never extended: its holder is dead
    assert take(lock)
    released, alive = admin.release(rl, "stale", watch=10)
    assert alive is not None and alive.state == "stale", alive
    assert released_everywhere(masters, released, key="redlock:stale")
    assert take(rl.lock("stale", ttl=2.0))


def test_a_lock_without_a_recorded_interval_is_not_released_while_valid(
    masters: ServerSet, rl: Redlock
) -> None:
    """No interval, no pid on this host: nothing can show it dead but its expiry, so a release
    without force refuses while it is valid and, once it has expired, has nothing to delete."""
    lock = rl.lock("stale", ttl=2.0, holder=record(2.0))
    assert take(lock)
    with pytest.raises(admin.ReleaseRefused):
        admin.release(rl, "stale", watch=0.5)
    assert lock.owned()
    released, alive = admin.release(rl, "stale", watch=10)  # long enough to see it expire
    assert alive is not None and alive.state == "expired", alive
    assert released.deleted == 0


@pytest.mark.timeout(30)
def test_a_holder_whose_process_is_gone_on_this_host_is_released_without_watching(
    masters: ServerSet, rl: Redlock
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    identity = process_identity(dead.pid)  # as the process itself recorded it, while it ran
    dead.kill()
    dead.wait(10)
    holder = json.dumps({**json.loads(record(60, host=socket.gethostname(), pid=dead.pid)), "proc": identity})
    lock = rl.lock("gone", ttl=60, holder=holder)
    assert take(lock)
    started = time.monotonic()
    released, alive = admin.release(rl, "gone", watch=30)
    assert alive is not None and alive.state == "gone" and time.monotonic() - started < 1.0
    assert released_everywhere(masters, released, key="redlock:gone")


@pytest.mark.timeout(30)
def test_a_holder_without_a_ttl_in_its_record_is_unknown_and_needs_force(
    masters: ServerSet, rl: Redlock
) -> None:
    lock = rl.lock("label", ttl=30, holder="a cron script")
    assert take(lock)
    view = admin.show(rl, "label")
    alive = admin.liveness(rl, view, watch=0.5)
    assert alive.state == "unknown" and not alive.releasable
    with pytest.raises(admin.ReleaseRefused, match="unknown"):
        admin.release(rl, "label", watch=0.5)


@pytest.mark.timeout(30)
def test_lock_not_acquired_names_the_holder_when_given_one() -> None:
    error = LockNotAcquired("invoice:42", [], quorum=3, holder=describe_holder(record(60)))
    assert "held by task charge_invoice 8c1f" in str(error) and "on worker-3 pid 4242 for" in str(error)
    rebuilt = LockNotAcquired(*json.loads(json.dumps(error.args)))  # a JSON result backend's trip
    assert rebuilt.holder == error.holder


# -- health ------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_health_of_a_sound_fleet(masters: ServerSet, rl: Redlock) -> None:
    report = admin.health(rl)
    assert report.status == "ok" and report.exit_code == 0 and report.sound == 5
    for m in report.masters:
        assert m.reachable and m.role == "master" and m.commands_run and m.version
        assert m.maxmemory_policy == "noeviction" and m.appendonly is False
        assert m.rtt is not None and m.rtt < 0.1
        assert m.clock_offset is not None and abs(m.clock_offset) < 0.5
        assert [f.level for f in m.findings] == ["note"]  # no persistence: restart with a delay
    assert admin.list_locks(rl).locks == ()  # the probe's key is gone
    json.dumps(report.as_dict())


@pytest.mark.timeout(30)
def test_health_finds_a_replica(masters: ServerSet, rl: Redlock) -> None:
    with RedisServer() as primary:
        replica = masters[2].client()
        try:
            replica.execute_command("REPLICAOF", primary.host, primary.port)
            report = admin.health(rl)
        finally:
            replica.execute_command("REPLICAOF", "NO", "ONE")
            replica.close()
    bad = report.masters[2]
    # Refused at its first contact (it is never sent a lock command): the finding says why.
    assert not bad.sound and not bad.commands_run
    assert any("replica" in f.what for f in bad.findings if f.level == "error"), bad.findings
    assert report.status == "degraded" and report.exit_code == 1
    assert all(m.sound for i, m in enumerate(report.masters) if i != 2)


@pytest.mark.timeout(30)
def test_health_warns_of_an_evicting_master(masters: ServerSet, rl: Redlock) -> None:
    client = masters[1].client()
    try:
        client.config_set("maxmemory-policy", "allkeys-lru")
        report = admin.health(rl)
    finally:
        client.config_set("maxmemory-policy", "noeviction")
        client.close()
    evicting = report.masters[1]
    assert evicting.maxmemory_policy == "allkeys-lru" and evicting.sound
    assert any(f.level == "warning" and "allkeys-lru" in f.what for f in evicting.findings)
    assert report.status == "degraded" and report.exit_code == 1


@pytest.mark.timeout(30)
def test_health_of_a_fleet_with_masters_down(masters: ServerSet, rl: Redlock) -> None:
    masters[0].kill()
    report = admin.health(rl)
    assert not report.masters[0].reachable and not report.masters[0].sound
    assert report.status == "degraded" and report.exit_code == 1 and report.sound == 4
    masters[1].kill()
    masters[2].pause()
    started = time.monotonic()
    report = admin.health(rl, timeout=0.3)
    assert time.monotonic() - started < 3.0  # bounded by the timeout, per round
    assert report.sound == 2 and report.status == "unsafe" and report.exit_code == 3
