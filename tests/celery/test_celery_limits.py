"""Exclusion at the seams: time limits and heartbeat margins.

- A run's heartbeat is capped only by the time limit that applies to that run, and only where
  the pool enforces it by ending the process (prefork); elsewhere it is not capped at all, so a
  lock never expires under a body that is still running.
- A heartbeat interval must leave room for an extension to land before validity ends with one
  round missed: ``interval + 2 x request_timeout + drift <= ttl``; anything else is refused at
  definition (what no setting can make right) and at worker start, naming the task, the option
  and the largest interval allowed.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from conftest import contend_while_running, ended_at, records, wait_until
from test_celery_core import Pool

from celery_redlock import ConfigError, RedlockTask
from celery_redlock.celery.task import check_app
from celery_redlock.testing import ServerSet


@pytest.mark.timeout(60)
def test_a_lock_never_expires_under_a_body_its_limit_does_not_end(
    lockapp: Any, pool: Pool, redlock_masters: ServerSet, tag: str
) -> None:
    """The task's time_limit is 3 s; the call raises it to 10 s (prefork), or the pool enforces
    none (threads): the body runs 6 s, and no other client gets its lock meanwhile."""
    name, queue, _ = pool
    options = {"time_limit": 10} if name == "prefork" else {}
    result = lockapp.limited.apply_async((tag, 6.0, tag), queue=queue, **options)
    wait_until(lambda: records(lockapp, tag), 20, "the body to start")
    _, got_in = contend_while_running(result, redlock_masters.urls, f"res:{tag}", every=0.2)
    assert result.get(timeout=5) == {"lost": ""}
    assert got_in is None or got_in > ended_at(lockapp, tag), (
        "another client took the lock under a running body"
    )


def test_a_heartbeat_interval_that_cannot_keep_the_lock_is_refused_at_definition() -> None:
    app = Celery("hbdef", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigError) as caught:

        @app.task(
            shared=False,
            base=RedlockTask,
            lock_key="x:<n>",
            lock_ttl=1,
            lock_heartbeat_interval=0.995,
            name="hb.x",
        )
        def x(n: int) -> int:
            return n

        app.finalize()  # Celery makes a task's class when its app is finalized
    message = str(caught.value)
    assert "hb.x" in message and "lock_heartbeat_interval" in message and "largest interval" in message


@pytest.mark.parametrize(
    ("interval", "ok"),
    [(0.98, False), (0.79, False), (0.78, True), (None, True)],
)
def test_the_margin_is_checked_with_the_apps_request_timeout(interval: float | None, ok: bool) -> None:
    """ttl 1 s, request_timeout 0.1 s, drift 12 ms: the largest interval is 0.788 s."""
    app = Celery("hbstart", broker="memory://", set_as_current=False)
    app.conf.update(redlock_masters=["redis://127.0.0.1:1/0"], redlock_request_timeout=0.1)

    @app.task(
        shared=False,
        base=RedlockTask,
        lock_key="y:<n>",
        lock_ttl=1,
        lock_heartbeat_interval=interval,
        name="hb.y",
    )
    def y(n: int) -> int:
        return n

    if ok:
        check_app(app)
        return
    with pytest.raises(ConfigError) as caught:
        check_app(app)
    message = str(caught.value)
    assert "hb.y" in message and "lock_heartbeat_interval" in message and "0.788" in message


def test_a_ttl_too_short_for_any_interval_is_refused_naming_it() -> None:
    app = Celery("hbttl", broker="memory://", set_as_current=False)
    app.conf.update(redlock_masters=["redis://127.0.0.1:1/0"], redlock_request_timeout=0.2)

    @app.task(shared=False, base=RedlockTask, lock_key="z:<n>", lock_ttl=0.4, name="hb.z")
    def z(n: int) -> int:
        return n

    with pytest.raises(ConfigError, match=r"hb\.z.*lock_ttl"):
        check_app(app)
