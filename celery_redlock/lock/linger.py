"""Releases that wait a few milliseconds to share the next round trip to the masters.

A finished holder's release needs no round of its own. Written in front of the next command
this process sends every master (the next acquire, an extension), it reaches each master in the
same packet and costs neither side an extra wake-up, which on co-located masters is most of
what a lock costs. A busy worker sends its next acquire within a millisecond or two of a task's
end, so nearly every release rides along; a ticker thread sends whatever has waited ``linger``
seconds, so an idle process still releases within that bound.

A lingering lock is still a held lock: nobody else can take it, and its TTL still bounds it if
the process dies. Only the holder's own next acquire of the same key sees it gone at once,
because the release goes out ahead of that acquire on every link.

The ticker thread is started by the first release held back. It sleeps until the oldest waiting
release is due (a whole ``linger`` when none waits); after a whole linger in which nothing was
added and nothing is left it waits, without waking, until the next release is held back. It
ends only at :meth:`Lingering.close`, which its Redlock calls from ``Redlock.close()`` or, for a
Redlock dropped without that, when the Redlock is collected: the ticker holds the masters it
sends to, never the Redlock, so it cannot keep its owner alive. Instances forget their releases
in a forked child (they are the parent's to send) and send them at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._fork import on_fork_in_child
from .clock import now

logger = logging.getLogger("celery_redlock.linger")

Command = tuple[Any, ...] | bytes
Send = Callable[[Sequence[Command]], None]

_instances: weakref.WeakSet[Lingering] = weakref.WeakSet()


class Lingering:
    """The releases one Redlock holds back, and the ticker that bounds how long they wait."""

    def __init__(self, linger: float, send: Send) -> None:
        self.linger = linger
        self._send = send  # must not hold the Redlock: the ticker would keep it alive
        self._added = 0
        self._start_empty()
        _instances.add(self)
        on_fork_in_child(self._after_fork_in_child)

    def _start_empty(self) -> None:
        """Nothing held back and no ticker: a new instance, or a forked child's copy of one."""
        self._items: list[tuple[float, Command]] = []  # (send by, command), oldest first
        # A plain Lock: add() and take() run once per task, and an RLock costs more to enter.
        self._cond = threading.Condition(threading.Lock())
        # The ticker that runs now (None: none, or the last one was told to stop). A ticker
        # runs only while it is this one, so one that close() let go ends even if a later
        # add() starts its successor before it has woken up.
        self._ticker: threading.Thread | None = None
        self._ticker_idle = False

    def _after_fork_in_child(self) -> None:
        # The releases held back are the parent's to send, and the parent's ticker did not
        # survive the fork. The condition is replaced, not taken (see celery_redlock._fork).
        self._start_empty()

    def add(self, command: Command) -> None:
        """Hold ``command`` back until the next round, or ``linger`` seconds at most."""
        with self._cond:
            self._items.append((now() + self.linger, command))
            self._added += 1
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name="redlock-linger", daemon=True)
                self._ticker.start()
            elif self._ticker_idle:
                self._cond.notify()

    def take(self) -> list[Command]:
        """Every command held back, for the caller's round to send ahead of its own."""
        if not self._items:  # the hot path: no lock taken when nothing lingers
            return []
        with self._cond:
            items, self._items = self._items, []
        return [command for _, command in items]

    def flush(self) -> None:
        """Send everything held back now, in a round of its own."""
        commands = self.take()
        if commands:
            self._send(commands)

    def close(self) -> None:
        """Send everything held back and stop the ticker (a later ``add`` starts a new one)."""
        self.flush()
        with self._cond:
            self._ticker = None
            self._cond.notify_all()

    def _tick(self) -> None:
        me = threading.current_thread()
        try:
            self._tick_while(me)
        finally:
            with self._cond:
                if self._ticker is me:  # ended by an error, not by close(): the next add restarts
                    self._ticker = None

    def _tick_while(self, me: threading.Thread) -> None:
        # Releases are sent a little ahead of their bound, so a wake-up that comes late still
        # keeps it.
        early = self.linger / 10
        seen = -1
        while True:
            with self._cond:
                # Idle once a whole linger passed with nothing added and nothing left to send.
                while self._ticker is me and not self._items and self._added == seen:
                    self._ticker_idle = True
                    self._cond.wait()
                    self._ticker_idle = False
                if self._ticker is not me:
                    return
                seen = self._added
                # Sleep until the oldest release is due, or a whole linger when none waits. A
                # busy process's next round takes each release long before then, so the ticker
                # wakes about once per linger and finds nothing to do; waking on every add
                # would cost a thread switch per release.
                wait = self._items[0][0] - early - now() if self._items else self.linger
                if wait > 0:
                    self._cond.wait(wait)
                if self._ticker is not me:
                    return
                horizon = now() + early
                due = [command for by, command in self._items if by <= horizon]
                if due:
                    self._items = [item for item in self._items if item[0] > horizon]
            if due:
                try:
                    self._send(due)
                except Exception:  # the thread must outlive one bad round; the TTL still holds
                    logger.exception("sending %d lingering releases failed", len(due))


def _at_exit() -> None:
    for instance in list(_instances):
        try:
            instance.flush()
        except Exception:
            logger.debug("lingering releases not sent at exit", exc_info=True)


atexit.register(_at_exit)
