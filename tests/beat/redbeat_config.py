"""A Celery configuration module (``app.config_from_object``) for RedlockScheduler over redbeat.

docs/beat.md's redbeat snippet is an excerpt of it; the beats of test_beat_redbeat.py run with these
settings, with the URL of the tests' own Redis in place of the one below.
"""

from __future__ import annotations

from typing import Any

beat_scheduler = "celery_redlock.beat:RedlockScheduler"
redlock_beat_scheduler = "redbeat:RedBeatScheduler"  # redbeat's own lock is turned off for you
redbeat_redis_url = "redis://127.0.0.1:6379/1"  # where redbeat keeps the schedule


def settings() -> dict[str, Any]:
    """The settings above, by name."""
    return {
        name: globals()[name] for name in ("beat_scheduler", "redlock_beat_scheduler", "redbeat_redis_url")
    }
