"""A ``lock_enqueue`` marker lasts no longer than its message: every way a worker ends a marked
message without a run that took its key over frees the key at once (or the run is not ended
that way at all), instead of leaving it refused for ``lock_enqueue_ttl``. On real workers, a
real broker and five real masters."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import states
from conftest import HERE, ROOT, wait_for

from celery_redlock.celery import discarded
from celery_redlock.celery.settings import app_settings_and_redlock, close_app_redlock
from celery_redlock.lock import markers
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet
from tests.appservers import marker_gone

Workers = Callable[..., tuple[str, CeleryWorker]]


def _env(broker: RedisServer, masters: list[str]) -> dict[str, str]:
    return {"ENDS_BROKER": broker.url, "ENDS_MASTERS": ",".join(masters)}


@pytest.fixture(scope="module")
def ends(broker: RedisServer, _redlock_server_set: ServerSet) -> Iterator[Any]:
    """The test process's side of ``endsapp`` (a publisher), configured like the workers."""
    os.environ.update(_env(broker, _redlock_server_set.urls))
    import endsapp

    endsapp.app.conf.update(
        broker_url=broker.url, result_backend=broker.url, redlock_masters=_redlock_server_set.urls
    )
    yield endsapp
    close_app_redlock(endsapp.app)


def worker_of(env: dict[str, str], pool: str, concurrency: int | None, queue: str) -> CeleryWorker:
    return CeleryWorker(
        "endsapp",
        pool=pool,
        concurrency=concurrency,
        queues=[queue],
        env=env,
        pythonpath=[str(HERE), str(ROOT)],
    )


@pytest.fixture(scope="module")
def workers(ends: Any, broker: RedisServer, _redlock_server_set: ServerSet) -> Iterator[Workers]:
    """``workers(pool, concurrency, **env)``: a worker of that kind (started once per module)."""
    run = uuid.uuid4().hex[:8]
    started: dict[tuple[Any, ...], tuple[str, CeleryWorker]] = {}

    def start(pool: str, concurrency: int | None = 2, **extra: str) -> tuple[str, CeleryWorker]:
        key = (pool, concurrency, *sorted(extra.items()))
        if key not in started:
            queue = f"ends-{pool}-{concurrency}-{len(started)}-{run}"
            env = {**_env(broker, _redlock_server_set.urls), **extra}
            started[key] = (queue, worker_of(env, pool, concurrency, queue))
            started[key][1].start()
        return started[key]

    try:
        yield start
    finally:
        for _, worker in started.values():
            worker.cleanup()


@pytest.fixture
def gone(ends: Any, _redlock_server_set: ServerSet) -> Callable[[Any, str, str], bool]:
    """Whether no master names ``task_id`` for ``e:<tag>`` (see tests/appservers.marker_gone),
    called as ``gone(task, tag, task_id)``."""
    prefix = app_settings_and_redlock(ends.app)[1].key_prefix
    return lambda task, tag, task_id: marker_gone(_redlock_server_set, prefix, f"e:{tag}", task.name, task_id)


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:10]


@pytest.mark.timeout(90)
def test_a_marked_message_a_worker_discards_as_unregistered_frees_its_key(
    ends: Any, workers: Workers, tag: str, gone: Callable[[Any, str, str], bool]
) -> None:
    """A worker of another deploy (celery_redlock configured, the task not registered) discards
    the message: it can never run. The next publish must be published, not handed its id."""
    queue, worker = workers("solo", None, ENDS_OLD_DEPLOY="1")
    first = ends.marked.apply_async((tag,), queue=queue)
    assert wait_for(lambda: first.state == states.FAILURE, 20.0), first.state  # NotRegistered
    assert wait_for(lambda: gone(ends.marked, tag, first.id), 5.0), (
        f"the message {first.id} was discarded (unregistered task), yet its key still names it: "
        f"{ends.marked.queued_task_id(tag)}; log: {worker.log_tail(1500)}"
    )
    second = ends.marked.apply_async((tag,), queue=f"ends-nobody-{tag}")
    assert second.id != first.id


@pytest.mark.timeout(90)
def test_a_marked_message_a_worker_rejects_for_its_content_type_frees_its_key(
    ends: Any, workers: Workers, tag: str, gone: Callable[[Any, str, str], bool]
) -> None:
    """A message in a content type the worker does not accept (pickle; it accepts json) is
    rejected before any run: its marker must go with it."""
    queue, worker = workers("solo", None)
    first = ends.marked.apply_async((tag,), queue=queue, serializer="pickle")
    assert wait_for(lambda: gone(ends.marked, tag, first.id), 20.0), (
        f"the message {first.id} was rejected (content type), yet its key still names it: "
        f"{ends.marked.queued_task_id(tag)}; log: {worker.log_tail(1500)}"
    )
    assert "ContentDisallowed" in worker.log_text() or "not accept" in worker.log_text()


def prerun_of(events: list[dict[str, Any]], task_id: str) -> int:
    """The pid of the process that began running ``task_id`` (its ``prerun`` event); 0 if none."""
    return next((e["pid"] for e in events if e["event"] == "prerun" and e.get("run") == task_id), 0)


@pytest.mark.timeout(90)
def test_a_marked_message_revoked_while_it_waits_for_the_lock_frees_its_key(
    ends: Any, workers: Workers, tag: str, gone: Callable[[Any, str, str], bool]
) -> None:
    """``lock_contended="wait"``: a marked message (its marker beside the key, which another task
    holds) is revoked while its run waits (threads pool: the wait sees the revoke and ends the
    run as revoked). Its message will never run again: the next publish must be published."""
    queue, _ = workers("threads", 4)
    holder = ends.slow.apply_async((tag, 3.0), queue=queue)
    assert wait_for(lambda: any(e["event"] == "start" for e in ends.events(tag)), 15.0)
    waiting = ends.marked_wait.apply_async((tag,), queue=queue)
    assert wait_for(lambda: prerun_of(ends.events(tag), waiting.id), 15.0), ends.events(tag)
    ends.app.control.revoke(waiting.id)  # picked up by a free thread: waiting for the lock
    assert wait_for(lambda: waiting.state == states.REVOKED, 15.0), waiting.state
    assert wait_for(lambda: gone(ends.marked_wait, tag, waiting.id), 5.0), (
        f"the waiting run was revoked ({waiting.state}), yet the key still names it: "
        f"{ends.marked_wait.queued_task_id(tag)}; events {ends.events(tag)}"
    )
    holder.get(timeout=30, propagate=False)
    second = ends.marked_wait.apply_async((tag,), queue=queue)
    assert second.id != waiting.id
    second.get(timeout=20)


@pytest.mark.timeout(90)
def test_a_marked_run_whose_pool_child_is_killed_while_it_waits_frees_its_key(
    ends: Any, workers: Workers, tag: str, gone: Callable[[Any, str, str], bool]
) -> None:
    """prefork: a marked run waits for the lock (another task holds it) and its pool child is
    SIGKILLed (the OOM killer). The worker records the failure; the marker must not outlive
    the message by lock_enqueue_ttl: the worker's main process deletes it."""
    queue, worker = workers("prefork", 2)
    holder = ends.slow.apply_async((tag, 4.0), queue=queue)
    assert wait_for(lambda: any(e["event"] == "start" for e in ends.events(tag)), 15.0)
    holder_pid = next(e["pid"] for e in ends.events(tag) if e["event"] == "start")
    waiting = ends.marked_wait.apply_async((tag,), queue=queue)
    # Picked up by the other child, which waits for the lock: that child is the one killed.
    assert wait_for(lambda: prerun_of(ends.events(tag), waiting.id), 15.0), ends.events(tag)
    waiting_pid = prerun_of(ends.events(tag), waiting.id)
    assert waiting_pid != holder_pid and waiting_pid in worker.child_pids(), (holder_pid, waiting_pid)
    os.kill(waiting_pid, signal.SIGKILL)
    assert wait_for(lambda: waiting.state == states.FAILURE, 20.0), waiting.state
    assert wait_for(lambda: gone(ends.marked_wait, tag, waiting.id), 5.0), (
        f"the waiting run's child was killed ({waiting.state}: {waiting.result!r}), yet the key "
        f"still names it: {ends.marked_wait.queued_task_id(tag)}"
    )
    holder.get(timeout=30, propagate=False)


@pytest.mark.timeout(90)
def test_a_marked_run_with_a_hard_time_limit_is_not_killed_while_it_waits(
    ends: Any, workers: Workers, tag: str
) -> None:
    """prefork, ``time_limit=2`` and no soft limit, while another task holds the key for 4 s:
    the wait ends before the hard limit (which would kill the child, losing the work), the run
    retries the lock, runs once the key is free, and then frees it."""
    queue, _ = workers("prefork", 2)
    holder = ends.slow.apply_async((tag, 4.0), queue=queue)
    assert wait_for(lambda: any(e["event"] == "start" for e in ends.events(tag)), 15.0)
    waiting = ends.marked_wait.apply_async((tag,), queue=queue, time_limit=2.0)
    value = waiting.get(timeout=30, propagate=False)
    assert waiting.state == states.SUCCESS, (waiting.state, value)
    holder.get(timeout=30, propagate=False)
    second = ends.marked_wait.apply_async((tag,), queue=queue)
    assert second.id != waiting.id
    second.get(timeout=20)


class _Request:
    """A worker request as ``task_received`` hands it (weakly referable, as Celery's is)."""

    def __init__(self, task_id: str, marker: dict[str, str]) -> None:
        self.id = task_id
        self.request_dict = {"id": task_id, "redlock_marker": marker}


class _Task:
    """What ``task_failure`` sends as its sender for the hard time limit: the task, whose
    request is not the failed run's."""

    def __init__(self, app: Any, name: str) -> None:
        self.app = app
        self.name = name
        self.request = None


def test_the_hard_time_limits_failure_sent_without_the_request_deletes_the_marker(
    ends: Any, tag: str
) -> None:
    """The worker's main process sends the hard time limit's ``task_failure`` without the run's
    request: the marker is found from the request ``task_received`` handed over."""
    redlock = app_settings_and_redlock(ends.app)[1]
    name = f"e:{tag}"
    side = markers.side_key(redlock.key_prefix, name, "ends.marked_wait")
    value = markers.new_value('{"task": "' + tag + '", "queued": true}')
    assert markers.place(redlock, name, side, value, 60.0).value == value
    request = _Request(tag, {"name": name, "value": value})
    discarded.note_marked(request=request)
    discarded.drop_failed_marker(sender=_Task(ends.app, "ends.marked_wait"), task_id=tag)
    assert redlock.holder(name) is None, "the marker of the killed run's message is still there"
