"""Real servers for a test package's Celery app, shared by the whole session: a broker (database
0; the result backend on 1 and the records store on 2) and three lock masters.

Session-scoped, not package-scoped: the test process imports the app module once, and its
Celery app keeps the connections it opened to the first broker; a second set of servers for the
same package (random order or a parallel run can visit a package twice) would leave it talking to
a stopped one."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from celery_redlock import MastersUnavailable
from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.lock import markers
from celery_redlock.lock.resource import lock_key
from celery_redlock.testing import RedisServer, ServerSet

MASTERS = 3


@contextmanager
def app_servers() -> Iterator[tuple[RedisServer, ServerSet]]:
    with RedisServer() as broker, ServerSet(MASTERS) as masters:
        yield broker, masters


def app_env(prefix: str, broker: RedisServer, masters: ServerSet) -> dict[str, str]:
    """The environment the app module reads, under ``prefix`` (``REVIEW``, ``PROGRESS``)."""
    base = broker.url.rsplit("/", 1)[0]
    return {
        f"{prefix}_BROKER": f"{base}/0",
        f"{prefix}_BACKEND": f"{base}/1",
        f"{prefix}_RECORDS": f"{base}/2",
        f"{prefix}_MASTERS": ",".join(masters.urls),
    }


@contextmanager
def configured(app: Any, env: dict[str, str], prefix: str) -> Iterator[None]:
    """The test process's side of the app, configured like its workers, closed at the end."""
    os.environ.update(env)
    app.conf.update(
        broker_url=env[f"{prefix}_BROKER"],
        result_backend=env[f"{prefix}_BACKEND"],
        redlock_masters=env[f"{prefix}_MASTERS"],
    )
    try:
        yield
    finally:
        close_app_redlock(app)


def still_queued(task: Any, *args: Any) -> bool:
    """``task.is_queued(*args)`` for a wait until a key is free: an answer the masters could not
    settle (MastersUnavailable, masters late on a loaded host) is "not yet", never "free"."""
    try:
        return bool(task.is_queued(*args))
    except MastersUnavailable:
        return True


def marker_gone(masters: Iterable[Any], prefix: str, name: str, task: str, task_id: str) -> bool:
    """Whether no master holds a value naming ``task_id`` (its message's marker, or its run's
    lock) for resource ``name``, on the lock key or on ``task``'s side key: every master read
    with a plain client, which answers or raises.

    The event a test's next publish must come after. Not ``queued_task_id() is None``: that is
    one round bounded by ``request_timeout``, and a quorum of masters answering late (a loaded
    host) makes it raise MastersUnavailable, or read a marker kept on too few of them as "not
    queued" while a late delete is still on its way to the others. Nor the message's
    REVOKED state: Celery stores it when the worker receives the revoke, but a delayed message
    is discarded, and its marker deleted, only when it comes due."""
    keys = (lock_key(prefix, name), markers.side_key(prefix, name, task))
    needle = f'"task":"{task_id}"'.encode()
    for server in masters:
        client = server.client()
        try:
            if any(needle in (client.get(key) or b"") for key in keys):
                return False
        finally:
            client.close()
    return True
