"""Sequential work on one resource (a chain, a ``delay().get()`` loop) on pools and faults the
progress suite does not cover: the green pools (gevent, eventlet), and a master SIGSTOPped for
the whole sequence (every release then returns on the two masters that answer)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import chain, states

from celery_redlock.celery.task import is_skipped
from celery_redlock.testing import RedisServer, ServerSet

from .conftest import Workers


def _chain_then_gets(review_app: Any, queue: str, tag: str) -> list[str]:
    """A ten-link chain of skip-mode steps on one key, then five ``delay(k).get()`` in fail mode:
    what went wrong, if anything."""
    links = [review_app.skipper.si(tag).set(queue=queue) for _ in range(10)]
    last = chain(*links).apply_async()
    last.get(timeout=60, propagate=False)
    wrong = []
    node = last
    while node is not None:
        value = node.get(timeout=30, propagate=False)
        if node.state != states.SUCCESS or is_skipped(value):
            wrong.append(f"chain link {node.id}: {node.state} {value!r}")
        node = node.parent
    for i in range(5):
        result = review_app.sleeper.apply_async((tag, 0.0), queue=queue)
        result.get(timeout=30, propagate=False)
        if result.state != states.SUCCESS:
            wrong.append(f"get {i}: {result.state} {result.result}")
    return wrong


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_sequences_on_one_key_lose_nothing_on_green_pools(
    review_app: Any, review_workers: Workers, tag: str, pool: str
) -> None:
    queue = review_workers(pool, 8)
    assert _chain_then_gets(review_app, queue, tag) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_sequences_on_one_key_lose_nothing_with_a_master_stopped(
    review_app: Any,
    review_workers: Workers,
    review_servers: tuple[RedisServer, ServerSet],
    tag: str,
    pool: str,
) -> None:
    queue = review_workers(pool, 4 if pool == "threads" else 2)
    _, masters = review_servers
    masters[2].pause()
    try:
        wrong = _chain_then_gets(review_app, queue, tag)
    finally:
        masters[2].resume()
    assert wrong == []
