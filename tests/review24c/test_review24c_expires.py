"""A ``lock_enqueue`` marker lasts no longer than its message can arrive: never past the
message's ``expires``, whichever way the expiry is given (a number, an ISO text, a datetime, the
task's own ``expires`` option, with a countdown), and whatever the publish waited for before it
placed its marker. Real broker, three real masters; the messages go to queues nobody consumes
unless a test starts a worker for them."""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
from typing import Any

import pytest
from celery import states

from celery_redlock.celery.settings import app_settings_and_redlock
from celery_redlock.lock import markers
from celery_redlock.lock.holder import HolderRecord
from celery_redlock.lock.resource import lock_key
from celery_redlock.testing import CeleryWorker
from tests.onmasters import pttls

from ..appservers import app_env
from .conftest import ROOT, Servers, wait_for


def _name(tag: str) -> str:
    return f"r24:{tag}"


def _expires(form: str, seconds: float) -> Any:
    at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)
    return {"number": seconds, "iso": at.isoformat(), "datetime": at}[form]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("countdown", [None, 2.0])
@pytest.mark.parametrize("form", ["number", "iso", "datetime"])
def test_the_marker_never_outlives_the_calls_expires(
    r24: Any, r24_servers: Servers, tag: str, form: str, countdown: float | None
) -> None:
    """``expires`` of 1 s, as a number (seconds from the publish, as Celery reads it: not from
    the countdown), an ISO text (what a retry's request carries) or a datetime; with or without
    a countdown past it. The marker lasts at most that second; a publish after it is published."""
    queue = f"r24-nobody-{tag}"
    redlock = app_settings_and_redlock(r24.app)[1]
    options: dict[str, Any] = {"queue": queue, "expires": _expires(form, 1.0)}
    if countdown is not None:
        options["countdown"] = countdown
    first = r24.marked.apply_async((tag,), **options)
    ttls = pttls(r24_servers[1], lock_key(redlock.key_prefix, _name(tag)))
    assert max(ttls) <= 1050, f"the marker of a message that expires in 1 s lasts {ttls} ms"
    time.sleep(1.3)
    second = r24.marked.apply_async((tag,), queue=queue)
    assert second.id != first.id, "a publish was deduplicated against a message that has expired"


@pytest.mark.timeout(90)
def test_the_tasks_own_expires_caps_its_marker(r24: Any, r24_servers: Servers, tag: str) -> None:
    """``@app.task(expires=1.0)``: every message of the task expires a second after its publish.
    A publish made after that must be published, and run."""
    queue = f"r24-late-{tag}"
    redlock = app_settings_and_redlock(r24.app)[1]
    first = r24.expiring.apply_async((tag,), queue=queue)
    ttls = pttls(r24_servers[1], lock_key(redlock.key_prefix, _name(tag)))
    time.sleep(1.5)  # the first message has expired: a worker discards it
    second = r24.expiring.apply_async((tag,), queue=queue, expires=30.0)
    worker = CeleryWorker(
        "tests.review24c.app",
        pool="solo",
        concurrency=None,
        queues=[queue],
        env=app_env("R24", *r24_servers),
        pythonpath=[str(ROOT)],
        cwd=str(ROOT),
    )
    try:
        worker.start()
        ran = wait_for(lambda: any(e["event"] == "end" for e in r24.events(tag)), 15.0)
        wait_for(lambda: first.state == states.REVOKED, 10.0)
    finally:
        worker.cleanup()
    assert ran and second.id != first.id, (
        f"the message {first.id} expired (state {first.state}), its marker lasted {ttls} ms; the "
        f"later call was handed its id ({second.id == first.id}) and nothing ran: {r24.events(tag)}"
    )


def _pending_marker(task_name: str, task_id: str, ttl: float) -> str:
    """The value of a marker a publisher placed and has not published yet (its publish is under
    way, or it died): what the library writes, ``published: false``."""
    record = HolderRecord(
        name=task_name, host=socket.gethostname(), pid=1, ttl=ttl, queued=True, published=False
    )
    return markers.new_value(record.to_text(task=task_id, since=time.time(), publish="ghost"))


@pytest.mark.timeout(60)
def test_a_publish_that_waited_for_an_unpublished_marker_still_caps_its_marker_at_expires(
    r24: Any, r24_servers: Servers, tag: str
) -> None:
    """Another publisher's marker, not yet published (it dies, its marker lasts its 2 s window):
    a call with ``expires`` at an absolute time 3 s away waits it out and places its own. From
    those 3 s on, its message can never run; a later call must not be handed its id."""
    queue = f"r24-nobody-{tag}"
    redlock = app_settings_and_redlock(r24.app)[1]
    name = _name(tag)
    ghost = _pending_marker("r24.marked", f"ghost-{tag}", 2.0)
    side = markers.side_key(redlock.key_prefix, name, "r24.marked")
    assert markers.place(redlock, name, side, ghost, 2.0).value == ghost
    expires_at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=3.0)
    first = r24.marked.apply_async((tag,), queue=queue, expires=expires_at)
    assert first.id != f"ghost-{tag}"
    left = (expires_at - dt.datetime.now(dt.timezone.utc)).total_seconds()
    ttls = pttls(r24_servers[1], lock_key(redlock.key_prefix, name))
    time.sleep(max(0.0, left) + 0.4)  # its message has expired
    second = r24.marked.apply_async((tag,), queue=queue)
    assert second.id != first.id, (
        f"the message expired {left:.2f} s after its publish, its marker then had {ttls} ms left: "
        f"a later call was handed the expired message's id"
    )


@pytest.mark.timeout(30)
def test_a_marker_written_without_the_published_flag_answers_a_duplicate_at_once(r24: Any, tag: str) -> None:
    """A marker placed by a version without ``published`` (a rolling upgrade) is taken as
    published: a duplicate publish is answered with its id at once, not after a publish window."""
    redlock = app_settings_and_redlock(r24.app)[1]
    name = _name(tag)
    old = f"old-{tag}"
    text = (
        f'{{"task":"{old}","since":{time.time():.3f},"name":"r24.marked","host":"h","pid":1,'
        f'"ttl":60,"queued":true}}'
    )
    value = markers.new_value(text)
    side = markers.side_key(redlock.key_prefix, name, "r24.marked")
    assert markers.place(redlock, name, side, value, 60.0).value == value
    try:
        started = time.monotonic()
        dup = r24.marked.apply_async((tag,), queue=f"r24-nobody-{tag}")
        took = time.monotonic() - started
    finally:
        markers.drop(redlock, name, value, side)
    assert dup.id == old
    assert took < 1.0, f"a duplicate of a marker written by an older version waited {took:.2f} s"


@pytest.mark.timeout(60)
def test_a_call_that_outwaits_its_window_is_not_handed_an_unpublished_marker(
    r24: Any, r24_servers: Servers, tag: str
) -> None:
    """Publisher A placed its marker and died (it lasts its window). A call waits it out. As A's
    marker goes, publisher B's takes the key first, and B's publish is slow (a broker in
    trouble): when the call's window ends, the key holds B's marker, still unpublished. B's
    publish then fails (its marker deleted). The call must not have been handed B's id."""
    redlock = app_settings_and_redlock(r24.app)[1]
    name = _name(tag)
    key = lock_key(redlock.key_prefix, name)
    side = markers.side_key(redlock.key_prefix, name, "r24.marked")
    first = _pending_marker("r24.marked", f"a-{tag}", 1.5)
    assert markers.place(redlock, name, side, first, 1.5).value == first
    found: dict[str, Any] = {}

    def call() -> None:
        try:
            found["id"] = r24.marked.apply_async((tag,), queue=f"r24-nobody-{tag}").id
        except Exception as exc:  # refused outright: the caller knows, nothing is lost
            found["error"] = exc

    caller = threading.Thread(target=call, name="r24-waiting-caller", daemon=True)
    caller.start()
    time.sleep(1.0)
    second = _pending_marker("r24.marked", f"b-{tag}", 5.0)
    for server in r24_servers[1]:  # A's marker gone and B's placed, before the caller's next look
        client = server.client()
        try:
            client.set(key, second, px=5000)
        finally:
            client.close()
    caller.join(timeout=20)
    assert not caller.is_alive()
    markers.drop(redlock, name, second, side)  # B's publish failed
    assert found.get("id") != f"b-{tag}", (
        "the call was handed the id of publisher B, whose publish never returned (and failed): "
        "its work never runs"
    )
