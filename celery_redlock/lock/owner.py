"""Who may re-enter a reentrant lock: the *owner*, i.e. the execution context that acquired it.

:func:`current_owner` answers, in this order:

1. an explicit scope opened by :func:`open_scope` (Celery opens one per task execution), honoured
   only in the process, the thread and the asyncio task it was opened in;
2. the running asyncio task of this thread, if any;
3. the thread (under gevent or eventlet, the green thread: their patched ``threading.local``).

Why the checks in 1: contexts are *copied* (``asyncio.create_task``, ``asyncio.to_thread``,
``contextvars.copy_context().run``); a bare ContextVar would let a task or thread started inside a
``with`` block re-enter a lock it never took. Ids are never reused: a thread's id lives in its
``threading.local`` (not its ident, which a new thread may get again), a task's in a weak
dictionary, and all carry a per-process salt drawn again after fork, so a child is another owner.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import weakref
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

from .._fork import on_fork_in_child, pid


@dataclass(frozen=True)
class OwnerScope:
    id: str
    pid: int
    thread: object  # the opening thread's marker (see _marker)
    task: object  # the asyncio task it was opened in, or None


_scope: ContextVar[OwnerScope | None] = ContextVar("celery_redlock_owner_scope", default=None)
_local = threading.local()
_tasks: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_counter = itertools.count(1)
_salt = os.urandom(6).hex()


def _new_salt() -> None:
    global _salt
    _salt = os.urandom(6).hex()
    _tasks.clear()


on_fork_in_child(_new_salt)


def _next_id(kind: str) -> str:
    return f"{_salt}:{kind}{next(_counter)}"


def _marker() -> object:
    """This thread's marker and id, made on first use (a new thread never inherits them)."""
    marker = getattr(_local, "marker", None)
    if marker is None or getattr(_local, "salt", None) != _salt:
        marker = object()
        _local.marker, _local.salt, _local.id = marker, _salt, _next_id("thread")
    return marker


def _current_task() -> object:
    asyncio = sys.modules.get("asyncio")  # never imported here: no loop, no task
    if asyncio is None:
        return None
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop in this thread
        return None


def current_owner() -> str:
    """The id of the execution context asking (see the module docstring)."""
    marker = _marker()
    task = _current_task()
    scope = _scope.get()
    if scope is not None and scope.pid == pid() and scope.thread is marker and scope.task is task:
        return scope.id
    if task is not None:
        owner = _tasks.get(task)
        if owner is None:
            owner = _tasks[task] = _next_id("task")
        return owner
    return str(_local.id)


def open_scope() -> Token[OwnerScope | None]:
    """Make the code that runs from here in this context one owner of its own, until
    :func:`close_scope` with the returned token (one Celery task execution, say)."""
    return _scope.set(OwnerScope(_next_id("scope"), pid(), _marker(), _current_task()))


def close_scope(token: Token[OwnerScope | None]) -> None:
    _scope.reset(token)
