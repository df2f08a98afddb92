"""What the test packages' Celery apps share: the settings their real workers need, read from
the environment under each app's prefix, and a records client of each process's own.

The app modules (``celery -A ...``) are imported by the worker and its pool children as well as
by the test process, so everything here is read from the environment, not from fixtures."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery import signals as celery_signals

NOWHERE = "redis://127.0.0.1:1"  # no server: an app imported without its environment fails loudly


def worker_app(name: str, prefix: str, *, backend: str | None = None, **conf: Any) -> Celery:
    """A Celery app named ``name`` on ``{prefix}_BROKER``, its lock masters ``{prefix}_MASTERS``,
    its results on ``backend`` (default ``{prefix}_BACKEND``, else the broker). A worker takes
    one message at a time, so a test's duplicates wait in the queue rather than in a prefetch.
    ``conf`` adds or overrides settings."""
    broker = os.environ.get(f"{prefix}_BROKER", f"{NOWHERE}/0")
    app = Celery(name, broker=broker, backend=backend or os.environ.get(f"{prefix}_BACKEND") or broker)
    app.conf.update(
        {
            "redlock_masters": os.environ.get(f"{prefix}_MASTERS") or None,
            "redlock_ttl": 10.0,
            "worker_prefetch_multiplier": 1,
            "broker_connection_retry_on_startup": True,
            "result_expires": 600,
            "task_default_queue": f"{name}-unused",  # every test names its queue; none uses it
            **conf,
        }
    )
    return app


class Records:
    """A Redis client on the URL in environment variable ``name`` (``default`` without it), made
    again in each process (a pool child must not use the connection its parent had at fork) and
    whenever the URL changes (the test process imports the app before a fixture sets it)."""

    def __init__(self, name: str, default: str = f"{NOWHERE}/2") -> None:
        self.name, self.default = name, default
        self._client: redis.Redis | None = None
        self._made_for: tuple[int, str] = (0, "")

    def __call__(self) -> redis.Redis:
        made_for = (os.getpid(), os.environ.get(self.name) or self.default)
        if self._client is None or self._made_for != made_for:
            self._client = redis.Redis.from_url(made_for[1], socket_timeout=10)
            self._made_for = made_for
        return self._client


class EventLog:
    """What a test app's bodies and signals record, as JSON events on the Redis list
    ``{list_prefix}<key>`` of ``records``: each event names its key, its process and its time."""

    def __init__(self, records: Records, list_prefix: str) -> None:
        self.records, self.list_prefix = records, list_prefix

    def record(self, key: str, event: str, **fields: Any) -> None:
        fields.setdefault("t", time.time())
        entry = {"event": event, "key": key, "pid": os.getpid(), **fields}
        self.records().rpush(f"{self.list_prefix}{key}", json.dumps(entry))

    def events(self, key: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.records().lrange(f"{self.list_prefix}{key}", 0, -1)]

    def note_preruns(self) -> None:
        """Record every run's start (its worker has it, and its lock is not asked for yet) as a
        ``prerun`` event naming the run and its process, under the run's first argument: what a
        test waits on before it acts on a run that is waiting. Under ``run``, not ``task_id``,
        which marks what a body did."""

        def note(task_id: str, task: Any, args: Any = (), **_: Any) -> None:
            if args:
                self.record(str(args[0]), "prerun", run=task_id)

        self._note = note  # signals hold weak references: the log keeps its receiver alive
        celery_signals.task_prerun.connect(note, weak=False)
