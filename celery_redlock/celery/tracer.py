"""The tracer invariant: which call of a locked task is its run, and what a skipped run returns.

Celery's tracer calls a task's ``__call__`` once per run. A locked run's release happens as that
call ends (:func:`run_and_finish`); a skipped run's call returns the skip marker without running
the body. A call of the task from inside its own body is a direct call, never a run. What a run
knows of itself (entered, skipped, held) is its :class:`.runstate.RunState`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.states import FAILURE, IGNORED, REJECTED, RETRY, SUCCESS

from .runstate import RunState, run_of

# The key of the marker a skipped run returns as its result (see is_skipped).
SKIPPED = "redlock_skipped"


def is_skipped(result: Any) -> bool:
    """Whether a task's result is the marker of a run skipped by ``lock_contended="skip"``."""
    return isinstance(result, dict) and result.get(SKIPPED) is True


def resolve_run(cls: type) -> tuple[Callable[..., Any] | None, bool]:
    """The task's body function and whether it takes the task as first argument."""
    for klass in cls.__mro__:
        if "run" in klass.__dict__:
            if klass is Task:
                return None, False
            raw = klass.__dict__["run"]
            if isinstance(raw, staticmethod):
                return raw.__func__, False
            return raw, True
    return None, False


def call_ahead_of_mixin(cls: type, mixin: type) -> Any:
    """The ``__call__`` ``cls`` resolves to, when a class ahead of the mixin in its MRO defines
    it; None when it is ours (Celery's own, behind the mixin, is reached through ours)."""
    for klass in cls.__mro__:
        if klass is mixin:
            return None
        if "__call__" in klass.__dict__:
            return klass.__dict__["__call__"]
    return None


def ended_state(exc: BaseException) -> str:
    """The state the tracer will give a run whose body raised ``exc``."""
    if isinstance(exc, Retry):
        return str(RETRY)
    if isinstance(exc, Ignore):
        return str(IGNORED)
    if isinstance(exc, Reject):
        return str(REJECTED)
    return str(FAILURE)


def run_and_finish(task: Any, run: RunState, body: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``body(*args, **kwargs)``, the body of the tracer's call of the locked ``run``; its lock is
    released as it ends, whichever way but a retry (see task.py's INVARIANT: the release happens
    before the tracer reports the run; a retried run's, right after its RETRY state is stored).
    try/finally costs nothing on the way through."""
    state = FAILURE
    try:
        result = body(*args, **kwargs)
        state = SUCCESS
        return result
    except BaseException as exc:
        state = ended_state(exc)
        raise
    finally:
        if state != RETRY:
            task._redlock_finish(state, run)


def guard_call(own_call: Callable[..., Any]) -> Callable[..., Any]:
    """``own_call`` (a subclass's ``__call__``), preceded by the skip check."""

    @functools.wraps(own_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = run_of(self.request_stack.top)
        if run is None or run.entered:
            return own_call(self, *args, **kwargs)  # no run, or a call from inside a run's body
        if run.skip is not None:
            return run.enter()[0]
        if run.held is None:
            return own_call(self, *args, **kwargs)  # not a locked run
        # The tracer's call of a locked run. ``own_call`` may reach our __call__ or call ``run``
        # itself: either way the release happens here, as the body ends, before the tracer
        # reports.
        run.guard()
        return run_and_finish(self, run, own_call, self, *args, **kwargs)

    __call__._redlock_guarded = True  # type: ignore[attr-defined]
    return __call__
