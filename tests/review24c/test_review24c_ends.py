"""Every way a worker ends a marked message without a run that took its key over frees the key,
also when the marker waits *beside* the key (another holder has it), and a marked run's wait
for the lock ends before an app-wide hard time limit. Real workers, a real broker, three real
masters."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states

from celery_redlock.celery.settings import app_settings_and_redlock
from celery_redlock.lock import markers
from celery_redlock.lock.resource import lock_key
from celery_redlock.testing import CeleryWorker

from ..appservers import app_env, marker_gone
from ..core.conftest import take
from .conftest import ROOT, Servers, Workers, wait_for


def _side_values(r24_servers: Servers, key: str) -> list[Any]:
    found = []
    for server in r24_servers[1]:
        client = server.client()
        try:
            found.append(client.get(key))
        finally:
            client.close()
    return found


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["unregistered", "rejected"])
def test_a_discarded_message_whose_marker_waits_beside_the_key_frees_it(
    r24: Any, r24_servers: Servers, r24_workers: Workers, tag: str, how: str
) -> None:
    """An operator's lock (any other holder) has the key, so the marked message's marker waits
    on the task's side key. The worker discards the message (a deploy without the task; a
    content type it does not accept): the side marker must go too, or the task's next publish
    is handed the id of a message that will never run."""
    redlock = app_settings_and_redlock(r24.app)[1]
    name = f"r24:{tag}"
    held = redlock.lock(name, 30.0, holder="operator maintenance")
    assert take(held)
    try:
        if how == "unregistered":
            queue, worker = r24_workers("solo", None, R24_OLD_DEPLOY="1")
            first = r24.marked.apply_async((tag,), queue=queue)
        else:
            queue, worker = r24_workers("solo", None)
            first = r24.marked.apply_async((tag,), queue=queue, serializer="pickle")
        side = markers.side_key(redlock.key_prefix, name, "r24.marked")
        # The lock key is the operator's throughout, so the marker was set beside it (the worker
        # may already have discarded the message: the side key is not read here, racing it).
        assert redlock.holder(name) == "operator maintenance"
        assert wait_for(
            lambda: marker_gone(r24_servers[1], redlock.key_prefix, name, "r24.marked", first.id), 20.0
        ), (
            f"the message {first.id} was discarded ({how}), yet its marker beside the key still "
            f"names it: side key {_side_values(r24_servers, side)}; log: {worker.log_tail(1500)}"
        )
        assert r24.marked.queued_task_id(tag) is None
        second = r24.marked.apply_async((tag,), queue=f"r24-nobody-{tag}")
        assert second.id != first.id
    finally:
        held.release()


@pytest.mark.timeout(90)
def test_a_marked_run_waiting_under_an_app_wide_hard_time_limit_is_not_killed(
    r24: Any, r24_workers: Workers, tag: str
) -> None:
    """prefork, ``task_time_limit=2`` set app-wide (no call or task limit on the marked task),
    while another task holds the key for 4 s: the wait must end before the pool kills the
    child (the work would be lost), the run retry, run once the key is free, and free it."""
    queue, worker = r24_workers("prefork", 2, R24_TIME_LIMIT="2")
    holder = r24.slow.apply_async((tag, 4.0), queue=queue)
    assert wait_for(lambda: any(e["event"] == "start" for e in r24.events(tag)), 20.0)
    waiting = r24.marked_wait.apply_async((tag,), queue=queue)
    value = waiting.get(timeout=40, propagate=False)
    assert waiting.state == states.SUCCESS, (waiting.state, value, worker.log_tail(2000))
    holder.get(timeout=30, propagate=False)
    assert wait_for(lambda: r24.marked_wait.queued_task_id(tag) is None, 5.0)


@pytest.mark.timeout(90)
def test_a_marked_run_revoked_with_terminate_while_it_waits_frees_its_key(
    r24: Any, r24_servers: Servers, r24_workers: Workers, tag: str
) -> None:
    """prefork: the child never sees the revoked set, so a waiting run is revoked with
    ``terminate=True`` (SIGTERM to the child). Its message never runs again: its marker (beside
    the key) must go, and the next publish be published and run."""
    queue, worker = r24_workers("prefork", 2)
    holder = r24.slow.apply_async((tag, 4.0), queue=queue)
    assert wait_for(lambda: any(e["event"] == "start" for e in r24.events(tag)), 20.0)
    waiting = r24.marked_wait.apply_async((tag,), queue=queue)
    ran = lambda: any(e["event"] == "prerun" and e.get("run") == waiting.id for e in r24.events(tag))  # noqa: E731
    assert wait_for(ran, 20.0), r24.events(tag)
    r24.app.control.revoke(waiting.id, terminate=True)  # in the other child: waiting for the lock
    assert wait_for(lambda: waiting.state == states.REVOKED, 20.0), (waiting.state, worker.log_tail(1500))
    redlock = app_settings_and_redlock(r24.app)[1]

    def gone() -> bool:
        return marker_gone(r24_servers[1], redlock.key_prefix, f"r24:{tag}", "r24.marked_wait", waiting.id)

    assert wait_for(gone, 5.0), (
        f"revoked ({waiting.state}), yet the key still names it: {r24.marked_wait.queued_task_id(tag)}"
    )
    holder.get(timeout=30, propagate=False)
    second = r24.marked_wait.apply_async((tag,), queue=queue)
    assert second.id != waiting.id
    second.get(timeout=20)
    assert redlock.holder(f"r24:{tag}") is None or wait_for(
        lambda: redlock.read_everywhere(lock_key(redlock.key_prefix, f"r24:{tag}")) == [None] * 3, 5.0
    )


@pytest.fixture(scope="module")
def cli_limited(r24: Any, r24_servers: Servers) -> Iterator[str]:
    """The queue of a prefork worker started with ``celery worker --time-limit 2`` (the
    operator's, on the command line; no limit in the app's configuration, the task's or the
    call's)."""
    queue = f"r24-cli-limit-{uuid.uuid4().hex[:8]}"
    worker = CeleryWorker(
        "tests.review24c.app",
        pool="prefork",
        concurrency=2,
        queues=[queue],
        env=app_env("R24", *r24_servers),
        pythonpath=[str(ROOT)],
        cwd=str(ROOT),
        args=["--time-limit", "2"],
    )
    try:
        worker.start()
        yield queue
    finally:
        worker.cleanup()


def _wait_behind_a_holder(r24: Any, queue: str, tag: str) -> tuple[Any, Any]:
    """Another task holds the key for 4 s; a marked run (wait mode) waits for it."""
    holder = r24.slow.apply_async((tag, 4.0), queue=queue)
    assert wait_for(lambda: any(e["event"] == "start" for e in r24.events(tag)), 20.0)
    waiting = r24.marked_wait.apply_async((tag,), queue=queue)
    value = waiting.get(timeout=40, propagate=False)
    holder.get(timeout=30, propagate=False)
    return waiting, value


@pytest.mark.timeout(90)
def test_a_marked_run_waiting_under_the_workers_time_limit_option_is_not_killed(
    r24: Any, cli_limited: str, tag: str
) -> None:
    """The marked run's wait must end before the pool's hard limit kills its child."""
    waiting, value = _wait_behind_a_holder(r24, cli_limited, tag)
    assert waiting.state == states.SUCCESS, (
        f"the waiting run ended {waiting.state}: {value!r}; nothing of its work ran: {r24.events(tag)}"
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["revoked", "expired"])
def test_a_delayed_message_whose_marker_waits_beside_the_key_frees_it_when_it_cannot_run(
    r24: Any, r24_servers: Servers, r24_workers: Workers, tag: str, how: str
) -> None:
    """An operator's lock has the key, so the marker of a delayed message (countdown 3 s) waits
    beside it. The message is revoked, or expires before it is due: the worker discards it when
    it comes due, and must delete the side marker, or the next publish is handed its id."""
    redlock = app_settings_and_redlock(r24.app)[1]
    name = f"r24:{tag}"
    held = redlock.lock(name, 30.0, holder="operator maintenance")
    assert take(held)
    try:
        queue, worker = r24_workers("solo", None)
        if how == "revoked":
            first = r24.marked.apply_async((tag,), queue=queue, countdown=3.0)
            time.sleep(0.5)
            r24.app.control.revoke(first.id)
        else:
            first = r24.marked.apply_async((tag,), queue=queue, countdown=3.0, expires=1.5)
        assert r24.marked.queued_task_id(tag) in (first.id, None)
        assert wait_for(lambda: first.state == states.REVOKED, 20.0), first.state
        # REVOKED is stored when the worker receives the revoke; the message is discarded (its
        # marker deleted) when it comes due, 3 s after its publish (later on a loaded host).
        side = markers.side_key(redlock.key_prefix, name, "r24.marked")
        assert wait_for(
            lambda: marker_gone(r24_servers[1], redlock.key_prefix, name, "r24.marked", first.id), 20.0
        ), (
            f"the message {first.id} was discarded ({how}), yet its marker beside the key still "
            f"names it: side key {_side_values(r24_servers, side)}; log: {worker.log_tail(1500)}"
        )
        assert r24.marked.queued_task_id(tag) is None
        second = r24.marked.apply_async((tag,), queue=f"r24-nobody-{tag}")
        assert second.id != first.id
    finally:
        held.release()
