"""Waiting on the event a test means, with a deadline: the suite's one polling helper."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], object], timeout: float, *, every: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; whether it came to hold (asked
    once more at the deadline, so a slow last poll is not taken for a miss)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return bool(predicate())


def wait_until(predicate: Callable[[], object], timeout: float, what: str, *, every: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something true and return that; at the deadline
    (after one last ask) fail naming ``what``, the event the test was waiting for."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
