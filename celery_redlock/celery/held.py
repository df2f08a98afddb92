"""The locks this process's task executions hold: one registry, read by the task and the hooks.

An execution registers its :class:`Held` lock here when it acquires, and removes it when it
releases. What ``after_return`` cannot reach goes through the registry: a run that ended ignored,
rejected or terminated (``task_postrun``), a revoke with terminate, and worker shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from .._fork import on_fork_in_child
from ..lock.heartbeat import process_heartbeat
from ..lock.resource import Lock

logger = logging.getLogger("celery_redlock.task")


@dataclass
class Held:
    """The lock one execution holds, and when it got it."""

    lock: Lock
    task_id: str
    acquired_at: float
    expire: bool
    finished: bool = False
    # The inner lock of a reentrant lock's holding (lock_reentrant=True; see lock/reentrant.py).
    reentrant: bool = False

    @property
    def held_for(self) -> float:
        return time.monotonic() - self.acquired_at


# Every lock held by an execution in this process: released at worker (process) shutdown and on
# revoke-with-terminate, when no after_return will run.
_held: dict[str, Held] = {}
_held_mutex = threading.Lock()


def release_all(reason: str) -> int:
    """Release every lock held in this process (a shutting-down worker); how many there were."""
    with _held_mutex:
        entries = list(_held.values())
        _held.clear()
    for entry in entries:
        process_heartbeat().forget(entry.lock)
        try:
            entry.lock.release()
        except Exception:  # one unreachable quorum must not keep the others held
            logger.exception("releasing %s at %s failed", entry.lock.name, reason)
        else:
            logger.warning("released lock %s of task %s: %s", entry.lock.name, entry.task_id, reason)
    return len(entries)


def release_task(task_id: str, reason: str) -> bool:
    """Release the lock held in this process by execution ``task_id``, if any."""
    with _held_mutex:
        entry = _held.pop(task_id, None)
    if entry is None:
        return False
    process_heartbeat().forget(entry.lock)
    entry.lock.release()
    logger.warning("released lock %s of task %s: %s", entry.lock.name, task_id, reason)
    return True


def finish_after_run(task: Any, task_id: str | None, state: str) -> None:
    """``task_postrun``: release what ``after_return`` did not (an ignored, rejected or
    terminated run). Every task of the process ends here, locked or not, and after_return has
    nearly always released already: a look in the registry is all that costs."""
    if task_id is not None and task_id in _held:
        finish = getattr(task, "_redlock_finish", None)
        if finish is not None:
            finish(state)


def _after_fork_in_child() -> None:
    global _held_mutex
    # The executions registered are the parent's: a child that released them at its shutdown
    # would delete locks the parent still holds (the token is the same).
    _held.clear()
    _held_mutex = threading.Lock()  # another thread may have held it at the fork


on_fork_in_child(_after_fork_in_child)


def register(entry: Held) -> None:
    with _held_mutex:
        _held[entry.task_id] = entry


def unregister(entry: Held) -> None:
    with _held_mutex:
        if _held.get(entry.task_id) is entry:
            del _held[entry.task_id]
