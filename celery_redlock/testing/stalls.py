"""How long this process was kept from running, measured, so timing bounds can discount it.

A test that bounds how long the library takes ("a non-blocking attempt returns within
request_timeout") measures wall time, and wall time on a loaded machine includes the stretches
when the test process got no CPU, or when its own helper threads (proxies, monitors) held the
GIL. Raising the bound for every run hides real slowness; discounting the stalls that were
measured in the same window keeps the bound tight on a quiet machine and honest on a busy one.

A ``StallMeter`` runs one daemon thread that sleeps ``tick`` seconds at a time and records how
late each wake-up was. A thread of this process that wanted to run during a late stretch was
held up about as long, so the lateness summed over a window is the time the library could not
have used in that window.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["StallMeter"]


class StallMeter:
    """Lateness of a sleeping thread's wake-ups, kept as (woke at, late by) on ``clock``."""

    def __init__(
        self,
        tick: float = 0.005,
        *,
        ignore_below: float = 0.002,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tick = tick
        self.clock = clock
        # Ordinary timer slack is not a stall; counting it would loosen every bound a little.
        self.ignore_below = ignore_below
        self._woke: list[float] = []
        self._late: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StallMeter:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="stall-meter", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
            self._thread = None

    def _run(self) -> None:
        asleep = self.clock()
        while not self._stop.wait(self.tick):
            woke = self.clock()
            late = woke - asleep - self.tick
            if late >= self.ignore_below:
                with self._lock:
                    self._woke.append(woke)
                    self._late.append(late)
            asleep = woke

    def stalled(self, start: float, end: float) -> float:
        """Seconds of measured stall overlapping [start, end] (on ``clock``).

        A wake-up at ``woke`` that was ``late`` seconds late covers (woke - late, woke]; only the
        part inside the window counts. A stall still going on at ``end`` is not measured yet: read
        again later for it.
        """
        with self._lock:
            first = bisect.bisect_left(self._woke, start)
            total = 0.0
            for woke, late in zip(self._woke[first:], self._late[first:], strict=True):
                began = woke - late
                if began >= end:
                    break
                total += min(woke, end) - max(began, start)
            return total
