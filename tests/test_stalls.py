"""The stall meter (testing/stalls.py) sees a stretch when this process got no CPU, and only it.

Timing bounds of the waiting machine discount measured stalls; a meter that measured too much
would let a slow library through, so the quiet window must measure less than the stopped one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from celery_redlock.testing.stalls import StallMeter

STOP = 0.3


@pytest.mark.timeout(20)
def test_a_stopped_process_is_measured_as_stalled_and_a_sleeping_one_is_not() -> None:
    with StallMeter() as meter:
        time.sleep(0.05)
        # Sleeping is no stall; being kept from the CPU (a loaded host) is, and this thread
        # measures that itself as it sleeps in short naps: how late each one wakes.
        quiet_start = time.monotonic()
        starved = 0.0
        while time.monotonic() < quiet_start + STOP:
            before = time.monotonic()
            time.sleep(0.005)
            starved += max(0.0, time.monotonic() - before - 0.005)
        quiet_end = time.monotonic()
        # Another process wakes this one: a stopped process cannot.
        waker = subprocess.Popen(
            ["sh", "-c", f"sleep {STOP}; kill -CONT {os.getpid()}"], stdin=subprocess.DEVNULL
        )
        try:
            stopped_start = time.monotonic()
            os.kill(os.getpid(), signal.SIGSTOP)
            stopped_end = time.monotonic()
        finally:
            waker.wait(10)
        # The wake-up that ends the stall is recorded once the meter runs again.
        deadline = time.monotonic() + 5
        while meter.stalled(stopped_start, stopped_end) < 0.8 * (stopped_end - stopped_start):
            assert time.monotonic() < deadline, "the stop was never measured"
            time.sleep(0.01)
        stopped = meter.stalled(stopped_start, stopped_end)
        quiet = meter.stalled(quiet_start, quiet_end)
    assert stopped <= stopped_end - stopped_start + 1e-6
    # On a quiet host the sleeping window measures next to nothing; on a loaded one, no more
    # than this thread found itself kept waiting (twice that: two threads wait differently).
    assert quiet < stopped / 2 + 2 * starved, (quiet, stopped, starved)
