"""celery-redlock: at most one run at a time per resource, across a Celery fleet, by Redlock.

The public names are loaded on first use (PEP 562): ``from celery_redlock import Redlock`` loads
the lock core alone, and Celery is imported only when a Celery name (``RedlockTask``) is asked for.

- ``celery_redlock.lock``: the Redlock algorithm over N masters; imports nothing of Celery.
- ``celery_redlock.celery``: ``RedlockTask``, the beat scheduler, the ``celery redlock`` command.
- ``celery_redlock.testing``: real servers and workers for tests (the ``embedded`` extra).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

try:
    __version__ = _version("celery-redlock")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# public name -> the module that defines it
_EXPORTS = {
    "AlreadyQueued": "celery_redlock.errors",
    "ConfigError": "celery_redlock.errors",
    "LockLost": "celery_redlock.errors",
    "LockNotAcquired": "celery_redlock.errors",
    "MastersUnavailable": "celery_redlock.errors",
    "NotLocked": "celery_redlock.errors",
    "RedlockError": "celery_redlock.errors",
    "Vote": "celery_redlock.errors",
    "Lock": "celery_redlock.lock.resource",
    "Redlock": "celery_redlock.lock.redlock",
    "AsyncRedlock": "celery_redlock.lock.aio.redlock",
    "AsyncLock": "celery_redlock.lock.aio.lock",
    "RedlockWarning": "celery_redlock.lock.redlock",
    "process_heartbeat": "celery_redlock.lock.heartbeat",
    "RedlockTask": "celery_redlock.celery.task",
    "RedlockTaskMixin": "celery_redlock.celery.task",
    "is_skipped": "celery_redlock.celery.task",
    "app_redlock": "celery_redlock.celery.settings",
    "ReentrantLock": "celery_redlock.lock.reentrant",
    "LockKindMismatch": "celery_redlock.errors",
    "NotFenced": "celery_redlock.errors",
    "StaleFence": "celery_redlock.errors",
}

__all__ = [
    "AlreadyQueued",
    "AsyncLock",
    "AsyncRedlock",
    "ConfigError",
    "Lock",
    "LockKindMismatch",
    "LockLost",
    "LockNotAcquired",
    "MastersUnavailable",
    "NotFenced",
    "NotLocked",
    "Redlock",
    "RedlockError",
    "RedlockTask",
    "RedlockTaskMixin",
    "RedlockWarning",
    "ReentrantLock",
    "StaleFence",
    "Vote",
    "__version__",
    "app_redlock",
    "is_skipped",
    "process_heartbeat",
]

if TYPE_CHECKING:
    from .celery.settings import app_redlock
    from .celery.task import RedlockTask, RedlockTaskMixin, is_skipped
    from .errors import (
        AlreadyQueued,
        ConfigError,
        LockKindMismatch,
        LockLost,
        LockNotAcquired,
        MastersUnavailable,
        NotFenced,
        NotLocked,
        RedlockError,
        StaleFence,
        Vote,
    )
    from .lock.aio.lock import AsyncLock
    from .lock.aio.redlock import AsyncRedlock
    from .lock.heartbeat import process_heartbeat
    from .lock.redlock import Redlock, RedlockWarning
    from .lock.reentrant import ReentrantLock
    from .lock.resource import Lock


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_redlock' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
