"""Waiting on the event a test means, with a deadline: the suite's one polling helper."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float, *, every: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; whether it came to hold (asked
    once more at the deadline, so a slow last poll is not taken for a miss)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return bool(predicate())
