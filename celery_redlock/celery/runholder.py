"""A run's holder record: what a locked run writes beside its token, and how a contender reads it."""

from __future__ import annotations

import socket
import time
from typing import Any

from .._fork import pid
from ..errors import LockNotAcquired
from ..lock.holder import HolderRecord, describe_holder, parse, process_identity
from .hooks import PUBLISH_ID_HEADER
from .lockoptions import LockOptions

HOST = socket.gethostname()


def holder_text(task: Any, options: LockOptions, task_id: str, request: Any) -> str:
    """A run's holder record. What every run of the task in this process shares (name, host,
    pid, TTL, heartbeat interval) is one record, made once per task class; each run writes its
    own id, start and publish id into its text.

    ``heartbeat`` is the interval the run's heartbeat really extends at (the options' resolved
    interval, default included, which ``_redlock_hold`` gives ``process_heartbeat().keep``), and
    absent when the task runs without heartbeat: an operator's release watches the lock for that
    interval (plus a margin) before it calls the holder dead (see lock/liveness.py)."""
    cls = type(task)
    record = cls.__dict__.get("_redlock_holder")
    me = pid()
    ttl = options.ttl
    heartbeat = options.heartbeat_interval if options.heartbeat else None
    if (
        record is None
        or record.name != task.name
        or record.ttl != ttl
        or record.heartbeat != heartbeat
        or record.pid != me
    ):
        record = HolderRecord(
            name=task.name, host=HOST, pid=me, proc=process_identity(), ttl=ttl, heartbeat=heartbeat
        )
        setattr(cls, "_redlock_holder", record)  # noqa: B010 - on the class, not the instance
    publish = header(request, PUBLISH_ID_HEADER)
    text: str = record.to_text(
        task=task_id, since=time.time(), publish=publish if isinstance(publish, str) else None
    )
    return text


def naming_holder(error: LockNotAcquired, text: str | None) -> LockNotAcquired:
    """``error`` naming who holds the lock, when a quorum agreed on one (``text``)."""
    return error if text is None else error.naming(describe_holder(text))


def same_publish(record: HolderRecord, request: Any) -> bool:
    """Whether the holder ``record`` (whose task id is this run's) was taken by an earlier
    attempt of this run's own publish: the same publish id, carried by a message's broker
    redeliveries and retries (see :data:`.hooks.PUBLISH_ID_HEADER`). A publisher or a holder
    without one (not running celery_redlock's hooks, or an older release) is given the benefit
    of the doubt: waiting loses no work, where a skip could."""
    if getattr(request, "replaced_task_nesting", 0):
        # A replacement (self.replace): Celery publishes it under the replaced run's task id,
        # from inside that run's body. It is that run going on, so it waits for its lock.
        return True
    mine = header(request, PUBLISH_ID_HEADER)
    return mine is None or record.publish is None or mine == record.publish


def holder_task(holder: str | None) -> str | None:
    """The task id in a lock's holder record (see _redlock_acquire), if one is there."""
    record = parse(holder) if holder else None
    return None if record is None else record.task  # None: not a RedlockTask's (a script, the CLI)


def header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value
