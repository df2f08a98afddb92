"""The Celery variant's app: real ``celery worker`` processes run ``faults.rmw`` as a RedlockTask,
and ``faults.rmw_fenced`` (``lock_fenced=True``) on the fenced resources.

Configured from the environment so the workers and the runner build the same app:
``FAULTS_BROKER``, ``FAULTS_REGISTER`` (the register server), ``FAULTS_MASTERS`` (comma-separated),
``FAULTS_TTL``, ``FAULTS_KEY_PREFIX``, ``FAULTS_QUEUE`` and ``FAULTS_STALE`` (``1``: answer the
stale-writer nemesis).

The task records its hold like a workload client does. Its lock is kept alive by the heartbeat
thread of the worker child, so a hold ends only when the body returns, or when the child is
stopped (SIGSTOP) for longer than the TTL: then ``ensure()`` raises before the write, unless the
child stopped itself as a stale writer, after its last ``ensure()``: then it writes regardless.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from celery import Celery

from celery_redlock import LockLost, RedlockTask
from celery_redlock.celery import signals as lock_signals
from celery_redlock.errors import StaleFence

from .client import failure_reason
from .register import CELERY_FAILURES, EVENTS, Register, is_fenced

TTL = float(os.environ.get("FAULTS_TTL", "1.0"))
STALE = os.environ.get("FAULTS_STALE") == "1"
SAMPLE = 0.02  # how often the work looks at the lock's validity

app = Celery("faults", broker=os.environ.get("FAULTS_BROKER", "redis://127.0.0.1:1/1"))
app.conf.update(
    redlock_masters=os.environ.get("FAULTS_MASTERS") or None,
    redlock_ttl=TTL,
    redlock_key_prefix=os.environ.get("FAULTS_KEY_PREFIX", "faults:celery:"),
    redlock_retry_backoff=0.05,
    redlock_retry_backoff_max=0.3,
    task_default_queue=os.environ.get("FAULTS_QUEUE", "faults"),
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)

_local = threading.local()
_register: Register | None = None
_register_pid = 0


def register() -> Register:
    global _register, _register_pid
    if _register is None or _register_pid != os.getpid():
        _register = Register(os.environ.get("FAULTS_REGISTER", "redis://127.0.0.1:1/0"))
        _register_pid = os.getpid()
    return _register


@lock_signals.lock_acquired.connect  # type: ignore[untyped-decorator]
def _note_acquired(
    sender: Any = None,
    token: str = "",
    validity: float = 0.0,
    elapsed: float = 0.0,
    fence: int | None = None,
    **_: Any,
) -> None:
    now = time.monotonic()
    lock = sender.redlock
    _local.acquired = {
        "token": token,
        "fence": fence,
        # The signal comes just after acquire() returned, having taken `elapsed`: so the call
        # began at about now - elapsed (later by the microseconds between return and signal).
        "t_invoked": now - elapsed,
        "t_acquired": now,
        "validity_end": now + validity,
        "yes": sum(1 for v in lock.last_votes if v.kind == "yes"),
        "quorum": lock.redlock.quorum,
    }


@lock_signals.lock_contended.connect  # type: ignore[untyped-decorator]
def _note_contended(
    sender: Any = None, task_id: str = "", policy: str = "", error: Any = None, **_: Any
) -> None:
    register().client.hincrby(CELERY_FAILURES, failure_reason(error), 1)
    if policy != "retry":  # the run ends here, refused (skip, fail, exhausted): one way to end
        register().record({"kind": "gave-up", "task_id": task_id, "policy": policy}, key=EVENTS)


@app.task(
    base=RedlockTask,
    bind=True,
    name="faults.rmw",  # type: ignore[untyped-decorator]
    lock_key="res:<resource>",
)
def rmw(self: Any, resource: str, hold: float) -> None:
    _rmw(self, resource, hold)


@app.task(
    base=RedlockTask,
    bind=True,
    name="faults.rmw_fenced",  # type: ignore[untyped-decorator]
    lock_key="res:<resource>",
    lock_fenced=True,
)
def rmw_fenced(self: Any, resource: str, hold: float) -> None:
    _rmw(self, resource, hold)


def _rmw(self: Any, resource: str, hold: float) -> None:
    lock = self.redlock
    acquired = _local.acquired
    token = acquired["token"]
    assert token == lock.token, "lock_acquired was not sent for this execution's lock"
    fenced = is_fenced(resource)
    assert fenced == lock.fenced, f"{resource} taken by the wrong task"
    fence = acquired["fence"]
    assert fence == (lock.fence if fenced else None), "lock_acquired carried another fence"
    reg = register()
    client = f"{self.request.hostname}/{os.getpid()}"
    who = f"{client}:{token}"
    record: dict[str, Any] = {
        "kind": "hold",
        "client": client,
        "task_id": self.request.id,  # every published task must end exactly once (lost work)
        "resource": resource,
        **acquired,
        "t_released": None,
        "wrote": False,
        "lost": "",
        "pid": os.getpid(),
    }
    reg.record(
        {
            "kind": "holding",
            "client": client,
            "pid": os.getpid(),
            "resource": resource,
            "token": token,
            "t": time.monotonic(),
        },
        key=EVENTS,
    )
    owned, raised, stale = True, "", False
    try:
        lock.ensure()
        value = reg.fenced_read(resource, fence) if fenced else reg.read(resource)
        # The work, between read and write. The heartbeat moves the validity on meanwhile; the
        # window ends where the holder last saw it end while it still owned the lock.
        done = time.monotonic() + hold
        while time.monotonic() < done:
            if lock.owned():
                record["validity_end"] = max(record["validity_end"], time.monotonic() + lock.validity)
            time.sleep(min(SAMPLE, max(0.0, done - time.monotonic())))
        owned = lock.owned()
        lock.ensure()
        stale = STALE and _stale_pause(reg, client, record)
        if fenced:
            reg.fenced_write(resource, fence, value + 1, who)
        else:
            reg.write(resource, value + 1, who)
        record["wrote"] = True
    except LockLost as exc:
        # The loss may show at the first ensure(), before the work (a child paused just after it
        # reported holding): report what the lock says now, not the value set before the work.
        owned = lock.owned()
        record["lost"] = raised = f"LockLost: {exc.reason}"
    except StaleFence as exc:
        owned = lock.owned()
        record["lost"] = raised = f"StaleFence: {exc.current} > {exc.fence}"
    record["t_released"] = time.monotonic()  # the body is done; after_return releases
    reg.record(record)
    if stale:
        reg.record(
            {
                "kind": "stale-write",
                "client": client,
                "resource": resource,
                "token": token,
                "fence": fence,
                "t": time.monotonic(),
                "validity_end": record["validity_end"],
                "accepted": record["wrote"],
                "refused": record["lost"],
            },
            key=EVENTS,
        )
        return  # not a client pause: the nemesis waits for the stale write, not a check
    reg.record(
        {
            "kind": "checked",
            "client": client,
            "token": token,
            "t": time.monotonic(),
            "owned": owned,
            "ensure_raised": raised,
        },
        key=EVENTS,
    )


def _stale_pause(reg: Register, client: str, record: dict[str, Any]) -> bool:
    """The stale-writer point, after the last ensure(): if the nemesis asks for a pool child on
    this kind of resource, SIGSTOP this child (its heartbeat stops with it, so the lock expires)
    until the nemesis resumes it after another execution has written the resource."""
    resources = "fenced" if record["fence"] is not None else "plain"
    if not reg.take_stale_request("child", resources):
        return False
    reg.record(
        {
            "kind": "stale-paused",
            "client": client,
            "pid": os.getpid(),
            "process": True,
            "resource": record["resource"],
            "token": record["token"],
            "fence": record["fence"],
            "t": time.monotonic(),
            "validity_end": record["validity_end"],
        },
        key=EVENTS,
    )
    os.kill(os.getpid(), signal.SIGSTOP)
    return True
