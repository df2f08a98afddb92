"""Attacks that held: re-publishes of a run that still holds its lock (``autoretry_for``,
``self.retry(countdown=0)`` with no lock retry budget), and a lock lost mid-body whose release
must leave the next holder's lock alone."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import chord, states

from celery_redlock import Redlock
from celery_redlock.celery.task import is_skipped
from celery_redlock.testing import RedisServer, ServerSet

from .conftest import Workers


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_autoretry_copies_published_under_the_lock_wait_and_run(
    review_app: Any, review_workers: Workers, tag: str, pool: str
) -> None:
    queue = review_workers(pool, 4 if pool == "threads" else 2)
    result = review_app.autoretrier.apply_async((tag,), queue=queue)
    assert result.get(timeout=30, propagate=False) == 3, (result.state, result.result)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_retry_copy_refused_by_its_own_run_waits_even_without_a_lock_retry_budget(
    review_app: Any, review_workers: Workers, tag: str, pool: str
) -> None:
    queue = review_workers(pool, 4 if pool == "threads" else 2)
    result = review_app.retrier.apply_async((tag,), queue=queue)
    assert result.get(timeout=30, propagate=False) == 2, (result.state, result.result)
    policies = [e.get("policy") for e in review_app.events(tag) if e["event"] == "refused"]
    assert policies and set(policies) == {"retry"}, policies


@pytest.mark.timeout(90)
def test_the_release_of_a_lock_lost_mid_body_leaves_the_takers_lock(
    review_app: Any, review_workers: Workers, review_servers: tuple[RedisServer, ServerSet], tag: str
) -> None:
    queue = review_workers("prefork", 2)
    _, masters = review_servers
    result = review_app.loser.apply_async((tag,), queue=queue)
    deadline = time.monotonic() + 30
    while not any(e["event"] == "start" for e in review_app.events(tag)):
        assert time.monotonic() < deadline, "the body never started"
        time.sleep(0.02)
    key = f"redlock:r:{tag}"
    for server in masters:  # the lock expires under the body (as under a long pause)
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        client.delete(key)
        client.close()
    with Redlock(masters.urls) as rl:
        taker = rl.lock(f"r:{tag}", ttl=30)
        assert taker.acquire(blocking=False), taker.last_error
        review_app.records().set(f"go:{tag}", 1)
        # (What the body's owned() said is its local estimate: the keys were taken from under it
        # out of protocol, as `celery redlock release --force` or a master's data loss would.)
        result.get(timeout=30, propagate=False)
        assert result.state == states.SUCCESS, result.result
        assert taker.owned() and taker.extend(), "the lost run's release took the taker's lock"
        taker.release()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_an_errback_and_a_chords_surviving_members_of_the_failed_resource_run(
    review_app: Any, review_workers: Workers, tag: str, pool: str
) -> None:
    """A failing run's ``link_error`` callback on the same resource (skip mode) is published
    after the failure, so never finds the failed run's lock; a chord whose header member fails
    runs its other members."""
    queue = review_workers(pool, 4 if pool == "threads" else 2)
    errback = review_app.skipper.si(f"{tag}-e").set(queue=queue)
    errback_id = errback.freeze().id
    failed = review_app.failer.apply_async((f"{tag}-e", 0.2), queue=queue, link_error=errback)
    failed.get(timeout=30, propagate=False)
    assert failed.state == states.FAILURE
    back = review_app.app.AsyncResult(errback_id)
    assert back.get(timeout=30, propagate=False) == f"ran {tag}-e", back.result
    header = [
        review_app.failer.si(tag, 0.1).set(queue=queue),
        review_app.sleeper.si(f"{tag}-a", 0.1).set(queue=queue),
        review_app.sleeper.si(f"{tag}-b", 0.1).set(queue=queue),
    ]
    ids = [member.freeze().id for member in header]
    body = review_app.skipper.si(tag).set(queue=queue)
    chord(header)(body)
    for member, member_id in zip(header[1:], ids[1:], strict=True):
        value = review_app.app.AsyncResult(member_id).get(timeout=30, propagate=False)
        assert not is_skipped(value) and value == member.args[0], value
