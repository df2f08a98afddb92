"""A scheduler RedlockScheduler does not know: celery's own, keeping its entries in memory only.

RedlockScheduler refuses it unless ``redlock_beat_scheduler_state = "local"`` says so (it is
process-local: nothing in it outlives the process or is seen by another).
"""

from __future__ import annotations

from celery.beat import Scheduler


class InMemoryScheduler(Scheduler):  # type: ignore[misc]
    """celery's base Scheduler under a name of its own."""
