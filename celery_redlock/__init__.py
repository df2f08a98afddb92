"""celery-redlock: at most one run at a time per resource, across a Celery fleet, by Redlock."""

from __future__ import annotations

from .errors import ConfigError, LockLost, LockNotAcquired, RedlockError, Vote
from .redlock import Lock, Redlock, RedlockWarning
from .task import RedlockTask, RedlockTaskMixin

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Lock",
    "LockLost",
    "LockNotAcquired",
    "Redlock",
    "RedlockError",
    "RedlockTask",
    "RedlockTaskMixin",
    "RedlockWarning",
    "Vote",
    "__version__",
]
