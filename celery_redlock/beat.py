"""The documented import path of the HA beat scheduler: ``celery_redlock.beat:RedlockScheduler``.

The scheduler lives in :mod:`celery_redlock.celery.beat`; this module only re-exports it.
"""

from .celery.beat import (
    BeatSettings,
    RedlockScheduler,
    beat_leader_elected,
    beat_leader_lost,
    read_leader,
)

__all__ = ["BeatSettings", "RedlockScheduler", "beat_leader_elected", "beat_leader_lost", "read_leader"]
