"""Deduplication at publish (``lock_enqueue``) on real workers, a real broker and real masters.

The invariant every test here checks a part of: **from before its publish returns until its run
ends, a message owns its key**. Hence one queued message per key, never two runs of one key at
once, and a key freed by whatever ends the message (its run, a revoke, a dead worker, a lost
message), within a TTL.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from celery import chain, group
from conftest import HERE, ROOT, RUN, app_env, wait_until

from celery_redlock import AlreadyQueued, ConfigError, RedlockTask
from celery_redlock.celery.enqueue import MARKER_HEADER
from celery_redlock.celery.settings import read_settings
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet
from tests.appservers import still_queued

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
QUEUE = f"q-enqueue-{RUN}"


@pytest.fixture(scope="module")
def enq(broker: RedisServer, _redlock_server_set: ServerSet) -> Any:
    """The test process's side of ``enqueueapp``, configured like its workers."""
    os.environ.update(app_env(broker.url, broker.url, _redlock_server_set.urls, QUEUE))
    import enqueueapp as module

    module.BACKEND = broker.url
    module.app.conf.update(
        broker_url=broker.url,
        result_backend=broker.url,
        redlock_masters=_redlock_server_set.urls,
        task_default_queue=QUEUE,
    )
    # Bound here, not by whichever of a burst's threads touches a task first: tasks used from
    # 8 threads at once before the app is finalized raced on their binding (request_stack None).
    module.app.finalize(auto=True)
    return module


@pytest.fixture(scope="module")
def workers(enq: Any, broker: RedisServer, _redlock_server_set: ServerSet) -> Iterator[list[CeleryWorker]]:
    env = app_env(broker.url, broker.url, _redlock_server_set.urls, QUEUE)
    started: list[CeleryWorker] = []
    try:
        for _ in range(2):
            worker = CeleryWorker(
                "enqueueapp",
                pool="prefork",
                concurrency=2,
                queues=[QUEUE],
                env=env,
                pythonpath=[str(HERE), str(ROOT)],
            )
            started.append(worker)
            worker.start()
        yield started
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture
def live(workers: list[CeleryWorker], redlock_masters: ServerSet) -> list[CeleryWorker]:
    for worker in workers:
        assert worker.running, f"{worker!r} died; log tail:\n{worker.log_tail()}"
    return workers


def runs(enq: Any, name: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in enq.store().lrange(name, 0, -1)]


def freed_within(enq: Any, task: Any, args: tuple[Any, ...], timeout: float) -> float:
    """Seconds until a publish of ``args`` would find the key free; fails past ``timeout``."""
    started = time.monotonic()
    wait_until(lambda: not still_queued(task, *args), timeout, f"the key of {args!r} to be freed")
    return time.monotonic() - started


# -- a burst of duplicates: one message per key, counted on the broker -------------------------


def _burst(task: Any, queue: str, tag: str, calls: int, keys: int) -> dict[str, set[str]]:
    """``calls`` publishes over ``keys`` keys from 8 threads; key -> the ids the calls got."""
    order = [f"{tag}-{i % keys}" for i in range(calls)]
    random.Random(tag).shuffle(order)
    got: dict[str, set[str]] = defaultdict(set)
    lock = threading.Lock()

    def call(key: str) -> None:
        result = task.apply_async((key, 0.1, tag), queue=queue)
        with lock:
            got[key].add(result.id)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(call, order))
    return got


@pytest.mark.timeout(60)
def test_a_burst_of_duplicates_publishes_one_message_per_key(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, tag: str
) -> None:
    queue = f"idle-{tag}"  # nobody consumes it: what is published stays there to be counted
    client = broker.client()
    try:
        got = _burst(enq.hold, queue, tag, calls=300, keys=30)
        assert client.llen(queue) == 30
        # Every call for a key got the one id published for it; is_queued/queued_task_id agree.
        assert all(len(ids) == 1 for ids in got.values()), got
        published = {json.loads(raw)["headers"]["id"] for raw in client.lrange(queue, 0, -1)}
        assert published == {next(iter(ids)) for ids in got.values()}
        key = f"{tag}-7"
        (first,) = got[key]
        assert enq.hold.is_queued(key, 0.1, tag)
        assert enq.hold.queued_task_id(key, 0.1, tag) == first
        # The other mode raises, naming its own queued message; another task of the same key is
        # no duplicate of it (see test_celery_enqueue_progress.py). The message carries the
        # marker it hands over.
        own = enq.hold_raise.apply_async((key, 0.1, tag), queue=queue)
        assert own.id != first and client.llen(queue) == 31
        with pytest.raises(AlreadyQueued) as raised:
            enq.hold_raise.apply_async((key, 0.1, tag), queue=queue)
        assert raised.value.task_id == own.id and own.id in str(raised.value)
        assert client.llen(queue) == 31
        message = json.loads(client.lindex(queue, 0))
        marker = message["headers"][MARKER_HEADER]
        assert marker["name"].startswith(f"enq:{tag}-") and '"queued":true' in marker["value"]
        assert not enq.hold.is_queued(f"{tag}-never", 0.1, tag)
    finally:
        client.delete(queue)


@pytest.mark.rabbitmq
@pytest.mark.timeout(90)
def test_a_burst_over_rabbitmq_publishes_one_message_per_key(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, tag: str
) -> None:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1.0).close()
    except OSError:
        if os.environ.get("CELERY_REDLOCK_REQUIRE_RABBITMQ") == "1":
            pytest.fail("RabbitMQ is required but nothing answers on 127.0.0.1:5672")
        pytest.skip("RabbitMQ not reachable on 127.0.0.1:5672")
    sender = enq.app.__class__("enqueue-amqp", broker=AMQP_URL, backend=broker.url, set_as_current=False)
    # Its subject is one message per key, not reply times: eight threads publishing over AMQP on
    # a loaded host read their masters' replies late enough to miss the 0.1 s default, and a
    # publish whose masters do not answer is refused (as documented), which is not a duplicate.
    sender.conf.update(redlock_masters=redlock_masters.urls, redlock_request_timeout=0.5)

    @sender.task(
        bind=True,
        base=RedlockTask,
        name="enqueue-amqp.hold",
        lock_key="enq:<key>",
        lock_enqueue="return_existing",
    )
    def hold(self: Any, key: str, seconds: float, record_to: str) -> None:
        raise AssertionError("never run: nobody consumes the queue")

    queue = f"idle-amqp-{tag}"
    try:
        got = _burst(hold, queue, tag, calls=200, keys=20)
        assert all(len(ids) == 1 for ids in got.values())
        with sender.connection_for_write() as conn:
            declared = conn.default_channel.queue_declare(queue, passive=True)
        assert declared.message_count == 20
    finally:
        with sender.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        sender.close()


# -- the key after the run: freed by its end, by a dead child, a time limit, a revoke ----------


@pytest.mark.timeout(60)
def test_a_duplicate_after_the_run_finished_is_accepted(enq: Any, live: list[CeleryWorker], tag: str) -> None:
    first = enq.hold.delay(tag, 0.3, tag)
    assert enq.hold.delay(tag, 0.3, tag).id == first.id  # queued or running: the same one
    first.get(timeout=30)
    # Published as soon as the result is known: the run's release is not waited for by hand.
    second = enq.hold.delay(tag, 0.05, tag)
    assert second.id != first.id
    second.get(timeout=30)
    assert [r["task_id"] for r in runs(enq, tag) if r["event"] == "interval"] == [first.id, second.id]


@pytest.mark.timeout(60)
def test_sigkill_of_the_pool_child_frees_the_key_within_its_ttl(
    enq: Any, live: list[CeleryWorker], tag: str
) -> None:
    result = enq.hold.delay(tag, 30.0, tag)  # lock_ttl 2 s
    start = wait_until(lambda: [r for r in runs(enq, tag) if r["event"] == "start"], 30, "the run to start")
    assert enq.hold.queued_task_id(tag, 30.0, tag) == result.id
    os.kill(start[0]["pid"], signal.SIGKILL)
    waited = freed_within(enq, enq.hold, (tag, 30.0, tag), timeout=2.0 + 2.0)
    print(f"SIGKILL: freed {waited:.3f} s after the kill")
    assert waited <= 2.0 + 2.0  # the run lock's TTL, not the marker's (30 s)
    again = enq.hold.delay(tag, 0.05, tag)
    assert again.id != result.id
    again.get(timeout=30)


@pytest.mark.timeout(60)
def test_the_hard_time_limit_frees_the_key(enq: Any, live: list[CeleryWorker], tag: str) -> None:
    result = enq.limited.delay(tag, 10.0, tag)  # time_limit 1 s, lock_ttl 20 s
    wait_until(lambda: [r for r in runs(enq, tag) if r["event"] == "start"], 30, "the run to start")
    with pytest.raises(Exception, match=r"TimeLimitExceeded|Time limit"):
        result.get(timeout=30)
    # Well before the lock's TTL (20 s) and the marker's (30 s).
    waited = freed_within(enq, enq.limited, (tag, 10.0, tag), timeout=10.0)
    print(f"hard time limit: freed {waited:.3f} s after the failure was stored")
    assert waited < 5.0
    enq.limited.delay(tag, 0.05, tag).get(timeout=30)


@pytest.mark.timeout(60)
def test_a_revoked_message_frees_its_marker(enq: Any, live: list[CeleryWorker], tag: str) -> None:
    result = enq.hold.apply_async((tag, 0.05, tag), countdown=3.0)
    assert enq.hold.is_queued(tag, 0.05, tag)
    enq.app.control.revoke(result.id)
    # Freed when a worker discards the message (at receipt, or when its ETA comes), not by the
    # marker's TTL (30 s + the countdown).
    waited = freed_within(enq, enq.hold, (tag, 0.05, tag), timeout=15.0)
    print(f"revoke: marker deleted {waited:.3f} s after the revoke")
    assert waited < 15.0
    again = enq.hold.delay(tag, 0.05, tag)
    assert again.id != result.id
    again.get(timeout=30)
    assert [r["task_id"] for r in runs(enq, tag) if r["event"] == "interval"] == [again.id]


# -- countdown, ETA, retries, canvas, eager, send_task ---------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["countdown", "eta"])
def test_a_delay_longer_than_the_marker_ttl_keeps_the_key(
    enq: Any, live: list[CeleryWorker], tag: str, how: str
) -> None:
    due = 3.0  # short_marker's lock_enqueue_ttl is 1 s
    if how == "countdown":
        result = enq.short_marker.apply_async((tag, 0.05, tag), countdown=due)
    else:
        eta = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=due)
        result = enq.short_marker.apply_async((tag, 0.05, tag), eta=eta)
    published = time.monotonic()
    wait_until(lambda: time.monotonic() - published > 2.0, 5, "past the marker's own TTL")
    with pytest.raises(AlreadyQueued) as raised:
        enq.short_marker.delay(tag, 0.05, tag)
    assert raised.value.task_id == result.id
    result.get(timeout=30)
    assert time.monotonic() - published >= due - 0.5
    assert [r["task_id"] for r in runs(enq, tag) if r["event"] == "interval"] == [result.id]


@pytest.mark.timeout(60)
def test_a_retry_keeps_the_key_for_the_retried_message(enq: Any, live: list[CeleryWorker], tag: str) -> None:
    result = enq.retry_once.delay(tag, tag)  # runs, retries itself 0.3 s later, runs again
    refused = 0
    while not result.ready():
        try:
            enq.retry_once.delay(tag, tag)
        except AlreadyQueued as exc:
            assert exc.task_id == result.id
            refused += 1
        else:
            # The key is freed before the result can be seen: a publish that succeeds once the
            # retried run has begun may have come after its end, and is no duplicate.
            if not result.ready() and not any(r["retries"] == 1 for r in runs(enq, tag)):
                raise AssertionError(
                    "a duplicate was published while the task was queued, running or retrying"
                )
            break
        time.sleep(0.01)
    assert result.get(timeout=30) == 1 and refused > 5
    assert [r["retries"] for r in runs(enq, tag) if r["task_id"] == result.id] == [0, 1]


@pytest.mark.timeout(60)
def test_chains_and_groups_of_one_key_complete(enq: Any, live: list[CeleryWorker], tag: str) -> None:
    # Both members lock one key: the second is published while the first holds it (a chain's
    # next task), or beside it (a group): canvas members are never replaced by another result.
    assert chain(enq.step.s(1, tag, tag), enq.step.s(tag, tag)).apply_async().get(timeout=30) == 3
    assert group(enq.step.s(1, tag, tag), enq.step.s(5, tag, tag)).apply_async().get(timeout=30) == [2, 6]
    assert len([r for r in runs(enq, tag) if r["event"] == "step"]) == 4


@pytest.mark.timeout(60)
def test_eager_calls_take_no_marker_and_publish_nothing(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, tag: str
) -> None:
    queue = f"idle-{tag}"
    enq.app.conf.task_always_eager = True
    try:
        assert enq.hold.apply_async((tag, 0.0, tag), queue=queue).get() == tag
        assert enq.hold.apply_async((tag, 0.0, tag), queue=queue).get() == tag  # not deduplicated
    finally:
        enq.app.conf.task_always_eager = False
    assert broker.client().llen(queue) == 0
    assert not enq.hold.is_queued(tag, 0.0, tag)
    assert len([r for r in runs(enq, tag) if r["event"] == "interval"]) == 2


@pytest.mark.timeout(60)
def test_send_task_by_name_is_not_deduplicated_but_a_signature_by_name_is(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, tag: str
) -> None:
    queue = f"idle-{tag}"
    client = broker.client()
    try:
        first = enq.app.signature("enqueueapp.hold", args=(tag, 0.0, tag)).apply_async(queue=queue)
        again = enq.app.signature("enqueueapp.hold", args=(tag, 0.0, tag)).apply_async(queue=queue)
        assert again.id == first.id and client.llen(queue) == 1
        # send_task does not go through the task class: published, with no marker.
        enq.app.send_task("enqueueapp.hold", (tag, 0.0, tag), queue=queue)
        assert client.llen(queue) == 2
        assert MARKER_HEADER not in json.loads(client.lindex(queue, 0))["headers"]
    finally:
        client.delete(queue)


# -- the handover under stress: the invariant, checked on every message ----------------------


@pytest.mark.timeout(120)
def test_handover_stress_never_two_messages_or_runs_of_one_key(
    enq: Any, live: list[CeleryWorker], tag: str
) -> None:
    """Publishers hammer 4 keys with duplicates while runs start and end.

    Invariant: a message owns its key from before its publish returned until its run ended. So,
    per key, the windows ``[min(publish returned, run start), run end]`` of the published
    messages are disjoint (each lies inside the message's ownership), which rules out two runs
    at once and a message published while another was queued or running. Also: every
    published message runs exactly once, and every deduplicated call was handed a published id.
    """
    seed = random.randrange(1 << 30)
    keys = [f"{tag}-{i}" for i in range(4)]
    published: dict[str, tuple[str, float]] = {}  # task id -> (key, when its publish returned)
    handed: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 8.0

    def publisher(n: int) -> None:
        local = random.Random(seed + n)
        while time.monotonic() < stop_at:
            key = local.choice(keys)
            mine = str(uuid.uuid4())
            result = enq.hold.apply_async((key, local.uniform(0.02, 0.15), tag), task_id=mine)
            returned = enq.now()
            with lock:
                if result.id == mine:
                    published[mine] = (key, returned)
                else:
                    handed.append(result.id)
            time.sleep(local.uniform(0, 0.03))

    threads = [threading.Thread(target=publisher, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    def all_ran() -> bool:
        done = {r["task_id"] for r in runs(enq, tag) if r["event"] == "interval"}
        return set(published) <= done

    wait_until(all_ran, 60, f"every published message to run (seed {seed})")
    intervals = [r for r in runs(enq, tag) if r["event"] == "interval"]
    ran: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in intervals:
        ran[record["task_id"]].append(record)
    assert set(ran) == set(published), f"seed {seed}: runs of unpublished ids"
    assert all(len(r) == 1 for r in ran.values()), f"seed {seed}: a message ran twice"
    assert set(handed) <= set(published), f"seed {seed}: a call was handed an id never published"
    windows: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for task_id, (key, returned) in published.items():
        run = ran[task_id][0]
        assert run["owned"], f"seed {seed}: {task_id} ran without its lock"
        windows[key].append((min(returned, run["start"]), run["end"], task_id))
    for key, spans in windows.items():
        spans.sort()
        for (_, end, earlier), (begin, _, later) in itertools.pairwise(spans):
            assert begin >= end, f"seed {seed}: {earlier} and {later} both owned {key} at {begin:.3f}"
    print(
        f"stress (seed {seed}): {len(published)} published, {len(handed)} deduplicated, "
        f"runs per key {sorted(len(v) for v in windows.values())}"
    )
    assert len(handed) > 20 and all(len(spans) >= 3 for spans in windows.values()), (
        f"seed {seed}: too little contention to mean anything ({len(handed)} deduplicated, "
        f"{ {k: len(v) for k, v in windows.items()} } runs per key)"
    )


# -- options and settings ---------------------------------------------------------------------


def test_enqueue_options_and_settings_are_checked() -> None:
    from celery import Celery

    app = Celery(f"enqueue-options-{uuid.uuid4().hex[:6]}", set_as_current=False)
    cases = {
        "lock_enqueue must be one of 'return_existing', 'raise'": {"lock_enqueue": "once"},
        "lock_enqueue_ttl must be > 0 seconds": {"lock_enqueue": "raise", "lock_enqueue_ttl": 0},
        "cannot be combined with lock_reentrant": {"lock_enqueue": "raise", "lock_reentrant": True},
        "cannot be combined with lock_slot": {"lock_enqueue": "raise", "lock_slot": 60},
        "cannot be combined with lock_fenced": {"lock_enqueue": "raise", "lock_fenced": True},
    }
    for n, (message, options) in enumerate(cases.items()):
        with pytest.raises(ConfigError, match=message):
            # Not shared: a shared task's constructor is kept for every later app (and would
            # fail their check_app with this test's bad options).
            @app.task(base=RedlockTask, name=f"t{n}", lock_key="k:<i>", lazy=False, shared=False, **options)
            def task(i: int) -> None: ...

    base = {"redlock_masters": ["redis://127.0.0.1:1/0"]}
    assert read_settings(base).enqueue is None and read_settings(base).enqueue_ttl == 3600.0
    assert read_settings({**base, "redlock_enqueue": "raise"}).enqueue == "raise"
    with pytest.raises(ConfigError, match="redlock_enqueue must be one of"):
        read_settings({**base, "redlock_enqueue": "yes"})
    with pytest.raises(ConfigError, match="redlock_enqueue_ttl must be a finite number"):
        read_settings({**base, "redlock_enqueue_ttl": float("nan")})
