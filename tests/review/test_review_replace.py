"""``self.replace(sig)`` (Celery's way for a task to hand its work on to another signature) with a
step of the same resource. Celery gives the replacement the replaced run's own task id and
publishes it from inside the body, before ``Ignore`` ends the run: the replacement is the run
going on, as a ``self.retry()`` copy is, and must wait for the lock rather than be skipped or
failed as "another publish of the same task id". Its AsyncResult is the caller's only handle."""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_redlock.celery.task import is_skipped

from .conftest import Workers


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_replacement_on_the_same_resource_runs_and_is_not_skipped(
    review_app: Any, review_workers: Workers, tag: str, pool: str
) -> None:
    queue = review_workers(pool, 4 if pool == "threads" else 2)
    result = review_app.replacer.apply_async((tag,), queue=queue)
    value = result.get(timeout=30, propagate=False)
    seen = [(e["event"], e.get("policy")) for e in review_app.events(tag)]
    assert not is_skipped(value), f"the replacement was skipped: {value}; events {seen}"
    assert value == f"ran {tag}", f"the replacement did not run: {value!r}; events {seen}"


@pytest.mark.timeout(60)
def test_an_eager_replacement_on_the_same_resource_runs_at_once(review_app: Any, tag: str) -> None:
    """Eager (``apply()``, ``task_always_eager``): Celery runs the replacement inside the replaced
    body, which holds the lock; it must neither wait out the lock's TTL nor fail."""
    started = time.monotonic()
    result = review_app.replacer.apply((tag,))
    took = time.monotonic() - started
    assert result.successful(), f"after {took:.1f} s: {result.state} {result.result!r}"
    assert result.result == f"ran {tag}" and took < 5.0, f"{result.result!r} after {took:.1f} s"
