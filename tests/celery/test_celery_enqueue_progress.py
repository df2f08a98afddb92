"""``lock_enqueue`` must never lose or misroute work: real workers, a real broker, real masters.

1. A marker belongs to the task that placed it: a publish of another task of the same lock key
   is published (and waits for the lock at run time), never handed the queued task's result;
   each task is still deduplicated against itself.
2. A marker lives only as long as its message can still arrive: a publisher killed between
   placing it and the broker's publish leaves the key refused for seconds, not ``lock_enqueue_ttl``.
3. The operators' tools show a queued marker as queued, with its task id, and do not release it
   without ``--force`` (its message is waiting in the broker: its publisher's pid says nothing).
4. A marker is told from a run by its holder record's type, not by the words in it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.signals import after_task_publish
from conftest import HERE, ROOT, RUN, app_env, pttls, wait_until

from celery_redlock import LockNotAcquired, is_skipped
from celery_redlock.celery.enqueue import MARKER_HEADER, PUBLISH_WINDOW
from celery_redlock.celery.settings import app_settings_and_redlock
from celery_redlock.lock import admin
from celery_redlock.lock.holder import parse
from celery_redlock.lock.markers import side_key
from celery_redlock.lock.resource import HOLDER_SEPARATOR, lock_key
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet
from tests.appservers import still_queued

QUEUE = f"q-enqueue-progress-{RUN}"
MARKER_TTL = 30.0  # enqueueapp's redlock_enqueue_ttl


@pytest.fixture(scope="module")
def enq(broker: RedisServer, _redlock_server_set: ServerSet) -> Any:
    """The test process's side of ``enqueueapp``, configured like its worker."""
    os.environ.update(app_env(broker.url, broker.url, _redlock_server_set.urls, QUEUE))
    import enqueueapp as module

    module.BACKEND = broker.url
    module.app.conf.update(
        broker_url=broker.url,
        result_backend=broker.url,
        redlock_masters=_redlock_server_set.urls,
        task_default_queue=QUEUE,
    )
    module.app.finalize(auto=True)
    return module


@pytest.fixture(scope="module")
def worker(enq: Any, broker: RedisServer, _redlock_server_set: ServerSet) -> Iterator[CeleryWorker]:
    started = CeleryWorker(
        "enqueueapp",
        pool="prefork",
        concurrency=2,
        queues=[QUEUE],
        env=app_env(broker.url, broker.url, _redlock_server_set.urls, QUEUE),
        pythonpath=[str(HERE), str(ROOT)],
    )
    try:
        started.start()
        yield started
    finally:
        started.stop()


@pytest.fixture
def live(worker: CeleryWorker, redlock_masters: ServerSet) -> CeleryWorker:
    assert worker.running, f"{worker!r} died; log tail:\n{worker.log_tail()}"
    return worker


@pytest.fixture
def idle(broker: RedisServer, tag: str) -> Iterator[str]:
    """A queue nobody consumes: what is published stays there to be counted."""
    queue = f"idle-{tag}"
    yield queue
    broker.client().delete(queue)


def on_masters(masters: ServerSet, key: str) -> str:
    """What each master holds on the keys of resource ``key`` (the lock key, the side keys)."""
    lines = []
    for server in masters:
        client = server.client()
        try:
            held = {name.decode(): (client.get(name), client.pttl(name)) for name in client.keys(f"*{key}*")}
        finally:
            client.close()
        lines.append(f"{server.url}: {held}")
    return "\n".join(lines)


def runs(enq: Any, name: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in enq.store().lrange(name, 0, -1)]


def published_ids(broker: RedisServer, queue: str) -> list[str]:
    """The ids of the messages in ``queue``, oldest first (kombu LPUSHes, consumers pop the tail)."""
    return [json.loads(raw)["headers"]["id"] for raw in reversed(broker.client().lrange(queue, 0, -1))]


def _env(broker: RedisServer, masters: ServerSet, queue: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(app_env(broker.url, broker.url, masters.urls, queue))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def publisher(broker: RedisServer, masters: ServerSet, queue: str, key: str, tag: str, **extra: str) -> Any:
    """A process of its own that publishes ``enqueueapp.hold(key)`` to ``queue``, prints the id."""
    code = (
        "import sys, enqueueapp\n"
        f"result = enqueueapp.hold.apply_async(({key!r}, 0.0, {tag!r}), queue={queue!r})\n"
        "print(result.id, flush=True)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=_env(broker, masters, queue, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def cli(broker: RedisServer, masters: ServerSet, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A enqueueapp redlock <args>``, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "enqueueapp", "redlock", *args],
        env=_env(broker, masters, "unused"),
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- 1. a marker belongs to the task that placed it ---------------------------------------------


@pytest.mark.timeout(60)
def test_a_publish_of_another_task_of_the_key_is_published_not_handed_the_queued_one(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, idle: str, tag: str
) -> None:
    args = (tag, 0.0, tag)
    first = enq.hold.apply_async(args, queue=idle)
    second = enq.other.apply_async(args, queue=idle)
    assert second.id != first.id, "other.delay() was handed hold's AsyncResult: its body would never run"
    # Each task is still deduplicated against its own queued message, whichever key it waits on.
    assert enq.other.apply_async(args, queue=idle).id == second.id
    assert enq.hold.apply_async(args, queue=idle).id == first.id
    assert published_ids(broker, idle) == [first.id, second.id]
    assert enq.hold.queued_task_id(*args) == first.id
    assert enq.other.queued_task_id(*args) == second.id
    # hold's marker is on the lock key (the run takes it over); other's waits beside it, on a key
    # of its own task, with the lock key's own marker untouched.
    _, redlock = app_settings_and_redlock(enq.app)
    record = parse(redlock.holder(f"enq:{tag}") or "")
    assert record is not None and record.queued and record.task == first.id
    beside = redlock.read_everywhere(side_key(redlock.key_prefix, f"enq:{tag}", "enqueueapp.other"))
    records = [parse(v.decode().partition(HOLDER_SEPARATOR)[2]) for v in beside if v is not None]
    assert len(records) == len(redlock_masters)
    assert all(r is not None and r.queued and r.task == second.id for r in records)


@pytest.mark.timeout(60)
def test_two_tasks_of_one_key_both_run_one_after_the_other(enq: Any, live: CeleryWorker, tag: str) -> None:
    """The demanding user's case: B published while A's marker is queued runs, after A."""
    first = enq.hold.apply_async((tag, 0.5, tag), countdown=1.0)  # A: queued for a second
    second = enq.other.delay(tag, 0.2, tag)  # B: runs at once, finds A's marker, retries
    assert second.id != first.id
    assert enq.other.delay(tag, 0.2, tag).id == second.id  # B queued (or retrying): deduplicated
    assert first.get(timeout=30) == tag
    assert second.get(timeout=30) == tag
    intervals = sorted((r for r in runs(enq, tag) if r["event"] == "interval"), key=lambda r: r["start"])
    assert [r["task_id"] for r in intervals] == [first.id, second.id]
    assert intervals[0]["end"] <= intervals[1]["start"], "two runs of one lock key overlapped"
    assert all(r["owned"] for r in intervals)
    wait_until(
        lambda: not still_queued(enq.hold, tag, 0.0, tag) and not still_queued(enq.other, tag, 0.0, tag),
        5,
        "both tasks' keys to be freed",
    )


@pytest.mark.timeout(60)
def test_a_run_that_gives_up_deletes_its_marker_beside_the_key(
    enq: Any, live: CeleryWorker, tag: str
) -> None:
    """A task's marker set beside another task's run is deleted when its own run is skipped
    (``lock_contended="skip"``): its next publish is not refused, naming a finished task."""
    first = enq.hold.delay(tag, 3.0, tag)
    wait_until(lambda: [r for r in runs(enq, tag) if r["event"] == "start"], 30, "hold's run to start")
    second = enq.skipper.delay(tag, 0.0, tag)  # beside hold's run; its run finds the key held
    assert second.id != first.id
    assert is_skipped(second.get(timeout=30))
    wait_until(lambda: not still_queued(enq.skipper, tag, 0.0, tag), 5, "the skipped run's marker to go")
    third = enq.skipper.delay(tag, 0.0, tag)  # "raise": AlreadyQueued(second) if it were left
    assert third.id not in (first.id, second.id)
    assert first.get(timeout=30) == tag
    third.get(timeout=30)


@pytest.mark.timeout(120)
def test_two_tasks_hammering_shared_keys_lose_nothing_and_never_overlap(
    enq: Any, live: CeleryWorker, redlock_masters: ServerSet, tag: str
) -> None:
    """Publishers call ``hold`` and ``other`` on 2 shared keys at random while runs start and end.

    Per (task, key), the windows ``[min(publish returned, run start), run end]`` of the published
    messages are disjoint (one message of a task per key from its publish to its run's end); per
    key, runs of both tasks never overlap; every published message runs exactly once; every
    deduplicated call was handed an id its own task published."""
    seed = random.randrange(1 << 30)
    keys = [f"{tag}-{i}" for i in range(2)]
    tasks = {"enqueueapp.hold": enq.hold, "enqueueapp.other": enq.other}
    published: dict[str, tuple[str, str, float]] = {}  # task id -> (task, key, publish returned)
    handed: list[tuple[str, str]] = []  # (task, id handed)
    refusals: list[str] = []
    mutex = threading.Lock()
    stop_at = time.monotonic() + 6.0

    def publisher(n: int) -> None:
        local = random.Random(seed + n)
        while time.monotonic() < stop_at:
            name, key, mine = local.choice(sorted(tasks)), local.choice(keys), str(uuid.uuid4())
            try:
                result = tasks[name].apply_async((key, local.uniform(0.02, 0.1), tag), task_id=mine)
            except LockNotAcquired as refused:
                # A burst of publishers is never refused for its own contention (nothing holds
                # the key but their markers and runs): that would be a lost publish.
                with mutex:
                    refusals.append(f"{name} on {key}: {refused}\n{on_masters(redlock_masters, key)}")
                continue
            returned = enq.now()
            with mutex:
                if result.id == mine:
                    published[mine] = (name, key, returned)
                else:
                    handed.append((name, result.id))
            time.sleep(local.uniform(0, 0.03))

    threads = [threading.Thread(target=publisher, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not refusals, f"seed {seed}: {len(refusals)} publishes refused, first: {refusals[0]}"
    wait_until(
        lambda: set(published) <= {r["task_id"] for r in runs(enq, tag) if r["event"] == "interval"},
        90,
        f"every published message to run (seed {seed})",
    )
    ran: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in runs(enq, tag):
        if record["event"] == "interval":
            ran[record["task_id"]].append(record)
    assert set(ran) == set(published), f"seed {seed}: runs of unpublished ids"
    assert all(len(r) == 1 for r in ran.values()), f"seed {seed}: a message ran twice"
    assert all(published.get(task_id, ("",))[0] == name for name, task_id in handed), (
        f"seed {seed}: a call was handed an id of another task, or never published"
    )
    owned: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    per_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for task_id, (name, key, returned) in published.items():
        run = ran[task_id][0]
        assert run["owned"], f"seed {seed}: {task_id} ran without its lock"
        owned[(name, key)].append((min(returned, run["start"]), run["end"]))
        per_key[key].append((run["start"], run["end"]))
    for spans in (*owned.values(), *per_key.values()):
        spans.sort()
        for (_, end), (begin, _) in itertools.pairwise(spans):
            assert begin >= end, f"seed {seed}: overlapping windows {spans}"
    print(f"two tasks (seed {seed}): {len(published)} published, {len(handed)} deduplicated")
    assert len(handed) > 10 and len({name for name, _, _ in published.values()}) == 2


# -- 2. a marker lives only as long as its message can still arrive -----------------------------


@pytest.mark.timeout(90)
def test_a_publisher_killed_before_the_broker_publish_leaves_the_key_refused_for_seconds(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, idle: str, tag: str, tmp_path: Path
) -> None:
    args = (tag, 0.0, tag)
    proc = publisher(broker, redlock_masters, idle, tag, tag, ENQUEUEAPP_BLOCK_PUBLISH=str(tmp_path))
    try:
        ready = tmp_path / "ready"
        wait_until(lambda: ready.exists() or proc.poll() is not None, 30, "the publisher to take its marker")
        assert proc.poll() is None, proc.communicate()
        assert int(ready.read_text()) == proc.pid
        # Between the marker and the broker: the key is refused, nothing is in the queue yet.
        assert enq.hold.is_queued(*args)
        assert broker.client().llen(idle) == 0
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    wait_until(
        lambda: not still_queued(enq.hold, *args), PUBLISH_WINDOW + 5.0, "the dead publisher's marker to go"
    )
    waited = time.monotonic() - killed
    print(f"publisher SIGKILLed before the broker publish: key free {waited:.2f} s later")
    assert waited < MARKER_TTL / 2
    again = enq.hold.apply_async(args, queue=idle)
    assert published_ids(broker, idle) == [again.id]


@pytest.mark.timeout(90)
def test_a_publish_slower_than_the_window_is_published_unmarked_and_says_so(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, idle: str, tag: str, tmp_path: Path
) -> None:
    args = (tag, 0.0, tag)
    proc = publisher(broker, redlock_masters, idle, tag, tag, ENQUEUEAPP_BLOCK_PUBLISH=str(tmp_path))
    try:
        wait_until(lambda: (tmp_path / "ready").exists() or proc.poll() is not None, 30, "the marker")
        assert proc.poll() is None, proc.communicate()
        wait_until(lambda: not still_queued(enq.hold, *args), PUBLISH_WINDOW + 5.0, "the marker to expire")
        (tmp_path / "go").write_text("")  # the publish goes on, past its marker's window
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "was gone when its publish returned" in err, err
    assert published_ids(broker, idle) == [out.strip()]  # published all the same: no work lost


@pytest.mark.timeout(60)
def test_once_the_broker_has_the_message_its_marker_lasts_lock_enqueue_ttl(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, idle: str, tag: str
) -> None:
    args = (tag, 0.0, tag)
    enq.hold.apply_async(args, queue=idle)
    enq.other.apply_async(args, queue=idle)  # beside hold's, on other's own key
    prefix = app_settings_and_redlock(enq.app)[1].key_prefix
    on_lock = pttls(redlock_masters, lock_key(prefix, f"enq:{tag}"))
    beside = pttls(redlock_masters, side_key(prefix, f"enq:{tag}", "enqueueapp.other"))
    for left in (*on_lock, *beside):
        assert MARKER_TTL * 1000 - 5000 < left <= MARKER_TTL * 1000, (on_lock, beside)


@pytest.mark.timeout(60)
def test_a_run_that_takes_its_marker_over_before_the_publish_returns_is_no_warning(
    enq: Any, live: CeleryWorker, tag: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A fast worker: the run starts (taking the marker over) before the publisher's keep round.
    Nothing was lost and nothing is queued unmarked: no WARNING (it used to warn of a slow
    publish on every such run)."""
    started = threading.Event()
    mine = str(uuid.uuid4())

    def wait_for_the_run(headers: Any = None, **_: Any) -> None:
        if (headers or {}).get("id") == mine:
            started.set()
            wait_until(lambda: any(r["event"] == "start" for r in runs(enq, tag)), 20, "the run to start")

    after_task_publish.connect(wait_for_the_run, weak=False)
    try:
        with caplog.at_level(logging.DEBUG, logger="celery_redlock.enqueue"):
            result = enq.hold.apply_async((tag, 0.0, tag), task_id=mine)
    finally:
        after_task_publish.disconnect(wait_for_the_run)
    assert started.is_set(), "the publish hook never ran"
    assert result.get(timeout=30) == tag
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("taken over before its publish returned" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
def test_a_marker_dropped_before_the_publish_returns_is_no_warning_but_one_lost_to_dead_masters_is(
    enq: Any, redlock_masters: ServerSet, idle: str, tag: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that discards the message drops its marker, perhaps before the publisher's keep
    round: no WARNING. Masters that stop answering while the message is published lose the
    marker's keep: a WARNING naming them."""
    prefix = app_settings_and_redlock(enq.app)[1].key_prefix

    def drop_it(headers: Any = None, **_: Any) -> None:
        marker = (headers or {}).get(MARKER_HEADER)
        if marker:
            for server in redlock_masters:
                server.client().delete(lock_key(prefix, marker["name"]))

    after_task_publish.connect(drop_it, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_redlock.enqueue"):
            enq.hold.apply_async((tag, 0.0, tag), queue=idle)
    finally:
        after_task_publish.disconnect(drop_it)
    assert [r.getMessage() for r in caplog.records] == []

    paused = list(redlock_masters)[:3]  # a majority: the keep round cannot reach a quorum
    again = f"{tag}-again"

    def pause_them(headers: Any = None, **_: Any) -> None:
        if (headers or {}).get(MARKER_HEADER):
            for server in paused:
                server.pause()

    after_task_publish.connect(pause_them, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_redlock.enqueue"):
            enq.hold.apply_async((again, 0.0, again), queue=idle)
    finally:
        after_task_publish.disconnect(pause_them)
        for server in paused:
            server.resume()
    warned = [
        r.getMessage() for r in caplog.records if "was gone when its publish returned" in r.getMessage()
    ]
    assert len(warned) == 1, caplog.records
    assert all(server.address in warned[0] for server in paused), warned[0]


# -- 3. the operators' tools: queued is not dead -------------------------------------------------


@pytest.mark.timeout(120)
def test_release_refuses_a_queued_marker_whose_publisher_is_gone(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, idle: str, tag: str
) -> None:
    args = (tag, 0.0, tag)
    proc = publisher(broker, redlock_masters, idle, tag, tag)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    task_id = out.strip()
    assert published_ids(broker, idle) == [task_id]  # waiting in the queue; its publisher is gone
    name = f"enq:{tag}"
    _, redlock = app_settings_and_redlock(enq.app)

    view = admin.show(redlock, name)
    assert view.held and view.holder is not None and view.holder.queued and view.holder.task == task_id
    alive = admin.liveness(redlock, view, watch=1.0)
    assert alive.state == "queued" and not alive.releasable and task_id in alive.reason
    with pytest.raises(admin.ReleaseRefused, match="queued"):
        admin.release(redlock, name, watch=1.0)

    listed = cli(broker, redlock_masters, "ls", f"enq:{tag}*")
    assert listed.returncode == 0, listed.stderr
    (line,) = [row for row in listed.stdout.splitlines() if row.startswith(name)]
    assert "queued" in line and task_id in line, listed.stdout
    shown = cli(broker, redlock_masters, "show", name)
    assert "queued" in shown.stdout and task_id in shown.stdout, shown.stdout
    refused = cli(broker, redlock_masters, "release", name, "--yes", "--watch", "1")
    assert refused.returncode != 0, refused.stdout
    assert "queued" in refused.stdout + refused.stderr and task_id in refused.stdout + refused.stderr
    assert enq.hold.queued_task_id(*args) == task_id, "released without --force"

    forced = cli(broker, redlock_masters, "release", name, "--yes", "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert not enq.hold.is_queued(*args)


@pytest.mark.timeout(60)
def test_a_marker_waiting_beside_another_holder_is_listed_as_queued(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, idle: str, tag: str
) -> None:
    first = enq.hold.apply_async((tag, 0.0, tag), queue=idle)
    second = enq.other.apply_async((tag, 0.0, tag), queue=idle)
    listed = cli(broker, redlock_masters, "ls", f"enq:{tag}*")
    assert listed.returncode == 0, listed.stderr
    rows = [row for row in listed.stdout.splitlines() if row.startswith(f"enq:{tag}")]
    assert len(rows) == 2, listed.stdout
    assert any("queued" in row and first.id in row for row in rows), listed.stdout
    assert any("queued" in row and second.id in row and "enqueueapp.other" in row for row in rows)


# -- 4. a marker is told from a run by the record's type ------------------------------------------


@pytest.mark.timeout(60)
def test_a_task_named_queued_does_not_leave_a_revoked_copys_marker(
    enq: Any, live: CeleryWorker, tag: str
) -> None:
    """A run whose task name contains "queued" re-publishes itself; the copy is revoked and
    discarded while the run still holds the key, and the run then hands its key to the copy's
    marker. The revoke hook must see that a *run* holds the key (and drop the marker once it is
    handed back): read by type, a name with "queued" in it is a run's, not a marker's."""
    args = (tag, 1.0, tag)
    result = enq.queued_retry.delay(*args)
    wait_until(lambda: runs(enq, tag), 30, "the run to start")
    enq.app.control.revoke(result.id)  # no terminate: the run goes on, then re-publishes itself
    wait_until(lambda: result.state == "REVOKED", 30, "the copy to be discarded")
    wait_until(lambda: len(runs(enq, tag)) == 2, 30, "the run to end")
    ended = time.monotonic()
    deadline = ended + 5.0  # the run lock's TTL (enqueueapp's redlock_ttl); the marker's is 30 s
    while still_queued(enq.queued_retry, *args) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r["event"] for r in runs(enq, tag)] == ["start", "end"], "the revoked copy ran"
    assert not enq.queued_retry.is_queued(*args), (
        f"enq:{tag} still refused by {enq.queued_retry.queued_task_id(*args)} 5 s after the run "
        "ended: the revoked copy's marker, handed back by a run the revoke hook took for a marker"
    )


def test_the_marker_header_names_the_lock_key(
    enq: Any, broker: RedisServer, redlock_masters: ServerSet, idle: str, tag: str
) -> None:
    enq.other.apply_async((tag, 0.0, tag), queue=idle)
    header = json.loads(broker.client().lindex(idle, 0))["headers"][MARKER_HEADER]
    assert header["name"] == f"enq:{tag}"
    record = parse(header["value"].partition(HOLDER_SEPARATOR)[2])
    assert record is not None and record.queued and record.name == "enqueueapp.other"
