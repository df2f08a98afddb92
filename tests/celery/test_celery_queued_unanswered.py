"""``is_queued`` and ``queued_task_id`` answer only what the masters' replies settle.

The property, attacked by hypothesis over five real masters: with this task's marker on a set
``held`` of masters and a set ``silent`` of them stopped (SIGSTOP, so their replies never come
within the round), the answer is either

- the truth: queued (the marker's task id, or True) iff ``held`` is a quorum; or
- :class:`MastersUnavailable` naming the silent masters, and only when the answering masters
  cannot rule out a quorum (what they show of the marker, plus the silent ones, reaches one).

The message is published for real (a broker nobody consumes) so the marker is the library's
own, placed at publish; a subset is made by deleting it, by value, from the other masters.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_redlock import MastersUnavailable, RedlockTask
from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.testing import RedisServer, ServerSet

MASTERS = 5
QUORUM = MASTERS // 2 + 1
REQUEST_TIMEOUT = 0.3  # a stopped master costs a read this much


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[Celery, Any, ServerSet]]:
    with RedisServer() as broker, ServerSet(MASTERS) as masters:
        app = Celery("queued-unanswered", broker=broker.url, set_as_current=False)  # ids only
        app.conf.update(
            redlock_masters=masters.urls,
            redlock_request_timeout=REQUEST_TIMEOUT,
            task_default_queue=f"nobody-{uuid.uuid4().hex[:8]}",  # never consumed
        )

        @app.task(base=RedlockTask, lock_key="q:<n>", lock_enqueue="return_existing", shared=False)
        def marked(n: str) -> str:
            return n

        try:
            yield app, marked, masters
        finally:
            close_app_redlock(app)


def marker_keys(masters: ServerSet, n: str) -> list[tuple[bytes, bytes]]:
    """(key, value) of every redlock key naming resource ``q:<n>`` on the first master."""
    with masters[0].client() as client:
        found = [k for k in client.keys("*") if f"q:{n}".encode() in k]
        return [(k, client.get(k)) for k in found if client.type(k) == b"string"]


def keep_only(masters: ServerSet, n: str, held: set[int]) -> None:
    """Leave the marker on the masters in ``held`` only (deleted elsewhere, by key)."""
    keys = marker_keys(masters, n)
    assert keys, "the publish placed no marker"
    for i, server in enumerate(masters):
        if i not in held:
            with server.client() as client:
                client.delete(*[k for k, _ in keys])


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    held=st.sets(st.integers(0, MASTERS - 1)),
    silent=st.sets(st.integers(0, MASTERS - 1), max_size=MASTERS),
    ask_id=st.booleans(),
)
def test_the_answer_is_the_truth_or_names_the_silent_masters(
    world: tuple[Celery, Any, ServerSet], held: set[int], silent: set[int], ask_id: bool
) -> None:
    _, marked, masters = world
    n = uuid.uuid4().hex[:10]
    published = marked.apply_async((n,))
    keep_only(masters, n, held)
    for i in silent:
        masters[i].pause()
    try:
        started = time.monotonic()
        try:
            answer: Any = marked.queued_task_id(n) if ask_id else marked.is_queued(n)
            raised = None
        except MastersUnavailable as exc:
            answer, raised = None, exc
        took = time.monotonic() - started
    finally:
        for i in silent:
            masters[i].resume()
    assert took < REQUEST_TIMEOUT + 1.0, f"a round with stopped masters took {took:.2f} s"
    seen = len(held - silent)
    undecidable = seen < QUORUM and seen + len(silent) >= QUORUM
    if raised is not None:
        # A loaded host may make a running master late too: what it reports as silent includes
        # the stopped ones, and its decision must be right for what it reports.
        reported = {name.rsplit(":", 1)[-1] for name in raised.masters}
        assert {str(masters[i].port) for i in silent} <= reported, raised
        seen_answering = len([i for i in held if str(masters[i].port) not in reported])
        assert seen_answering < QUORUM and seen_answering + len(reported) >= QUORUM, (
            f"raised though the answering masters decide it: {raised}"
        )
        assert f"q:{n}" in str(raised)
        return
    assert not undecidable, f"answered {answer!r} with held={held} silent={silent}: a guess"
    queued = len(held) >= QUORUM
    if ask_id:
        assert answer == (published.id if queued else None)
    else:
        assert answer is queued


@pytest.mark.timeout(60)
def test_a_majority_stopped_raises_naming_them_and_a_minority_stopped_still_answers(
    world: tuple[Celery, Any, ServerSet],
) -> None:
    _, marked, masters = world
    n = uuid.uuid4().hex[:10]
    published = marked.apply_async((n,))
    for server in list(masters)[:2]:
        server.pause()
    try:
        assert marked.queued_task_id(n) == published.id  # three answer, all showing it
        assert marked.queued_task_id("never-" + n) is None  # three answer without it: decided
    finally:
        for server in list(masters)[:2]:
            server.resume()
    for server in list(masters)[:3]:
        server.pause()
    try:
        with pytest.raises(MastersUnavailable, match=r"too few masters answered") as info:
            marked.is_queued("never-" + n)
    finally:
        for server in list(masters)[:3]:
            server.resume()
    assert len(info.value.masters) == 3
