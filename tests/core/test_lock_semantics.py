"""What a Lock promises about itself: how long it is good for, whose it is, what it leaves behind.

Each test is named after a review finding and reproduces it on real servers:

- an extension to a shorter TTL, granted or not, may have shortened the keys on any master, so
  the validity afterwards never exceeds what the new TTL allows;
- a lock belongs to the process that acquired it: a forked child neither owns, extends nor
  releases its parent's lock (it may take the lock anew, as a contender of its own);
- ``acquire()`` returning True means ``owned()`` is True: the validity counts from before the
  round made its connections;
- a TTL that no round could honour is refused where it is written;
- the validity is read on a clock that keeps counting while the host is suspended;
- a Redlock dropped without ``close()`` leaves no thread and no socket behind.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import celery_redlock
from celery_redlock import ConfigError, Lock, LockLost, Redlock
from celery_redlock.lock.commands import PLAIN, Commands
from celery_redlock.testing import ProxySet, ServerSet

from .conftest import take, take_everywhere, values_on, wait_for

CHILD_DEADLINE = 10.0
LOCK_DIR = Path(celery_redlock.__file__).parent / "lock"


# -- helpers -------------------------------------------------------------------------------------
def probe_can_acquire(masters: ServerSet, name: str) -> bool:
    """Whether an independent client can take ``name`` now (released again at once)."""
    with Redlock(masters.urls, retry_count=0) as probe:
        lock = probe.lock(name, ttl=1.0)
        # take(): a cold probe's first round may miss 0.1 s on a loaded host; a "held" refusal
        # is still final at once, so "not acquirable" keeps meaning someone holds the key.
        if take(lock):
            lock.release()
            return True
        return False


def in_child(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``work`` in a forked child; its report, or why it failed or hung (killed by pid)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: report and leave without running any cleanup
        os.close(read)
        try:
            report = work()
        except BaseException as exc:  # everything must reach the parent, not a traceback
            report = {"raised": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(report).encode()[:60000])
        os._exit(0)
    os.close(write)
    return read_report(read, pid)


def read_report(read: int, pid: int) -> dict[str, Any]:
    chunks = []
    try:
        deadline = time.monotonic() + CHILD_DEADLINE
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                os.kill(pid, signal.SIGKILL)
                return {"hung": CHILD_DEADLINE}
            ready, _, _ = select.select([read], [], [], remaining)
            if ready:
                data = os.read(read, 65536)
                if not data:
                    break
                chunks.append(data)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"exited": "without a report"}')


class StallsAfterTheRound(Redlock):
    """A holder that stalls (a long GC, a SIGSTOP) after the masters answered an extension and
    before it looks at the answer: by then the new, shorter TTL has run out on every master."""

    stall = 0.5

    def try_extend(self, key: str, token: str, ttl: float, commands: Commands = PLAIN) -> Any:
        result = super().try_extend(key, token, ttl, commands)
        time.sleep(self.stall)
        return result


# -- 1. extending to a shorter TTL -----------------------------------------------------------------
@pytest.mark.timeout(30)
def test_extend_to_a_shorter_ttl_granted_by_every_master_shortens_the_validity(
    masters: ServerSet, rl: Redlock
) -> None:
    lock = rl.lock("short-extend-granted", ttl=30)
    assert take(lock), lock.last_error
    started = time.monotonic()
    assert lock.extend(ttl=0.3)
    # Granted means a quorum said yes (the contract; a loaded master may answer late), and the
    # validity bound below holds for any granted extension.
    assert [v.kind for v in lock.last_votes].count("yes") >= rl.quorum, lock.last_votes
    assert 0 < lock.validity <= 0.3 - (time.monotonic() - started) + 0.001, lock.validity
    # The keys expire 0.3 s after the extension; so does the holder's claim, no later.
    assert wait_for(lambda: probe_can_acquire(masters, "short-extend-granted"), 5.0)
    assert not lock.owned()
    lock.release()


@pytest.mark.timeout(30)
def test_extend_to_a_shorter_ttl_granted_but_read_too_late_keeps_the_old_validity(
    masters: ServerSet,
) -> None:
    with StallsAfterTheRound(masters.urls, retry_count=0) as rl:
        lock = rl.lock("short-extend-stalled", ttl=30)
        assert take(lock), lock.last_error
        extended = lock.extend(ttl=0.3)
        # A quorum granted 0.3 s (the contract's "granted"; a loaded master may answer late),
        # and the holder stalled longer than that before looking.
        assert [v.kind for v in lock.last_votes].count("yes") >= rl.quorum, lock.last_votes
        assert probe_can_acquire(masters, "short-extend-stalled")
        assert not extended, "extend() returned True for keys that had already expired"
        assert not lock.owned(), f"owned with {lock.validity:.3f} s left after the keys expired"
        assert lock.validity == 0.0
        lock.release()


@pytest.mark.timeout(30)
def test_extend_to_a_shorter_ttl_that_fails_keeps_the_old_validity(masters: ServerSet) -> None:
    name = "short-extend-failed"
    with Redlock(masters.urls, retry_count=0, request_timeout=0.05) as rl:
        lock = rl.lock(name, ttl=30)
        # The premise: the extension below is written to every master, the paused ones too
        # (they apply it on resuming), and each holds the token. So first, an acquire that every
        # master granted (each link idle after it). On a loaded host a master may answer late:
        # its grant is then retracted and no extension reaches it (it answers 'held'), and a
        # round that timed out may have left it without a connection, whose connect to a
        # paused master would send nothing. Such an acquire is released and made again.
        take_everywhere(lock)
        paused = list(masters)[:3]
        for server in paused:
            server.pause()
        try:
            started = time.monotonic()
            # Two masters apply the 0.2 s TTL now; the three paused ones when they resume.
            assert not lock.extend(ttl=0.2)
            # The paused three answered nothing: a timeout, or an error where the acquire under
            # load had left that master without a link and its connect met the pause.
            assert all(v.kind in ("timeout", "error") for v in lock.last_votes[:3]), lock.last_votes
            # Whatever the attempt returned, any master may have applied the new TTL.
            assert lock.validity <= 0.2 - (time.monotonic() - started) + 0.001, lock.validity
        finally:
            for server in paused:
                server.resume()
        # The paused masters applied 0.2 s on resuming: the key is free 0.2 s later.
        assert wait_for(lambda: probe_can_acquire(masters, name), 5.0)
        assert not lock.owned(), f"owned with {lock.validity:.3f} s left while another client acquired"
        lock.release()


# -- 2. a forked child and its parent's lock -------------------------------------------------------
def granted_by(lock: Lock) -> set[str]:
    """The masters that said yes to ``lock``'s acquire: each holds its token until released."""
    return {vote.master for vote in lock.last_votes if vote.kind == "yes"}


def assert_still_the_parents(masters: ServerSet, lock: Lock, granted: set[str]) -> None:
    assert lock.owned()
    # Every master that granted the parent still holds its token (the acquire promises a quorum,
    # not five: a master that answered late had its grant retracted); a child's release or
    # extension would have deleted or replaced it there.
    assert len(granted) >= len(masters) // 2 + 1, granted
    values = values_on(masters, lock.key)
    token = lock.token
    assert token is not None and all(values[m] == token.encode() for m in granted), values
    assert not probe_can_acquire(masters, lock.name)


@pytest.mark.timeout(60)
def test_a_forked_child_leaving_with_by_sys_exit_releases_its_parents_lock(
    masters: ServerSet, rl: Redlock
) -> None:
    parent = os.getpid()
    lock = rl.lock("fork-with", ttl=30)
    read, write = os.pipe()
    try:
        with lock:
            granted = granted_by(lock)
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child: leave the block as a program would
                os.close(read)
                sys.exit(0)
            os.close(write)
            report = read_report(read, pid)
            assert report == {"unwound": True, "owned": False}, report
            assert_still_the_parents(masters, lock, granted)
    except SystemExit:  # pragma: no cover - only the child gets here, after `with` unwound
        if os.getpid() == parent:
            raise
        os.write(write, json.dumps({"unwound": True, "owned": lock.owned()}).encode())
        os._exit(0)
    except BaseException:  # pragma: no cover - the child must never run on into pytest
        if os.getpid() != parent:
            os._exit(1)
        raise
    assert set(values_on(masters, lock.key).values()) == {None}


@pytest.mark.timeout(60)
def test_a_forked_child_calling_release_releases_its_parents_lock(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("fork-release", ttl=30)
    assert take(lock), lock.last_error
    granted = granted_by(lock)

    def work() -> dict[str, Any]:
        # Nothing of the parent's is sent from here, waited for or not; each says "done".
        return {"released": [lock.release(), lock.release_without_waiting(), lock.release()]}

    assert in_child(work) == {"released": [True, None, True]}
    assert_still_the_parents(masters, lock, granted)
    lock.release()
    assert wait_for(lambda: probe_can_acquire(masters, "fork-release"), 5.0)


@pytest.mark.timeout(60)
def test_a_forked_child_owns_and_extends_its_parents_lock(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("fork-extend", ttl=30)
    assert take(lock), lock.last_error
    granted = granted_by(lock)

    def work() -> dict[str, Any]:
        report: dict[str, Any] = {
            "owned": lock.owned(),
            "validity": lock.validity,
            "token": lock.token,
            "extended": lock.extend(),
            "extended_short": lock.extend(ttl=0.5),
        }
        try:
            lock.ensure()
            report["ensure"] = "passed"
        except LockLost as exc:
            report["ensure"] = exc.reason
        return report

    report = in_child(work)
    assert report["owned"] is False, report
    assert report["validity"] == 0.0, report
    assert report["token"] is None, report
    assert report["extended"] is False and report["extended_short"] is False, report
    assert "another process" in report["ensure"], report
    assert_still_the_parents(masters, lock, granted)
    assert lock.validity > 29.0, "the child's extend(ttl=0.5) reached the masters"
    lock.release()


@pytest.mark.timeout(60)
def test_a_forked_child_may_take_its_parents_lock_only_anew(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("fork-acquire", ttl=30)
    assert take(lock), lock.last_error

    def work() -> dict[str, Any]:
        # A contender of its own: refused while the parent holds the lock...
        report: dict[str, Any] = {"while_held": lock.acquire(blocking=False)}
        report["votes"] = [v.kind for v in lock.last_votes]
        # ...and the owner of a new token once the parent let go.
        report["after"] = lock.acquire(timeout=5)
        report["owned"] = lock.owned()
        report["token"] = lock.token
        lock.release()
        return report

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            report = work()
        except BaseException as exc:
            report = {"raised": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    parents_token = lock.token
    # The child tries first while the parent holds it, then retries for up to 5 s.
    time.sleep(0.3)
    assert lock.owned()
    lock.release()
    report = read_report(read, pid)
    assert report.get("while_held") is False, report
    # Refused by the parent's hold: no quorum granted. Not "none granted": the parent holds on a
    # quorum, and a master that its acquire missed (a loaded one answering past the request
    # timeout) grants the child's attempt, which is then retracted.
    assert report["votes"].count("yes") < len(masters) // 2 + 1, report
    assert report["after"] is True and report["owned"] is True, report
    assert report["token"] != parents_token
    assert not lock.owned()


# -- 3. acquire() True while owned() is False ----------------------------------------------------
@pytest.mark.timeout(30)
def test_acquire_true_while_owned_false_when_connecting_is_slow(masters: ServerSet) -> None:
    # Replies are held 0.2 s by the proxies: a new connection's handshake (two round trips in
    # redis-py's) takes 0.4 s and the SET another 0.2 s, each within the request timeout, so
    # every master grants; only the round as a whole outlasts the 0.52 s TTL.
    ttl, request_timeout, delay = 0.52, 0.5, 0.2
    with ProxySet([server.address for server in masters]) as proxies:
        for proxy in proxies:
            proxy.delay(delay, "down")
        with Redlock(proxies.urls, retry_count=0, request_timeout=request_timeout) as rl:
            lock = rl.lock("slow-connect", ttl=ttl)
            started = time.monotonic()
            acquired = lock.acquire(blocking=False)
            took = time.monotonic() - started
            owned, validity = lock.owned(), lock.validity
            if acquired:
                assert owned, f"acquire() returned True after {took:.3f} s but owned() is False"
                assert validity <= ttl - took, (validity, took)
            if took > ttl:
                assert not acquired, f"acquired after {took:.3f} s, longer than the TTL"
            lock.release()
            proxies.heal()


# -- 4. a TTL no round can honour --------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_ttl_below_what_the_algorithm_can_honour_is_refused(masters: ServerSet) -> None:
    # (2 ms drift floor + 0.1 s request timeout) / (1 - 0.01 drift factor), up to the next ms.
    minimum = 0.104
    says = re.compile(r"ttl must be at least 0\.104 seconds")
    with pytest.raises(ConfigError, match=says):
        Redlock(masters.urls, ttl=0.05)
    with Redlock(masters.urls, retry_count=0) as rl:
        assert rl.min_ttl == pytest.approx(minimum)
        with pytest.raises(ConfigError, match=says):
            rl.lock("too-short", ttl=0.1)
        lock = rl.lock("just-long-enough", ttl=minimum)
        assert take(lock), lock.last_error
        with pytest.raises(ConfigError, match=says):
            lock.extend(ttl=0.002)
        assert lock.owned()
        lock.release()
    # The minimum follows the request timeout and the drift factor.
    with Redlock(masters.urls, request_timeout=0.01, drift_factor=0.1, ttl=0.02) as fast:
        assert fast.min_ttl == pytest.approx(0.014)
        with pytest.raises(ConfigError, match=r"at least 0\.014 seconds"):
            fast.lock("x", ttl=0.013)


# -- 5. the clock ------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_validity_is_counted_on_a_clock_that_stops_while_the_host_is_suspended() -> None:
    # Every reading of time in the lock goes through clock.now(); masters.py times only its
    # own round trips, which a suspend fails anyway.
    for module in ("redlock.py", "heartbeat.py", "resource.py"):
        source = (LOCK_DIR / module).read_text()
        others = re.findall(r"time\.(?:monotonic|time|perf_counter)\w*\(", source)
        assert not others, f"lock/{module} reads {others}, not clock.now()"
    from celery_redlock.lock import clock

    if not sys.platform.startswith("linux"):
        pytest.skip("CLOCK_BOOTTIME is Linux's")
    assert abs(clock.now() - time.clock_gettime(time.CLOCK_BOOTTIME)) < 0.01
    # In a time namespace whose boot clock is 10^5 s ahead of its monotonic clock, now() is the
    # boot clock: the one that counts the time a suspended host spent asleep.
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to make a time namespace")
    code = "import time; from celery_redlock.lock.clock import now; print(now() - time.monotonic())"
    run = subprocess.run(
        [unshare, "--time", "--boottime", "100000", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=20,
    )
    if run.returncode != 0:
        pytest.skip(f"no time namespace here: {run.stderr.strip()[-200:]}")
    assert float(run.stdout) == pytest.approx(100000, abs=1)


# -- 6. leftovers of a Redlock dropped without close() ----------------------------------------------
def connections_to(ports: set[int]) -> list[Any]:
    """This process's TCP connections to any of ``ports``."""
    return [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port in ports and c.status != psutil.CONN_CLOSE_WAIT
    ]


@contextlib.contextmanager
def proxied(masters: ServerSet) -> Iterator[ProxySet]:
    # Ports that only the Redlock under test connects to (other Redlocks of this process reach
    # the masters directly).
    with ProxySet([server.address for server in masters]) as proxies:
        yield proxies


def started_and_alive(before: set[threading.Thread], ports: set[int] | None = None) -> list[str]:
    """Threads started since ``before`` and still running, but the connects' (each on a
    short-lived thread of its own); with ``ports``, a reconnect or delivery thread counts only
    when it serves a master on one of them (another test's Redlock, dropped while one of its
    masters was down, retries on threads of its own, started after ``before`` too)."""

    def ours(name: str) -> bool:
        if ports is None or not name.startswith(("redlock-reconnect ", "redlock-deliver ")):
            return True
        return any(name.endswith(f":{port}") for port in ports)

    return [
        t.name
        for t in threading.enumerate()
        if t not in before and t.is_alive() and not t.name.startswith("redlock-connect") and ours(t.name)
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["release", "release_without_waiting"])
def test_a_redlock_dropped_without_close_leaves_no_thread_or_socket_behind(
    masters: ServerSet, how: str
) -> None:
    with proxied(masters) as proxies:
        ports = {proxy.port for proxy in proxies}
        before = set(threading.enumerate())
        rl = Redlock(proxies.urls, retry_count=0)
        lock = rl.lock("dropped", ttl=30)
        assert take(lock), lock.last_error
        key = lock.key
        if how == "release":
            assert lock.release() is True
            # Waited for: gone already from a quorum (the release's contract); the rest of the
            # masters' replies may still be on their way, and every key is gone below.
            gone_from = sum(value is None for value in values_on(masters, key).values())
            assert gone_from >= len(masters) // 2 + 1, values_on(masters, key)
        else:
            lock.release_without_waiting()  # written before it returned: dropping loses nothing
        # Connections open while it lives: one a master at least (a reply late under load makes
        # the reference transport open a second, which must go with the rest below).
        assert len(connections_to(ports)) >= len(masters)
        gone = weakref.ref(rl)
        del rl, lock
        gc.collect()
        assert wait_for(lambda: gone() is None, 5.0), "the Redlock is kept alive: " + repr(
            [type(r).__name__ for r in gc.get_referrers(gone())]
        )
        assert wait_for(lambda: not started_and_alive(before, ports), 5.0), started_and_alive(before, ports)
        assert wait_for(lambda: not connections_to(ports), 5.0), connections_to(ports)
        assert wait_for(lambda: set(values_on(masters, key).values()) == {None}, 5.0)


@pytest.mark.timeout(30)
def test_close_is_idempotent_and_the_redlock_usable_after_it(masters: ServerSet) -> None:
    with proxied(masters) as proxies:
        ports = {proxy.port for proxy in proxies}
        rl = Redlock(proxies.urls, retry_count=0)
        for _ in range(2):
            lock = rl.lock("closed", ttl=30)
            assert take(lock), lock.last_error
            assert lock.release() is True
            rl.close()
            rl.close()
            # The release returned once a quorum deleted the key; the other masters' deletes were
            # written and land when they land (a loaded host): closing drops none of them.
            key = lock.key
            assert wait_for(lambda k=key: set(values_on(masters, k).values()) == {None}, 5.0), values_on(
                masters, key
            )
            assert wait_for(lambda: not connections_to(ports), 5.0), connections_to(ports)


@pytest.mark.fast_transport("a fast-transport master's links after close()")
def test_a_link_whose_connect_ends_after_close_is_closed(masters: ServerSet) -> None:
    """INVARIANT (close() leaves no connection open): a connect under way when its Redlock is
    closed (one its round stopped waiting for, a background retry's, a delivery task's) ends
    with its link closed, not kept for a round that may never come. Under load a round's slow
    connect ended just after close(), and its socket stayed open for good."""
    ports = {server.port for server in masters}
    rl = Redlock(masters.urls, request_timeout=2.0)
    master = rl.masters[0]
    connect = master.start_connect()  # under way, as a round's that gave up on it
    assert connect is not None
    rl.close()
    connect.result(timeout=10)  # connected, after close()
    master.keep_for_later(connect)  # the round's done-callback
    assert wait_for(lambda: not connections_to(ports), 5.0), connections_to(ports)


@pytest.mark.timeout(30)
def test_a_redlock_dropped_with_a_master_down_leaves_its_threads_behind(masters: ServerSet) -> None:
    # A master that refuses connections is retried in the background; that too ends with the
    # Redlock. The connect pool is the process's, shared by every Redlock, and is not counted.
    with proxied(masters) as proxies:
        ports = {proxy.port for proxy in proxies}
        proxies[4].cut()
        before = set(threading.enumerate())
        # The four live masters must each answer (links and threads to clean up are the subject,
        # not reply speed): 0.1 s through the proxies is missed on a loaded host; the cut one is
        # refused at once.
        rl = Redlock(proxies.urls, retry_count=0, request_timeout=1.0)
        lock = rl.lock("dropped-down", ttl=30)
        assert take(lock), lock.last_error
        assert [v.kind for v in lock.last_votes][:4] == ["yes"] * 4
        assert lock.release() is True  # four of five answered
        gone = weakref.ref(rl)
        del rl, lock
        gc.collect()
        assert wait_for(lambda: gone() is None, 5.0), "the Redlock is kept alive"
        assert wait_for(lambda: not started_and_alive(before, ports), 5.0), started_and_alive(before, ports)
        assert wait_for(lambda: not connections_to(ports), 5.0), connections_to(ports)
        proxies[4].heal()
