"""What the lock core waits on its sockets with: ``select.poll``, or a stand-in where a green
thread library (gevent, eventlet) has patched ``select``.

The core drives its sockets non-blocking and uses poll objects (see :mod:`.masters`) in two
ways: a *timed wait* for one link's reply (or for room to write), which may take up to
``request_timeout``, and a *check* (``poll(0)``, which never waits) of a round's idle links,
which must see a link the master closed even behind replies that arrived before the close
(``POLLRDHUP``), or a command would be written to a dead connection.

- Unpatched (prefork, threads, solo, any plain program): ``select.poll`` itself, for both. This
  is the path the benchmarks measure, and it costs nothing more than before this module: once
  chosen, :data:`poll` *is* ``select.poll``.
- Patched, a :class:`GreenPoll`: a check goes to the real ``poll`` that the library keeps aside
  (a system call that cannot block, so it holds up no other green thread, and that reports
  ``POLLRDHUP``, which gevent's poll does not: a closed link behind an owed reply would pass for
  usable); a timed wait goes to the library's own cooperative wait, so the other green threads
  (other tasks, the heartbeat) run meanwhile: gevent's ``select.poll``, or, under eventlet,
  which deletes ``select.poll``, its green ``select.select`` (always on one socket here:
  eventlet's reports one ready socket per call, and may hand a later call a stale one when
  several are ready at once).

Which one is chosen at the process's first poll, not at import: Celery's ``-P gevent`` and
``-P eventlet`` patch when the worker starts, which may be after this package is imported but is
always before any lock is taken. Patching after the first poll is not supported (both libraries
ask to be patched before anything else runs). Neither library is ever imported here.
"""

from __future__ import annotations

import logging
import select
import sys
import types
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import ConfigError

# Part of how the core talks to its masters: reported on their logger.
logger = logging.getLogger("celery_redlock.masters")


class Poller(Protocol):
    """The part of ``select.poll``'s interface the core uses (timeouts in milliseconds)."""

    def register(self, fd: int, eventmask: int = ..., /) -> None: ...

    def poll(self, timeout: float | None = ..., /) -> list[tuple[int, int]]: ...


class GreenPoll:
    """``select.poll``'s interface under a green thread library: checks (timeout 0) on a real
    poll object, timed waits on the library's ``wait`` poll object, or, when it has none
    (eventlet), on its green ``select.select``, which reports ``POLLIN`` / ``POLLOUT`` only (a
    socket the peer closed shows as readable, and reading it finds the end of the stream)."""

    __slots__ = ("_check", "_reading", "_wait", "_writing")

    def __init__(self, check: Poller, wait: Poller | None) -> None:
        self._check = check
        self._wait = wait
        self._reading: list[int] = []
        self._writing: list[int] = []

    def register(self, fd: int, eventmask: int = select.POLLIN | select.POLLOUT, /) -> None:
        self._check.register(fd, eventmask)
        if self._wait is not None:
            self._wait.register(fd, eventmask)
            return
        if eventmask & select.POLLIN:
            self._reading.append(fd)
        if eventmask & select.POLLOUT:
            self._writing.append(fd)

    def poll(self, timeout: float | None = None, /) -> list[tuple[int, int]]:
        if timeout == 0:
            return self._check.poll(0)
        if self._wait is not None:
            return self._wait.poll(timeout)
        seconds = None if timeout is None or timeout < 0 else timeout / 1000
        readable, writable, _ = select.select(self._reading, self._writing, [], seconds)
        return [(fd, select.POLLIN) for fd in readable] + [(fd, select.POLLOUT) for fd in writable]


def _real_poll() -> Callable[[], Poller] | None:
    """The unpatched ``select.poll`` that gevent or eventlet keeps aside, if either is loaded."""
    gevent_monkey: Any = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("select"):
        real: Callable[[], Poller] | None = gevent_monkey.get_original("select", "poll")
        return real
    eventlet_patcher: Any = sys.modules.get("eventlet.patcher")
    if eventlet_patcher is not None:
        real = getattr(eventlet_patcher.original("select"), "poll", None)
        return real
    return None


def _choose() -> Callable[[], Poller]:
    """What this process polls with (see the module docstring)."""
    found: Callable[[], Poller] | None = getattr(select, "poll", None)
    if isinstance(found, types.BuiltinFunctionType):
        return found  # unpatched
    real = _real_poll()
    if real is None:
        if found is None:
            raise ConfigError(
                "select.poll is missing and no unpatched one was found: the lock core supports "
                "plain processes and gevent's or eventlet's monkey patching only"
            )
        # Patched by something we do not know: its poll is used as it is, checks included.
        logger.warning("select.poll is patched by an unknown library; it is used as it is")
        return found
    wait = found  # gevent's cooperative poll; None under eventlet, which deletes it
    logger.debug("select is patched: checking with the real poll, waiting with %r", wait or select.select)
    return lambda: GreenPoll(real(), wait() if wait is not None else None)


def _first_poll() -> Poller:
    # Replaced by the chosen one at the first call: every later ``poll()`` is a direct call of
    # ``select.poll`` on an unpatched process, with no test and no wrapper in between. Two
    # threads racing here choose the same.
    global poll
    poll = _choose()
    return poll()


# A new poll object: ``waiting.poll()``, looked up on the module at each call (never imported by
# name, which would keep the first-call stand-in).
poll: Callable[[], Poller] = _first_poll
