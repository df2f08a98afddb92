"""One run's state: everything a run of a locked task knows about itself, in one object.

A run is one execution of the task by Celery's tracer (in a worker, or eagerly by ``apply()``):
``before_start`` acquires (or contends), the tracer's call of the task runs the body (or returns
a skipped run's marker), and the end of the body releases. :class:`RunState` holds what those
steps hand to each other, and each step is one of its methods; nothing else writes it. Other
modules read it through :func:`run_of`.

It hangs off the run's request (``task.request``) under one attribute, :data:`RUN_ATTR`: Celery
keeps a request per execution on a per-thread stack, where the task instance is shared by every
thread of a threads pool and every green thread of a gevent one.
"""

from __future__ import annotations

import logging
from contextvars import Token
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..lock.owner import OwnerScope, close_scope, open_scope
from .held import Held

if TYPE_CHECKING:
    from .settings import RedlockSettings

logger = logging.getLogger("celery_redlock.task")

#: The request attribute that holds a run's :class:`RunState`.
RUN_ATTR = "_redlock_run"

# What RunState.enter says of a call of the task: not the tracer's call of a run, the tracer's
# call, or the tracer's call made under a subclass's guarded __call__ (see tracer.guard_call).
NOT_TRACED = 0
TRACED = 1
UNDER_GUARD = 2


@dataclass(slots=True, eq=False)
class RunState:
    """The state of one run of a locked task; its methods are the run's transitions."""

    # The lock this run holds (acquired, or taken over after a wait); None while it holds none.
    held: Held | None = None
    # The owner scope a reentrant run opened (see lock/owner.py), until it is closed.
    scope: Token[OwnerScope | None] | None = None
    # The marker a run skipped by lock_contended="skip" returns instead of running its body.
    skip: dict[str, Any] | None = None
    # The tracer's call of this run has begun (see enter).
    entered: bool = False
    # A subclass's guarded __call__ runs the body, and releases as it ends (see guard).
    guarded: bool = False
    # (marker value, ttl) of the message this run re-published of itself (lock_enqueue): its
    # lock becomes that marker when it ends instead of being released (see enqueue.hand_back).
    requeue: tuple[str, float] | None = None
    # The publish time this run's slot was placed by, when its message carried none (see
    # task._redlock_unstamped_time); a lock retry carries it on, so the retry keeps the slot.
    published: float | None = None
    # The copy of this message a lock retry publishes (a Celery signature), held back until the
    # tracer has stored this run's RETRY state (see hooks.publish_lock_retry).
    retry: Any = None
    # The app's settings as the run read them as it began: every step of the run goes by these,
    # and none reads them again (a change meanwhile cannot fail a run that holds its lock).
    settings: RedlockSettings | None = None

    # -- before_start ---------------------------------------------------------------------------
    def open_scope(self) -> None:
        """A reentrant run is one owner: code its body calls re-enters through the app's lock."""
        self.scope = open_scope()

    def acquired(self, held: Held) -> None:
        """The run holds ``held`` (at once, or after a wait)."""
        self.held = held

    def skipped(self, marker: dict[str, Any]) -> None:
        """The run will not get its lock and skips: its body is replaced by ``marker``."""
        self.skip = marker

    def placed_by(self, published: float) -> None:
        """The run's slot was placed by ``published``, a time its message did not carry."""
        self.published = published

    def retry_later(self, sig: Any) -> None:
        """The run retries for its lock: ``sig`` is published once its RETRY state is stored."""
        self.retry = sig

    def take_retry(self) -> Any:
        """The lock retry still to publish, once (None: none, or published already)."""
        sig, self.retry = self.retry, None
        return sig

    # -- the tracer's call ----------------------------------------------------------------------
    def enter(self) -> tuple[Any, int]:
        """(the skip marker or None, which call this is) for a call of the task under this run's
        request.

        INVARIANT (one run, one call): the first call of the task under a request whose run is
        skipped or holds its lock is the tracer's, and is recorded here as entered; every later
        call under that request is a call from inside the body, which is a direct call: it
        neither returns the skip marker nor releases the run's lock.
        """
        if self.entered or (self.skip is None and self.held is None):
            return None, NOT_TRACED
        self.entered = True
        return self.skip, UNDER_GUARD if self.guarded else TRACED

    def guard(self) -> None:
        """A subclass's guarded __call__ runs this locked run's body, and releases as it ends:
        the mixin's own __call__, if the body reaches it, only runs the body."""
        self.guarded = True

    # -- the body (lock_enqueue) ----------------------------------------------------------------
    def requeued(self, value: str, ttl: float) -> None:
        """The run re-published itself with a marker: its lock is to become that marker."""
        self.requeue = (value, ttl)

    # -- the end --------------------------------------------------------------------------------
    def finish(self) -> Held | None:
        """The lock this run's end releases: its Held, the first time; None after that, or when
        it holds none. The Held stays readable (``self.redlock`` after the run)."""
        held = self.held
        if held is None or held.finished:
            return None
        held.finished = True
        return held

    def take_requeue(self) -> tuple[str, float] | None:
        """The re-published message's (marker value, ttl), once."""
        pending, self.requeue = self.requeue, None
        return pending

    def close_scope(self) -> None:
        """Close the owner scope a reentrant run opened, once: Celery may run the next execution
        in this thread and context, which must not be the same owner."""
        scope, self.scope = self.scope, None
        if scope is None:
            return
        try:
            close_scope(scope)
        except ValueError:  # reset from another context than the one that opened it
            logger.debug("an owner scope was closed from another context", exc_info=True)


def begin(request: Any, settings: RedlockSettings) -> RunState:
    """A new run's state, stored on its request, with the app's ``settings`` it goes by.

    INVARIANT (no state from an earlier run): the request gets a new RunState at the start of
    every run, replacing any it had. Celery makes a request per run, but a request object can
    outlive one (the task's default request, which a call outside any run reads), and nothing
    of an earlier run (its lock, its skip marker, its entered call) may pass for this one's.
    """
    run = RunState(settings=settings)
    setattr(request, RUN_ATTR, run)
    return run


def run_of(request: Any) -> RunState | None:
    """The state of the run ``request`` belongs to; None outside a run of a locked task (a
    direct call, a task without a lock, no request at all)."""
    return getattr(request, RUN_ATTR, None)
