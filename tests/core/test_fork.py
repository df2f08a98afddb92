"""A forked child can lock, even when another thread of its parent held one of our mutexes.

Only the thread that calls ``fork`` goes on in the child; a mutex that another thread held at
that moment stays held there for ever, and the child's first ``with`` on it hangs. A prefork
worker forks while its heartbeat, reconnect and connect threads run, so each mutex and
condition of the package is replaced in the child (``celery_redlock._fork``). Each case below
holds one of them in a second thread across ``os.fork()`` and has the child take, extend and
release a *new* lock through the code that uses that mutex, within a bounded time; the parent
kills a child that hangs. The parent's own connections must still work afterwards: a child
that read from or shut down a socket it inherited would leave them broken.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

import celery_redlock.celery.beat as beat_module
import celery_redlock.celery.held as held_module
import celery_redlock.celery.settings as settings_module
import celery_redlock.lock.heartbeat as heartbeat_module
import celery_redlock.lock.masters as masters_module
from celery_redlock import Lock, Redlock
from celery_redlock.lock.heartbeat import Heartbeat, process_heartbeat
from celery_redlock.testing import ProxySet, ServerSet

from .conftest import take, values_on, wait_for

# How long a child may take to lock and report; a child that hangs on a mutex never does.
CHILD_DEADLINE = 15.0


@pytest.fixture
def rl(masters: ServerSet) -> Iterator[Redlock]:
    """The core ``rl`` with a request_timeout a loaded host keeps: run_case asks every master to
    answer the parent on its inherited link (a child that read from it makes it miss any deadline),
    which is about the link, not about a reply within 0.1 s. 1 s still lets take_a_new_lock's
    heartbeat keep a 5 s lock at a 1 s interval."""
    with Redlock(masters.urls, retry_count=0, request_timeout=1.0) as instance:
        yield instance


@contextlib.contextmanager
def held_by_another_thread(*mutexes: Any) -> Iterator[None]:
    """Each of ``mutexes`` (a Lock or a Condition) held by a thread of its own meanwhile."""
    release = threading.Event()
    threads = []
    for mutex in mutexes:
        taken = threading.Event()

        def hold(mutex: Any = mutex, taken: threading.Event = taken) -> None:
            with mutex:
                taken.set()
                release.wait()

        thread = threading.Thread(target=hold, name="holds-a-mutex-across-fork", daemon=True)
        thread.start()
        assert taken.wait(5), f"{mutex!r} could not be taken"
        threads.append(thread)
    try:
        yield
    finally:
        release.set()
        for thread in threads:
            thread.join(5)


def in_child(work: Callable[[], str]) -> str:
    """Run ``work`` in a forked child; what it returned, or why it failed or hung."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: report and leave without running any cleanup
        os.close(read)
        try:
            report = work()
        except BaseException as exc:  # everything must reach the parent, not a traceback
            report = f"{type(exc).__name__}: {exc}"
        os.write(write, report.encode()[:4000])
        os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], CHILD_DEADLINE)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            return f"hung for {CHILD_DEADLINE} s"
        return os.read(read, 4096).decode() or "exited without a report"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def take_a_new_lock(redlock: Redlock, name: str, heartbeat: Heartbeat | None = None) -> str:
    """Acquire, extend (keep alive through ``heartbeat``, if given) and release ``name``, the
    release answered by a quorum."""
    lock = redlock.lock(name, ttl=5)
    if not lock.acquire(blocking=False):
        return f"not acquired: {lock.last_error}"
    if not lock.extend():
        return "not extended"
    if heartbeat is not None:
        heartbeat.keep(lock, interval=1)
        heartbeat.forget(lock)
    if not lock.release():
        return "release not answered by a quorum"
    return "ok"


def warm(redlock: Redlock) -> None:
    """Give every master idle connections, as a busy parent's would have at the fork."""
    lock = redlock.lock("fork-warm", ttl=5)
    # Retried: on a loaded machine the first round's connects may outlast request_timeout, and a
    # later round finds them made. What is tested comes after.
    assert lock.acquire(timeout=5), lock.last_error
    lock.release()


def run_case(masters: ServerSet, rl: Redlock, name: str, mutexes: list[Any], work: Callable[[], str]) -> None:
    warm(rl)
    with held_by_another_thread(*mutexes):
        started = time.monotonic()
        report = in_child(work)
    assert report == "ok", report
    assert time.monotonic() - started < CHILD_DEADLINE
    assert set(values_on(masters, f"redlock:{name}").values()) == {None}  # the child released
    # The parent's inherited connections were left alone by the child: they still work.
    parent_lock = rl.lock(name, ttl=5)
    assert take(parent_lock), parent_lock.last_error
    # Every master, not a quorum: a link the child read from or shut votes timeout or error.
    assert [v.kind for v in parent_lock.last_votes] == ["yes"] * len(masters)
    parent_lock.release()


def test_a_master_mutex(masters: ServerSet, rl: Redlock) -> None:
    def work() -> str:
        inherited = sum(len(m._idle) + len(m._owing) for m in rl.masters) + len(rl.transport._sets)
        if inherited:
            return f"the child kept {inherited} of its parent's connections"
        report = take_a_new_lock(rl, "fork-master")
        rl.close()  # takes every Master's mutex
        return report

    run_case(masters, rl, "fork-master", [m._mutex for m in rl.masters], work)


def test_a_connect_under_way_at_the_fork_is_the_parents(masters: ServerSet) -> None:
    """Connects run on threads of their own, none of which lives on in the child: a connect the
    parent had under way at the fork must not count in the child, where it would never end and,
    once past its deadline, would leave its master "connecting" for the child's life."""
    timeout = 1.0
    with (
        ProxySet([server.address for server in masters]) as proxies,
        Redlock(proxies.urls, retry_count=0, request_timeout=timeout) as rl,
    ):
        proxies.proxies[0].blackhole()  # accepted, never answered: its connect waits out its deadline
        connecting = threading.Thread(target=lambda: rl.lock("fork-connect-parent", ttl=5).acquire(False))
        connecting.start()
        assert wait_for(lambda: rl.masters[0]._connecting, 5.0)
        due = time.monotonic() + timeout

        def work() -> str:
            time.sleep(max(0.0, due - time.monotonic()) + 0.2)  # the parent's connect is overdue
            lock = rl.lock("fork-connect", ttl=5)
            if not lock.acquire(blocking=False):
                return f"not acquired: {lock.last_error}"
            kinds = [vote.kind for vote in lock.last_votes]
            lock.release()
            return "ok" if kinds == ["yes"] * len(masters) else f"votes: {lock.last_votes}"

        # Healed by the parent (the proxy's thread is the parent's) while the child waits.
        healer = threading.Timer(0.1, proxies.heal)
        healer.start()
        try:
            started = time.monotonic()
            report = in_child(work)
        finally:
            healer.join(5)
            connecting.join(5)
        assert report == "ok", report
        assert time.monotonic() - started < CHILD_DEADLINE


def test_a_masters_kept_releases(masters: ServerSet, rl: Redlock) -> None:
    """A release that no link could take is kept on its master (under the master's mutex) for
    the master's next link: it is the parent's to send, never the child's."""
    with (
        ProxySet([server.address for server in masters]) as proxies,
        Redlock(proxies.urls, retry_count=0, request_timeout=0.5) as parents,
    ):
        warm(parents)
        held = parents.lock("fork-kept-parent", ttl=30)
        assert take(held), held.last_error
        proxies.proxies[0].cut()  # every connection to master 0 is reset: the release is kept
        held.release_without_waiting()
        kept = parents.masters[0]
        assert kept._unsent, "the release was not kept"

        def work() -> str:
            if kept._unsent:
                return f"the child was left {len(kept._unsent)} of its parent's kept releases"
            return take_a_new_lock(parents, "fork-kept")  # four masters of five answer

        run_case(masters, rl, "fork-kept", [kept._mutex], work)
        proxies.heal()
        # The parent's reconnect writes it, long before the 30 s TTL.
        assert wait_for(
            lambda: set(values_on(masters, "redlock:fork-kept-parent").values()) == {None},
            masters_module.BACKOFF_CAP + 2.0,
        )


def test_a_heartbeat_condition(masters: ServerSet, rl: Redlock) -> None:
    heartbeat = Heartbeat(name="fork-test-heartbeat")
    try:
        run_case(
            masters,
            rl,
            "fork-heartbeat",
            [heartbeat._cond],
            lambda: take_a_new_lock(rl, "fork-heartbeat", heartbeat),
        )
    finally:
        heartbeat.stop()


def test_the_process_heartbeat(masters: ServerSet, rl: Redlock) -> None:
    kept = process_heartbeat()
    run_case(
        masters,
        rl,
        "fork-process-heartbeat",
        [heartbeat_module._process_mutex, kept._cond],
        lambda: take_a_new_lock(rl, "fork-process-heartbeat", process_heartbeat()),
    )


def test_the_settings_cache_lock(masters: ServerSet, rl: Redlock) -> None:
    app = Celery("fork-test", set_as_current=False)
    app.conf.redlock_masters = masters.urls
    _, parents = settings_module.app_settings_and_redlock(app)

    def work() -> str:
        _, own = settings_module.app_settings_and_redlock(app)
        if own is parents:
            return "the child was given its parent's Redlock"
        report = take_a_new_lock(own, "fork-settings")
        settings_module.close_app_redlock(app)
        return report

    try:
        run_case(masters, rl, "fork-settings", [settings_module._cache_lock], work)
    finally:
        settings_module.close_app_redlock(app)


def test_the_held_registry_mutex(masters: ServerSet, rl: Redlock) -> None:
    def work() -> str:
        lock: Lock = rl.lock("fork-held", ttl=5)
        if not lock.acquire(blocking=False):
            return f"not acquired: {lock.last_error}"
        held = held_module.Held(lock, "fork-task", time.monotonic(), expire=False)
        held_module.register(held)
        released = held_module.release_all("test")  # takes the registry's mutex
        return "ok" if released == 1 else f"released {released} locks, expected 1"

    run_case(masters, rl, "fork-held", [held_module._held_mutex], work)


def test_the_beat_class_mutex(masters: ServerSet, rl: Redlock) -> None:
    from celery.beat import PersistentScheduler

    def work() -> str:
        beat_module._wrap(PersistentScheduler)  # takes the mutex of the wrapped classes
        return take_a_new_lock(rl, "fork-beat")

    run_case(masters, rl, "fork-beat", [beat_module._wrapped_mutex], work)
