"""Every waiting call's deadline on one timer: :class:`Deadlines`.

A round waits for its replies by a deadline (``request_timeout``), and nearly every round is
answered long before it: a timer of the loop's per call (``call_later``, then ``cancel``) costs
a handle, two heap operations and a cancelled entry the loop sweeps later, on every call of the
hot path. Here one transport keeps its calls' deadlines in a heap of its own and arms one loop
timer, for the earliest: a call answered in time costs one ``heappush`` (and one pop later);
the timer, when it fires, expires what is due, drops what was answered, and is armed again for
the earliest call that still waits: about once per ``request_timeout``, not once per call.
A call is never expired before its deadline, nor later than its deadline plus the loop's latency
(as with a timer of its own).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from typing import Protocol


class Expiring(Protocol):
    def expire(self) -> None:
        """The deadline passed: stop waiting (nothing if the call was answered already)."""

    def waiting(self) -> bool:
        """Whether the call still waits (False once answered or expired)."""


class Deadlines:
    """The deadlines (on ``time.monotonic``) of one transport's calls, on one loop timer."""

    def __init__(self) -> None:
        # (deadline, order, call): the order breaks ties, so calls themselves are never compared.
        self._heap: list[tuple[float, int, Expiring]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for = math.inf

    def watch(self, deadline: float, call: Expiring) -> None:
        """Expire ``call`` at ``deadline`` unless it is answered before (see the module)."""
        heapq.heappush(self._heap, (deadline, next(self._order), call))
        if deadline < self._armed_for:
            self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_for = deadline
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, deadline - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._armed_for = math.inf
        heap = self._heap
        now = time.monotonic()
        # Due calls expire; answered ones are dropped, so the timer is next armed for a call that
        # still waits (not once for every call answered meanwhile).
        while heap and (heap[0][0] <= now or not heap[0][2].waiting()):
            heapq.heappop(heap)[2].expire()
        if heap:
            self._arm(heap[0][0])  # a loop timer may fire a little early: armed again, not lost

    def close(self) -> None:
        """Stop the timer (the transport is closing) and expire every call that still waits now.

        Expired, not dropped: a call out to a master that will not answer (paused, blackholed)
        is ended by nothing but its deadline, so a dropped one would wait for ever and hang the
        task that made it (an acquire in flight when ``aclose()`` runs)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_for = math.inf
        heap, self._heap = self._heap, []
        for _, _, call in heap:
            call.expire()
