"""What a forked child does first: the one fork-reset of the whole package.

A child of ``fork`` (a prefork pool's worker, above all) starts with a copy of its parent's
memory and none of its parent's threads. Three things in that copy must not be used as they are:

- **Sockets.** A connection to a master is shared with the parent: replies would be read by
  whichever process reads first, and the parent's lock commands would be answered to the child.
- **The parent's duties.** Lingering releases and heartbeat extensions are the parent's to send;
  a child that sent them would release or keep alive locks it never held.
- **Mutexes.** Only the thread that called ``fork`` goes on in the child. A mutex that another
  thread of the parent held at that moment stays held in the child for ever, and the first
  ``with`` on it hangs. Every mutex or condition of ours is therefore replaced, never taken,
  in the child.

Each module says what it resets by registering a callback with :func:`on_fork_in_child`; this
module makes the one ``os.register_at_fork`` call that runs them all, after refreshing
:func:`pid`. A callback runs in the child before ``fork`` returns there, while the child has a
single thread, so it may replace state without taking any lock (and must not take one: it may
be held by a thread that no longer exists).
"""

from __future__ import annotations

import inspect
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

logger = logging.getLogger("celery_redlock.fork")

# Read once, and again in each forked child: os.getpid() is a system call, and a check on a
# lock's hot path must not cost one.
_pid = os.getpid()

# Plain functions (module-level state), held for good, in the order they were registered.
_functions: list[Callable[[], None]] = []
# Bound methods, held through their object weakly: an object that is gone needs no reset, and
# registering must not keep it alive. object -> the functions to call on it.
_methods: weakref.WeakKeyDictionary[Any, list[Callable[[Any], None]]] = weakref.WeakKeyDictionary()


def pid() -> int:
    """This process's id, without a system call."""
    return _pid


def on_fork_in_child(callback: Callable[[], None]) -> None:
    """Run ``callback`` in the child after every later ``fork`` of this process.

    A bound method (``on_fork_in_child(self._after_fork_in_child)``) holds its object only
    weakly; any other callable is kept for the life of the process. Callbacks run in no
    promised order across objects, so each must stand on its own.
    """
    if inspect.ismethod(callback):
        _methods.setdefault(callback.__self__, []).append(callback.__func__)
    else:
        _functions.append(callback)


def let_go_of_inherited(sockets: Iterable[Any]) -> None:
    """In a forked child: let go of the child's copies of ``sockets`` (socket objects, or
    anything with ``fileno()``), the parent's connections, without ending them.

    Each descriptor is pointed at /dev/null (``dup2``) rather than closed or shut down: the
    connection is then the parent's alone and closes when the parent does, while the number
    stays the copied socket object's, so nothing that object does later (a close when it is
    collected) can reach a descriptor the child has opened since. A socket already closed
    answers -1 and is left alone (its old number may be another file's now). The one rule for
    every owner of connections that a fork can leave behind (a thread's frame that no longer
    runs, a loop that never runs again in the child).
    """
    null = -1
    try:
        for sock in sockets:
            try:
                fd = sock.fileno()
            except (OSError, ValueError):
                continue
            if fd < 0:
                continue
            if null < 0:
                null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, fd)
            except OSError:
                continue
    finally:
        if null >= 0:
            os.close(null)


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    # Copied first: a callback may register new objects (a fresh heartbeat, say).
    calls: list[Callable[[], None]] = list(_functions)
    calls += [partial(function, obj) for obj, functions in list(_methods.items()) for function in functions]
    for call in calls:
        try:
            call()
        except Exception:  # one failed reset must not leave the others undone
            logger.exception("resetting %r after fork failed", call)


os.register_at_fork(after_in_child=_after_fork_in_child)
