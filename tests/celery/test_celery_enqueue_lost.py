"""``lock_enqueue`` loses no work: a call is deduplicated only against a message that will run
(or a run), and a run is never refused by its own message's marker. On real workers, a real
broker and real masters (the workers reach the masters through proxies).

- a marker lasts no longer than its message's ``expires``;
- a call is not handed the id of a publish that has not returned (its publisher may die);
- a message marked under other names for the same masters (a proxy, a DNS alias) runs;
- a duplicate of a running run is answered at once, though a result of an earlier run of the
  same (reused) task id is stored.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from types import ModuleType

import pytest
from celery import states
from conftest import ROOT, wait_for

from celery_redlock.celery.settings import app_redlock, close_app_redlock
from celery_redlock.lock import markers
from celery_redlock.lock.holder import HolderRecord, parse
from celery_redlock.lock.resource import HOLDER_SEPARATOR, lock_key
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet
from celery_redlock.testing.proxy import Proxy, ProxySet

APP = "tests.enqueue_lost.app"

Servers = tuple[RedisServer, ServerSet, ProxySet]


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    """A broker (also the result backend and the records), three masters, a proxy per master."""
    with RedisServer() as broker, ServerSet(3) as masters:
        proxies = ProxySet([m.address for m in masters], name="workers").start()
        try:
            yield broker, masters, proxies
        finally:
            proxies.close()


def env_of(broker: RedisServer, masters_urls: list[str]) -> dict[str, str]:
    base = broker.url.rsplit("/", 1)[0]
    return {
        "ELOST_BROKER": f"{base}/0",
        "ELOST_BACKEND": f"{base}/1",
        "ELOST_RECORDS": f"{base}/2",
        "ELOST_MASTERS": ",".join(masters_urls),
    }


@pytest.fixture(scope="module")
def lost(servers: Servers) -> Iterator[ModuleType]:
    """The test process's side of the app: it names the masters as the workers do (through the
    proxies), unless a test says otherwise."""
    broker, _, proxies = servers
    env = env_of(broker, proxies.urls)
    os.environ.update(env)
    from tests.enqueue_lost import app

    app.app.conf.update(
        broker_url=env["ELOST_BROKER"],
        result_backend=env["ELOST_BACKEND"],
        redlock_masters=env["ELOST_MASTERS"],
    )
    yield app
    close_app_redlock(app.app)


def _worker(servers: Servers, pool: str, concurrency: int | None, queue: str) -> CeleryWorker:
    broker, _, proxies = servers
    return CeleryWorker(
        APP,
        pool=pool,
        concurrency=concurrency,
        queues=[queue],
        env=env_of(broker, proxies.urls),
        pythonpath=[str(ROOT)],
        cwd=str(ROOT),
    )


@pytest.fixture(scope="module")
def threads_queue(lost: ModuleType, servers: Servers) -> Iterator[str]:
    """The queue of a threads worker (4 threads), started once for the module."""
    queue = f"elost-threads-{uuid.uuid4().hex[:8]}"
    worker = _worker(servers, "threads", 4, queue)
    try:
        worker.start()
        yield queue
    finally:
        worker.cleanup()


@pytest.mark.timeout(90)
def test_a_publish_after_the_queued_message_expired_is_not_deduplicated_against_it(
    lost: ModuleType, servers: Servers, tag: str
) -> None:
    """``expires=1``: after a second the queued message can never run (a worker discards it as
    revoked). A publish made after that must not be handed its id."""
    queue = f"elost-late-{tag}"
    first = lost.deduped.apply_async((tag,), queue=queue, expires=1.0)
    time.sleep(1.5)  # the first message has expired: it can no longer run
    second = lost.deduped.apply_async((tag,), queue=queue)
    worker = _worker(servers, "solo", None, queue)
    try:
        worker.start()
        ran = wait_for(lambda: any(e["event"] == "end" for e in lost.events(tag)), 20.0)
        wait_for(lambda: first.state == states.REVOKED, 10.0)
    finally:
        worker.cleanup()
    assert ran and second.id != first.id, (
        f"the second publish was deduplicated against an expired message: second.id == first.id "
        f"= {first.id}, its state {second.state}; nothing ran for the second call "
        f"(events: {lost.events(tag)})"
    )


@pytest.mark.timeout(90)
def test_a_call_deduplicated_against_a_publisher_that_died_before_its_publish_still_runs(
    lost: ModuleType, servers: Servers, threads_queue: str, tag: str
) -> None:
    """A publisher places its marker, then hangs on the broker and is SIGKILLed before the
    message is published. A call made right after must not be handed the dead publish's id
    (no message carries it): its work must run."""
    broker, _, proxies = servers
    with Proxy(broker.address, name="dead-publisher-broker").start() as to_broker:
        to_broker.blackhole()
        env = dict(os.environ)
        env.update(env_of(broker, proxies.urls))
        env["ELOST_BROKER"] = to_broker.url
        env["PYTHONPATH"] = str(ROOT)
        publisher = subprocess.Popen(
            [sys.executable, "-m", "tests.enqueue_lost.publisher", tag, threads_queue],
            env=env,
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        redlock = app_redlock(lost.app)
        key = lock_key(redlock.key_prefix, f"lost:{tag}")
        try:
            # The marker, as placed (its publish has not returned): on a quorum of the masters.
            marked = wait_for(lambda: sum(v is not None for v in redlock.read_everywhere(key)) >= 2, 20.0)
            values = [v for v in redlock.read_everywhere(key) if v is not None]
            # INVARIANT: the id of a publish that may never reach the broker is handed to no
            # caller; that a publish is under way is said (a call now would wait for it).
            reported = lost.deduped.queued_task_id(tag), lost.deduped.is_queued(tag)
        finally:
            os.kill(publisher.pid, signal.SIGKILL)
            out = publisher.communicate(timeout=10)[0].decode(errors="replace")
        assert marked, f"the publisher never placed its marker: {out[-2000:]}"
        assert "published" not in out.split("publishing", 1)[-1], out
        record = parse(values[0].decode().partition(HOLDER_SEPARATOR)[2])
        assert record is not None and record.queued and record.published is False, values
        ghost = record.task
        assert reported == (None, True), f"an unpublished marker's id was handed out: {reported}"
        second = lost.deduped.apply_async((tag,), queue=threads_queue)
        try:
            second.get(timeout=15)
        except Exception as exc:
            pytest.fail(
                f"the call was handed the id {second.id} (the dead publisher's {ghost}: "
                f"{second.id == ghost}); its work never ran: {type(exc).__name__} {exc}; "
                f"events {lost.events(tag)}"
            )


@pytest.mark.timeout(90)
def test_a_duplicate_of_a_running_reused_task_id_is_answered_without_waiting(
    lost: ModuleType, threads_queue: str, tag: str, finishing_waits: list[str]
) -> None:
    """A fixed task id reused by a second publish (the first run finished, its result stored):
    while the second run holds the key, a duplicate publish is deduplicated against it. The
    stale result of the first run must not make that publish wait (FINISHING_WAIT, 1 s) as if
    the running holder were a finished run whose release is on its way."""
    fixed = f"fixed-{tag}"
    lost.deduped.apply_async((tag, 0.0), task_id=fixed, queue=threads_queue).get(timeout=20)
    lost.deduped.apply_async((tag, 4.0), task_id=fixed, queue=threads_queue)
    assert wait_for(lambda: sum(e["event"] == "start" for e in lost.events(tag)) == 2, 15.0)
    dup = lost.deduped.apply_async((tag,), queue=threads_queue)
    assert dup.id == fixed
    # What the publish decided, not how long it took on this host: the holder is running, so
    # it did not wait on the key as if a finished run's release were on its way.
    assert finishing_waits == [], f"the duplicate publish waited out a finished run: {finishing_waits}"


@pytest.mark.timeout(90)
def test_a_message_marked_under_other_names_for_the_same_masters_runs(
    lost: ModuleType, servers: Servers, threads_queue: str, tag: str
) -> None:
    """The publisher names the masters by their own addresses, the workers reach the very same
    servers through other addresses (here: TCP proxies; in the field a DNS alias, localhost
    against 127.0.0.1, a Kubernetes service). The marker is on the same key of the same servers:
    the run must take it over (or at least not be refused by its own message's marker)."""
    _, masters, proxies = servers
    app = lost.app
    app.conf.redlock_masters = ",".join(masters.urls)
    close_app_redlock(app)
    try:
        result = lost.deduped.apply_async((tag,), queue=threads_queue)
    finally:
        app.conf.redlock_masters = ",".join(proxies.urls)
        close_app_redlock(app)
    try:
        result.get(timeout=20)
    except Exception as exc:
        refused = [e for e in lost.events(tag) if e["event"] == "refused"]
        pytest.fail(
            f"the run never got its lock ({type(exc).__name__}); {len(refused)} lock refusals, the "
            f"last: {refused[-1]['error'][:300] if refused else None}; the marker lasts "
            f"lock_enqueue_ttl (3600 s)"
        )


@pytest.mark.timeout(30)
def test_a_marker_kept_on_only_some_masters_is_still_one_queued_message(
    lost: ModuleType, servers: Servers, tag: str
) -> None:
    """A publish whose keep() reached only some masters leaves its marker as placed on the others:
    the two forms are one marker, and a quorum of them both is a queued message (published, since
    a master shows it so). Counted apart, neither form had a quorum, and the queued message was
    reported as nothing at all."""
    _, masters, _ = servers
    redlock = app_redlock(lost.app)
    key = lock_key(redlock.key_prefix, f"lost:{tag}")
    task_id = f"queued-{tag}"
    record = HolderRecord(name=lost.deduped.name, host="elsewhere", pid=1, ttl=60.0, queued=True)
    placed = markers.new_value(record.to_text(task=task_id, since=time.time(), publish="p"))
    forms = [placed, markers.published(placed), None]  # master 2 never saw it (down, say)
    for server, value in zip(masters, forms, strict=True):
        if value is not None:
            client = server.client()
            try:
                client.set(key, value, px=60_000)
            finally:
                client.close()
    assert lost.deduped.queued_task_id(tag) == task_id
    assert lost.deduped.is_queued(tag)
