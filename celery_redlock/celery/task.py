"""``RedlockTask``: a Celery task that runs at most once at a time per resource, fleet-wide.

    @app.task(base=RedlockTask, lock_key="invoice:<invoice_id>", lock_ttl=60.0)
    def charge(invoice_id, amount=0): ...

Where the lock is taken, and why there: in ``before_start``, which Celery's tracer calls in the
executing worker right before the body. Every way a task reaches a worker (``delay``, beat,
``send_task``, canvas members, broker redeliveries) passes through it, and raising ``Retry`` or
``Ignore`` from it ends the run without running the body, with the state Celery already knows
how to record. Overriding ``__call__`` is not needed and would also lock direct calls.

Per-execution state (the :class:`Lock` and its timings) hangs off ``self.request``, which Celery
keeps per execution and per thread; the task instance is shared by every thread of a threads pool.

The lock is released after the body whatever the outcome: in ``after_return`` for success and
failure, and by the ``task_postrun`` hook for retry, ignore and reject, which ``after_return``
does not see (so a body that calls ``self.retry()`` keeps its lock until it has really ended).
Releases from ``after_return`` and the hook may linger up to ``redlock_release_linger`` to travel
with this process's next command to the masters; the retry, revoke and shutdown ones go at once.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import random
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import Task
from celery import signals as celery_signals
from celery.exceptions import Ignore, Retry
from celery.states import RETRY, SUCCESS

from .._fork import pid
from .._validate import choice, count, flag, number
from ..errors import ConfigError, LockNotAcquired, NotLocked
from ..lock.heartbeat import process_heartbeat
from ..lock.holder import describe_holder
from ..lock.owner import close_scope, open_scope
from ..lock.reentrant import ReentrantLock, forget_holding
from ..lock.resource import Lock
from . import enqueue, hooks, signals
from . import held as registry
from .held import Held
from .keys import KeySpec, LockKey, compile_lock_key
from .settings import (
    CONTENDED_POLICIES,
    RELEASE_POLICIES,
    RedlockSettings,
    app_settings_and_redlock,
    wait_timeout_setting,
)
from .slots import PUBLISHED_HEADER, SLOT_HEADER, SLOT_SEPARATOR, read_stamp, slot_name, slot_period

logger = logging.getLogger("celery_redlock.task")

ATTEMPT_HEADER = "redlock_attempt"
_REQUEST_ATTR = "_redlock_held"
# The owner scope a reentrant run opened (see lock/owner.py), closed when it ends.
_SCOPE_ATTR = "_redlock_scope"
# Set on the request of a run skipped by lock_contended="skip": the marker its body returns.
_SKIP_ATTR = "_redlock_skipped"
# Set on a marked request once the tracer's call of the run has begun (see _enter_run).
_ENTERED_ATTR = "_redlock_entered"
# The key of the marker a skipped run returns as its result (see is_skipped).
SKIPPED = "redlock_skipped"
_HOST = json.dumps(socket.gethostname())


@dataclass(frozen=True)
class LockOptions:
    """One task's lock options, with the app's settings filled in."""

    ttl: float
    contended: str
    reentrant: bool
    fenced: bool
    wait_timeout: float
    retry_backoff: float
    retry_backoff_max: float
    max_retries: int | None
    heartbeat: bool
    heartbeat_interval: float | None
    max_hold: float | None
    release: str
    slot: Any

    def backoff(self, attempt: int) -> float:
        """The wait before lock retry ``attempt + 1``: full jitter under a doubling ceiling."""
        return random.uniform(0.0, min(self.retry_backoff_max, self.retry_backoff * 2.0**attempt))


def _resolve_run(cls: type) -> tuple[Callable[..., Any] | None, bool]:
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


class RedlockTaskMixin:
    """Adds the lock to any Celery task base: ``class Mine(RedlockTaskMixin, MyBase)``.

    Task options (class attributes, or ``@app.task(...)`` keywords); ``None`` means the
    app's ``redlock_*`` setting. See ``docs/settings.md``.
    """

    lock_key: KeySpec = None
    lock_ttl: float | None = None
    lock_contended: str | None = None
    lock_reentrant: bool | None = None
    # True: every grant carries a fence (self.redlock.fence) the resource can check; see fenced.py.
    lock_fenced: bool | None = None
    lock_wait_timeout: float | None = None
    lock_retry_backoff: float | None = None
    lock_retry_backoff_max: float | None = None
    lock_max_retries: int | None = None
    lock_heartbeat: bool = True
    lock_heartbeat_interval: float | None = None
    lock_max_hold: float | None = None
    lock_release: str = "on_return"
    lock_slot: Any = None
    lock_enqueue: str | bool | None = None
    lock_enqueue_ttl: float | None = None

    _redlock_key: LockKey | None = None
    _redlock_options: tuple[int, LockOptions] | None = None
    _redlock_unstamped_logged = False
    _redlock_custom_call = False  # see __init_subclass__

    # Provided by celery.Task; declared for the type checker.
    name: str
    app: Any
    request: Any
    time_limit: float | None
    acks_late: bool

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass's own __call__ comes before ours in the MRO, and may call ``run`` itself: a
        # skipped run must return its marker before any of it runs, or its body runs unlocked.
        own_call = cls.__dict__.get("__call__")
        if own_call is not None and not getattr(own_call, "_redlock_guarded", False):
            cls.__call__ = _guard_call(own_call)  # type: ignore[method-assign]
        func, bound = _resolve_run(cls)
        if func is None:
            return  # an abstract base: nothing to bind against yet
        _connect_hooks()
        # A user's base with a __call__ of its own (a wrapper around every run) is called as the
        # tracer would have called it without us; Celery's own __call__ is skipped, as the tracer
        # skips it, for a run it traces.
        cls._redlock_custom_call = any(
            "__call__" in klass.__dict__
            for klass in cls.__mro__
            if klass is not RedlockTaskMixin and not klass.__module__.startswith("celery.")
        )
        task_name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}"
        cls._redlock_key = compile_lock_key(cls.lock_key, func, task_name, bound=bound)
        cls._redlock_options = None
        _check_static_options(cls, task_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The body, or, for a run skipped by ``lock_contended="skip"``, its marker instead.

        Defining ``__call__`` makes Celery's tracer call the task rather than its ``run``. The
        tracer's one call of a run (its request marked in before_start, not yet entered) returns
        the skip marker or calls ``run`` as the tracer would; any later call under that request is
        a direct call from the body, and anything else (``charge(42)``) is Celery's own
        ``__call__``, which gives the call a request of its own.
        """
        marker, traced = _enter_run(self)
        if marker is not None:
            return marker
        if traced and not self._redlock_custom_call:
            return self.run(*args, **kwargs)  # type: ignore[attr-defined]
        return super().__call__(*args, **kwargs)  # type: ignore[misc]

    # -- publish (see enqueue.py) -----------------------------------------------------------------
    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``; with ``lock_enqueue``, a call whose resource is already
        queued or running publishes nothing (see :mod:`.enqueue`)."""
        if self.lock_enqueue is False:
            return super().apply_async(args, kwargs, task_id, **options)  # type: ignore[misc]
        return enqueue.apply_async(self, super().apply_async, args, kwargs, task_id, options)  # type: ignore[misc]

    def is_queued(self, *args: Any, **kwargs: Any) -> bool:
        """Whether a task is queued or running for the resource these arguments name (one
        round to the masters; nothing is published)."""
        return enqueue.is_queued(self, args, kwargs)

    def queued_task_id(self, *args: Any, **kwargs: Any) -> str | None:
        """The id of the task queued or running for the resource these arguments name, or None."""
        return enqueue.queued_task_id(self, args, kwargs)

    # -- the current execution's lock -------------------------------------------------------------
    @property
    def redlock(self) -> Lock:
        """The lock the current execution holds (or held, once it has ended).

        Raises :class:`NotLocked` outside a locked run, saying why: a direct call ``charge(42)``
        is the plain function, as everywhere in Celery, and takes no lock; reading ``None`` here
        instead let ``self.redlock.ensure()`` fail as an AttributeError.
        """
        request = self.request
        held: Held | None = getattr(request, _REQUEST_ATTR, None)
        if held is None:
            raise NotLocked(_not_locked_why(self, request))
        return held.lock

    def lock_name(self, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The resource name a call with these arguments locks (without the slot)."""
        if self.lock_key is None:
            return self.name
        key = self._redlock_key
        if key is None:
            raise ConfigError(f"task {self.name!r}: lock_key was not compiled")
        return key.render(tuple(args), kwargs or {})

    def lock_options(self, settings: RedlockSettings) -> LockOptions:
        """This task's options over ``settings``, cached per task class until the app's settings
        are read anew (a change to ``app.conf``), which gives them a new ``generation``."""
        cached = self._redlock_options
        if cached is not None and cached[0] == settings.generation:
            return cached[1]
        options = _resolve_options(self, settings)
        type(self)._redlock_options = (settings.generation, options)
        return options

    # -- lifecycle ----------------------------------------------------------------------------------
    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        parent = getattr(super(), "before_start", None)
        if parent is not None:
            parent(task_id, args, kwargs)
        self._redlock_acquire(task_id, args, kwargs)

    def after_return(
        self,
        status: str,
        retval: Any,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        einfo: Any,
    ) -> None:
        try:
            self._redlock_finish(status)
        finally:
            parent = getattr(super(), "after_return", None)
            if parent is not None:
                parent(status, retval, task_id, args, kwargs, einfo)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's retry; the lock stays held until the body has ended.

        Celery may decide not to retry (``MaxRetriesExceededError``, caught by the body to run a
        fallback), and ``retry(throw=False)`` returns into the body: both still run under the
        lock. It is released when the run ends (``task_postrun``), at once; a retried copy that
        arrives before then finds this very task's lock and waits for it (see _redlock_contended).

        The retried run starts its lock attempts afresh: the lock retries this run needed
        before it got in are not charged to the next one's ``lock_max_retries``.
        """
        if _header(self.request, ATTEMPT_HEADER):
            headers = dict(getattr(self.request, "headers", None) or {})
            headers.update(kwargs.get("headers") or {})
            headers[ATTEMPT_HEADER] = 0
            kwargs["headers"] = headers
        return super().retry(*args, **kwargs)  # type: ignore[misc]

    # -- the work ---------------------------------------------------------------------------------
    def _redlock_acquire(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        settings, redlock = app_settings_and_redlock(self.app)
        options = self.lock_options(settings)
        name = self.lock_name(args, kwargs)
        request = self.request  # a lookup through Celery's request stack each time
        if options.slot is not None:
            name = f"{name}{SLOT_SEPARATOR}{self._redlock_slot(request, options.slot)}"
        # Who holds it, stored beside the token in the same SET: a contender tells an earlier
        # attempt of its own task from a duplicate, and an operator sees which task, where,
        # since when and for how long a TTL (the record lock.admin reads; see lock/holder.py).
        holder = (
            f'{{"task":{json.dumps(task_id)},"name":{_json_name(self)},"host":{_HOST},"pid":{pid()},'
            f'"since":{time.time():.3f},"ttl":{options.ttl:g}}}'
        )
        lock: Lock | ReentrantLock
        if options.reentrant:
            # This execution is one owner: code its body calls re-enters through app_redlock(app).
            setattr(request, _SCOPE_ATTR, open_scope())
            lock = redlock.lock(name, options.ttl, holder=holder, reentrant=True)
        elif options.fenced:
            lock = redlock.lock(name, options.ttl, holder=holder, fenced=True)
        else:
            # Taken over from its message's marker, if it carries one (lock_enqueue).
            lock = enqueue.run_lock(redlock, request, name, options.ttl, holder)
        started = time.monotonic()
        if lock.acquire(blocking=False):
            self._redlock_hold(lock, task_id, options, started)
            return
        error = lock.last_error
        assert error is not None
        try:
            self._redlock_contended(task_id, lock, options, error, started)
        finally:
            if options.reentrant and getattr(request, _REQUEST_ATTR, None) is None:
                _close_scope(request)  # not held (retried, skipped, failed): the scope ends here

    def _redlock_hold(
        self, acquired: Lock | ReentrantLock, task_id: str, options: LockOptions, started: float
    ) -> None:
        """Record the lock this run has just acquired, and keep it alive while the body runs."""
        # A reentrant lock is kept by its holding's inner Lock, which any thread may extend or
        # release (the view answers only for the owner asking).
        lock = acquired.holding() if isinstance(acquired, ReentrantLock) else acquired
        assert lock is not None
        held = Held(
            lock,
            task_id,
            time.monotonic(),
            options.release == "on_expiry",
            linger=options.contended != "wait",
            reentrant=isinstance(acquired, ReentrantLock),
        )
        setattr(self.request, _REQUEST_ATTR, held)
        registry.register(held)
        if options.heartbeat:
            process_heartbeat().keep(
                lock,
                interval=options.heartbeat_interval,
                max_hold=options.max_hold,
                on_lost=self._redlock_on_lost(task_id, held),
            )
        if signals.lock_acquired.receivers:  # the hot path: no payload when nobody listens
            signals.lock_acquired.send(
                sender=self,
                key=lock.name,
                task_id=task_id,
                token=lock.token,
                ttl=lock.ttl,
                validity=lock.validity,
                elapsed=held.acquired_at - started,
                fence=lock.fence if lock.fenced else None,
            )
        logger.debug("task %s[%s] acquired %s", self.name, task_id, lock.name)

    def _redlock_slot(self, request: Any, spec: Any) -> str:
        """The slot this run belongs to: the beat's stamp, taken as it is, when the message has
        one; else computed from the publish time (see :mod:`.slots` for what that cannot know)."""
        stamp = _header(request, SLOT_HEADER)
        if stamp is not None:
            slot = read_stamp(stamp)
            if slot is not None:
                return slot
            # Only a foreign publisher writes a header of that name wrongly; the run still
            # belongs somewhere, and the publish time is the next best witness.
            logger.warning(
                "task %s: %s header %r is not an ISO 8601 time with its UTC offset; the slot "
                "comes from the publish time instead",
                self.name,
                SLOT_HEADER,
                stamp,
            )
        published = _header(request, PUBLISHED_HEADER)
        if published is None:
            published = self._redlock_unstamped_time(request)
        return slot_name(spec, float(published))

    def _redlock_unstamped_time(self, request: Any) -> float:
        """The time that places a message without our publish stamp in its ``lock_slot``.

        A publisher that does not run celery_redlock's hooks (a ``send_task`` from another
        codebase) sends no ``redlock_published`` header, and a Celery message carries no send time
        of its own. Its ``eta``, when it has one, is the same in every copy of the message and
        names the moment it was meant for; otherwise the worker's clock as the run starts, which
        puts a run that waited in the queue past half a period (or a copy redelivered that late)
        in a later slot than its publish. The time is kept on the request as if it had been
        stamped, so a lock retry re-publishes it and the retried run stays in the same slot.
        """
        at = _eta_timestamp(getattr(request, "eta", None))
        source = "its eta"
        if at is None:
            at, source = time.time(), "this worker's clock at the start of the run"
        setattr(request, PUBLISHED_HEADER, at)  # read back by _header, carried by _redlock_retry
        cls = type(self)
        if not cls._redlock_unstamped_logged:  # once per task and process: a foreign publisher
            cls._redlock_unstamped_logged = True  # sends every message this way
            logger.info(
                "task %s: a message without the %s header (its publisher does not run "
                "celery_redlock); lock_slot places it by %s (logged once per task and process)",
                self.name,
                PUBLISHED_HEADER,
                source,
            )
        return at

    def _redlock_contended(
        self,
        task_id: str,
        lock: Lock | ReentrantLock,
        options: LockOptions,
        error: LockNotAcquired,
        started: float,
    ) -> None:
        """What a run that did not get its lock does, by ``lock_contended``: retry later, skip,
        or fail. An eager run (``apply()``, ``task_always_eager``) never publishes: it waits
        in-process (see _redlock_wait_eager)."""
        request = self.request
        name = lock.name
        attempt = int(_header(request, ATTEMPT_HEADER) or 0)
        policy = options.contended
        if policy == "wait":
            if self._redlock_wait(task_id, lock, options):
                self._redlock_hold(lock, task_id, options, started)
                return
            # Not freed in time (or revoked): the wait was one attempt, and the retry policy
            # (lock_retry_backoff, lock_max_retries) takes over.
            error = lock.last_error or error
            policy = "retry"
        why = "held by another run" if error.held_by_other else "no quorum of masters answered"
        if policy == "retry" and options.max_retries is not None and attempt >= options.max_retries:
            policy = "exhausted"
        holder = None
        if policy != "retry" and error.held_by_other:
            # Off the usual path: one more round, only when the answer changes what happens.
            text = lock.redlock.holder(name)
            holder = _holder_task(text)
            error = _naming_holder(error, text)
            if text is None and policy != "exhausted":
                # Gone between the two rounds (released, expired): no one to skip or fail for,
                # so this is a contended try like any other, retried.
                policy, why = "retry", "released while its holder was asked for"
            elif holder == task_id:
                # An earlier attempt of this very task holds it: a pool child that died holding
                # it (the broker redelivered the message), or a retry published before its run
                # ended. Skipping or failing would drop the work: wait for that lock to go,
                # whatever the mode (a dead run's lock expires with its TTL).
                policy, why = "retry", "held by an earlier attempt of this same task"
        if getattr(request, "is_eager", False):
            self._redlock_wait_eager(task_id, lock, options, policy, why, attempt, started)
            return
        countdown = 0.0
        if policy == "retry":
            countdown = options.backoff(attempt)
        signals.lock_contended.send(
            sender=self,
            key=name,
            task_id=task_id,
            policy=policy,
            attempt=attempt,
            countdown=countdown,
            error=error,
        )
        if policy == "retry":
            logger.info(
                "task %s[%s]: lock %s %s; retry %d in %.2f s",
                self.name,
                task_id,
                name,
                why,
                attempt + 1,
                countdown,
            )
            raise self._redlock_retry(attempt + 1, countdown, error)
        self._redlock_give_up(task_id, name, policy, why, attempt, error, holder)

    def _redlock_wait(self, task_id: str, lock: Lock | ReentrantLock, options: LockOptions) -> bool:
        """Wait in this worker for the lock, woken by its release, up to ``lock_wait_timeout``;
        True once held. Capped so a soft time limit never fires inside the wait; ended early
        when the worker process learns the task was revoked (not under prefork without
        terminate: the child never sees the revoked set, so it waits out its timeout as a
        running body would)."""
        timeout = options.wait_timeout
        soft = getattr(self.request, "timelimit", None)
        soft_limit = (
            (soft[1] if soft and len(soft) > 1 else None)
            or getattr(self, "soft_time_limit", None)
            or self.app.conf.task_soft_time_limit  # the pool's default, app-wide
        )
        if soft_limit:
            timeout = min(timeout, max(0.0, float(soft_limit) - lock.redlock.request_timeout))
        from celery.worker import state as worker_state  # the worker's own, in this process

        revoked = worker_state.revoked
        started = time.monotonic()
        got = lock.acquire(timeout=timeout, cancelled=lambda: task_id in revoked)
        if not got and task_id in revoked:
            # Revoked while it waited: ended as a revoked run ends (no retry is published).
            logger.info("task %s[%s] revoked while it waited for %s", self.name, task_id, lock.name)
            backend: Any = self.backend  # type: ignore[attr-defined]
            backend.mark_as_revoked(task_id, "revoked while waiting for its lock", request=self.request)
            raise Ignore()
        logger.debug(
            "task %s[%s]: waited %.3f s for %s: %s",
            self.name,
            task_id,
            time.monotonic() - started,
            lock.name,
            "held" if got else "not freed in time",
        )
        return got

    def _redlock_give_up(
        self,
        task_id: str,
        name: str,
        policy: str,
        why: str,
        attempt: int,
        error: LockNotAcquired,
        holder: str | None,
    ) -> None:
        """End a run that will not get its lock: skipped (its body is replaced by the skip
        marker, see __call__), or failed with :class:`LockNotAcquired`."""
        if policy == "skip":
            logger.warning("task %s[%s] skipped: lock %s %s", self.name, task_id, name, why)
            # A success whose value says it was skipped: every part of Celery then treats it as
            # a finished run (a terminal task-succeeded event, a chord header member counted,
            # a chain's next task called with it, no result stored under ignore_result).
            marker = {SKIPPED: True, "key": name, "reason": why, "holder": holder}
            setattr(self.request, _SKIP_ATTR, marker)
            return
        if policy == "exhausted":
            logger.error(
                "task %s[%s] failed: lock %s %s after %d lock retries", self.name, task_id, name, why, attempt
            )
            raise LockNotAcquired(
                name,
                error.votes,
                attempts=attempt + 1,
                elapsed=error.elapsed,
                validity=error.validity,
                quorum=error.quorum,
                holder=error.holder,
            )
        logger.warning("task %s[%s] failed: lock %s %s", self.name, task_id, name, why)
        raise error

    def _redlock_wait_eager(
        self,
        task_id: str,
        lock: Lock | ReentrantLock,
        options: LockOptions,
        policy: str,
        why: str,
        attempt: int,
        started: float,
    ) -> None:
        """A contended eager run: retry in this process, with the same full-jitter backoff a
        worker's lock retries use, as many times as ``lock_max_retries`` allows, then end as
        the mode says. With no retry budget it waits at most one lock TTL: an eager call is a
        test or a script, which must not hang on a lock nobody releases.

        Nothing is published: a lock retry sent to the broker from an eager call would also be
        re-applied in-process by Celery, and run twice (or recurse without end)."""
        give_up_at = time.monotonic() + options.ttl
        while policy == "retry":
            error = lock.last_error
            assert error is not None
            if options.max_retries is not None and attempt >= options.max_retries:
                policy = "exhausted"
                break
            delay = options.backoff(attempt)
            if options.max_retries is None and time.monotonic() + delay > give_up_at:
                policy = "exhausted"
                break
            signals.lock_contended.send(
                sender=self,
                key=lock.name,
                task_id=task_id,
                policy="retry",
                attempt=attempt,
                countdown=delay,
                error=error,
            )
            logger.info(
                "task %s[%s] (eager): lock %s %s; retry %d in %.2f s",
                self.name,
                task_id,
                lock.name,
                why,
                attempt + 1,
                delay,
            )
            time.sleep(delay)
            attempt += 1
            if lock.acquire(blocking=False):
                self._redlock_hold(lock, task_id, options, started)
                return
        error = lock.last_error
        assert error is not None
        signals.lock_contended.send(
            sender=self,
            key=lock.name,
            task_id=task_id,
            policy=policy,
            attempt=attempt,
            countdown=0.0,
            error=error,
        )
        holder = None
        if error.held_by_other:
            text = lock.redlock.holder(lock.name)
            holder, error = _holder_task(text), _naming_holder(error, text)
        self._redlock_give_up(task_id, lock.name, policy, why, attempt, error, holder)

    def _redlock_retry(self, attempt: int, countdown: float, error: LockNotAcquired) -> Retry:
        """Publish the same message again, later, without spending the task's own retries."""
        request = self.request
        headers = dict(getattr(request, "headers", None) or {})
        headers[ATTEMPT_HEADER] = attempt
        # The retried run keeps the slot of the original message, whatever time it runs at.
        for name in (SLOT_HEADER, PUBLISHED_HEADER, enqueue.MARKER_HEADER):
            value = _header(request, name)
            if value is not None:
                headers[name] = value
        sig = self.signature_from_request(  # type: ignore[attr-defined]
            request,
            None,
            None,
            countdown=countdown,
            retries=request.retries,
            headers=headers,
        )
        sig.apply_async()
        return Retry(f"lock contended (attempt {attempt})", exc=error, when=countdown, sig=sig)

    def _redlock_on_lost(self, task_id: str, held: Held) -> Callable[[Lock, str], None]:
        def on_lost(lock: Lock, reason: str) -> None:
            logger.error(
                "task %s[%s]: lock %s lost after %.1f s: %s",
                self.name,
                task_id,
                lock.name,
                held.held_for,
                reason,
            )
            signals.lock_lost.send(
                sender=self, key=lock.name, task_id=task_id, reason=reason, held_for=held.held_for
            )

        return on_lost

    def _redlock_finish(self, state: str, *, linger: bool = True) -> None:
        """Release (or leave to expire) the current execution's lock. Idempotent.

        The release may linger up to ``redlock_release_linger`` to share this process's next
        round trip to the masters (see :mod:`celery_redlock.linger`), unless ``linger`` is false.
        """
        held: Held | None = getattr(self.request, _REQUEST_ATTR, None)
        # Kept reachable through self.redlock after the release; only the duty is dropped.
        if held is None or held.finished:
            return
        held.finished = True
        registry.unregister(held)
        process_heartbeat().forget(held.lock)
        if held.reentrant:
            # The execution's holding ends with it, whatever depth its body left behind.
            forget_holding(held.lock)
            _close_scope(self.request)
        expire = held.expire and state == SUCCESS
        if not expire and not enqueue.hand_back(self.request, held):
            # A retried run's copy may be taken by another worker at once: no lingering.
            held.lock.release(linger=linger and held.linger and state != RETRY)
        if signals.lock_released.receivers:
            signals.lock_released.send(
                sender=self,
                key=held.lock.name,
                task_id=held.task_id,
                held_for=held.held_for,
                state=state,
                expire=expire,
            )
        logger.debug(
            "task %s[%s] %s %s",
            self.name,
            held.task_id,
            "left to expire" if expire else "released",
            held.lock.name,
        )


class RedlockTask(RedlockTaskMixin, Task):  # type: ignore[misc]
    """A Celery task locked per resource with Redlock; use as ``@app.task(base=RedlockTask, ...)``."""

    abstract = True


def _not_locked_why(task: RedlockTaskMixin, request: Any) -> str:
    how = (
        "send it to a worker with .delay() or .apply_async(), or run it locked in this process with .apply()"
    )
    if getattr(request, "called_directly", True):
        if getattr(request, "args", None) is None:  # no call in progress at all
            return f"task {task.name!r} holds no lock outside a run; self.redlock is the lock of a run: {how}"
        return (
            f"task {task.name!r} was called directly, which runs the plain function in this process "
            f"with no lock (Celery's convention for calling a task object); to hold the lock, {how}"
        )
    return (
        f"task {task.name!r} run {request.id} holds no lock yet: self.redlock is set in "
        "before_start, when the lock is taken"
    )


def _eta_timestamp(eta: Any) -> float | None:
    """A message's eta (an ISO 8601 text on the wire, a datetime in some requests) in seconds
    since the epoch; a naive one is read as UTC, as Celery sends it with ``enable_utc``."""
    if isinstance(eta, str):
        try:
            eta = dt.datetime.fromisoformat(eta)
        except ValueError:
            return None
    if not isinstance(eta, dt.datetime):
        return None
    when: dt.datetime = eta if eta.tzinfo is not None else eta.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def _enter_run(task: Any) -> tuple[Any, bool]:
    """(the skip marker or None, whether this is the tracer's call) for a call of ``task``.

    The first call under a request that before_start marked is the tracer's: it is recorded as
    entered, so a call of the task from inside its own body is seen as the direct call it is.
    """
    request = task.request_stack.top
    if request is None or getattr(request, _ENTERED_ATTR, False):
        return None, False
    marker = getattr(request, _SKIP_ATTR, None)
    if marker is None and getattr(request, _REQUEST_ATTR, None) is None:
        return None, False
    setattr(request, _ENTERED_ATTR, True)
    return marker, True


def _guard_call(own_call: Callable[..., Any]) -> Callable[..., Any]:
    """``own_call`` (a subclass's ``__call__``), preceded by the skip check."""

    @functools.wraps(own_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        if request is not None and not getattr(request, _ENTERED_ATTR, False):
            marker = getattr(request, _SKIP_ATTR, None)
            if marker is not None:
                setattr(request, _ENTERED_ATTR, True)
                return marker
        return own_call(self, *args, **kwargs)

    __call__._redlock_guarded = True  # type: ignore[attr-defined]
    return __call__


def _json_name(task: Any) -> str:
    """The task's name as a JSON string, made once per task class (it goes into every holder)."""
    cls = type(task)
    cached = cls.__dict__.get("_redlock_json_name")
    if cached is None or cached[0] != task.name:
        cached = (task.name, json.dumps(task.name))
        setattr(cls, "_redlock_json_name", cached)  # noqa: B010 - on the class, not the instance
    return str(cached[1])


def _naming_holder(error: LockNotAcquired, text: str | None) -> LockNotAcquired:
    """``error`` naming who holds the lock, when a quorum agreed on one (``text``)."""
    return error if text is None else error.naming(describe_holder(text))


def _holder_task(holder: str | None) -> str | None:
    """The task id in a lock's holder text (see _redlock_acquire), if one is there."""
    if not holder:
        return None
    try:
        found = json.loads(holder).get("task")
    except (ValueError, AttributeError):
        return None  # taken by something other than a RedlockTask (a script, the CLI)
    return found if isinstance(found, str) else None


def is_skipped(result: Any) -> bool:
    """Whether a task's result is the marker of a run skipped by ``lock_contended="skip"``."""
    return isinstance(result, dict) and result.get(SKIPPED) is True


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def _close_scope(request: Any) -> None:
    """Close the owner scope a reentrant run opened, once: Celery may run the next execution in
    this thread and context, which must not be the same owner."""
    scope = getattr(request, _SCOPE_ATTR, None)
    if scope is None:
        return
    setattr(request, _SCOPE_ATTR, None)
    try:
        close_scope(scope)
    except ValueError:  # reset from another context than the one that opened it
        logger.debug("an owner scope was closed from another context", exc_info=True)


def _check_static_options(cls: type[RedlockTaskMixin], task_name: str) -> None:
    """Fail at class creation on option values that are wrong whatever the settings."""

    def name(option: str) -> str:
        return f"task {task_name!r}: {option}"

    # None means: the app's setting (or, for lock_max_hold, the task's time limit).
    for option in ("lock_ttl", "lock_heartbeat_interval", "lock_max_hold"):
        if getattr(cls, option) is not None:
            number(name(option), getattr(cls, option), above=0, unit="seconds")
    for option in ("lock_retry_backoff", "lock_retry_backoff_max"):
        if getattr(cls, option) is not None:
            number(name(option), getattr(cls, option), at_least=0, unit="seconds")
    if cls.lock_max_retries is not None:
        count(name("lock_max_retries"), cls.lock_max_retries)
    if cls.lock_reentrant is not None:
        flag(name("lock_reentrant"), cls.lock_reentrant)
    if cls.lock_fenced is not None:
        flag(name("lock_fenced"), cls.lock_fenced)
        if cls.lock_fenced and cls.lock_reentrant:
            raise ConfigError(f"task {task_name!r}: lock_fenced cannot be combined with lock_reentrant=True")
    if cls.lock_wait_timeout is not None:
        wait_timeout_setting(name("lock_wait_timeout"), cls.lock_wait_timeout)
    if cls.lock_contended is not None:
        choice(name("lock_contended"), cls.lock_contended, CONTENDED_POLICIES)
    choice(name("lock_release"), cls.lock_release, RELEASE_POLICIES)
    flag(name("lock_heartbeat"), cls.lock_heartbeat)
    enqueue.check_task_options(cls, task_name)
    if cls.lock_slot not in (None, True):
        from .slots import slot_time

        try:
            slot_time(cls.lock_slot, 0.0)
        except ConfigError as exc:
            raise ConfigError(f"task {task_name!r}: {exc}") from None


def _resolve_options(task: RedlockTaskMixin, settings: RedlockSettings) -> LockOptions:
    ttl = task.lock_ttl if task.lock_ttl is not None else settings.ttl
    interval = task.lock_heartbeat_interval or settings.heartbeat_interval
    if interval is not None and interval >= ttl:
        raise ConfigError(
            f"task {task.name!r}: heartbeat interval {interval} s must be shorter than "
            f"the lock TTL {ttl} s, or every lock expires between two beats"
        )
    max_hold = task.lock_max_hold
    if max_hold is None:
        limit = task.time_limit or task.app.conf.task_time_limit
        max_hold = float(limit) if limit else None
    slot = task.lock_slot
    if slot is True:
        slot = _beat_schedule_of(task)
    return LockOptions(
        ttl=float(ttl),
        contended=task.lock_contended or settings.contended,
        reentrant=task.lock_reentrant if task.lock_reentrant is not None else settings.reentrant,
        fenced=task.lock_fenced if task.lock_fenced is not None else settings.fenced,
        wait_timeout=task.lock_wait_timeout if task.lock_wait_timeout is not None else settings.wait_timeout,
        retry_backoff=(
            task.lock_retry_backoff if task.lock_retry_backoff is not None else settings.retry_backoff
        ),
        retry_backoff_max=(
            task.lock_retry_backoff_max
            if task.lock_retry_backoff_max is not None
            else settings.retry_backoff_max
        ),
        max_retries=(task.lock_max_retries if task.lock_max_retries is not None else settings.max_retries),
        heartbeat=task.lock_heartbeat,
        heartbeat_interval=interval,
        max_hold=max_hold,
        release=task.lock_release,
        slot=slot,
    )


def _beat_schedule_of(task: RedlockTaskMixin) -> Any:
    entries = [
        entry.get("schedule")
        for entry in (task.app.conf.beat_schedule or {}).values()
        if entry.get("task") == task.name
    ]
    schedules = {repr(s): s for s in entries}
    if len(schedules) != 1:
        found = "none" if not schedules else ", ".join(schedules)
        raise ConfigError(
            f"task {task.name!r}: lock_slot=True takes the period from the task's beat_schedule "
            f"entry, but exactly one schedule is needed (found {found}); give lock_slot the "
            "schedule itself (seconds, timedelta or crontab)"
        )
    return next(iter(schedules.values()))


def startup_checks(sender: Any = None, **_: Any) -> None:
    """``worker_init``: stop a worker whose configuration would fail every locked run.

    A worker that went ready with ``redlock_ttl=-1`` would take every locked task off the queue
    only to fail it. This runs in the main process before the pool and the consumer start, so
    ``SystemExit`` ends it at once, with the message (naming the setting) on stderr: logging is
    not set up yet, and Celery's signal dispatch swallows any ``Exception`` a receiver raises.
    """
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        problems = check_app(app)
    except ConfigError as exc:
        raise SystemExit(f"celery-redlock: the worker cannot start: {exc}") from None
    for message in problems:
        logger.warning("%s", message)


def check_app(app: Any) -> list[str]:
    """The start-up checks for ``app``.

    Raises :class:`ConfigError` for what would fail every locked run: a bad ``redlock_*``
    setting, masters the Redlock refuses, a task option the settings make invalid. It takes the
    path a locked run takes (:func:`app_redlock`, then each task's options), so nothing a run
    would refuse passes here. Returns the warnings: what works, but weakens or defeats the locks.
    """
    locked = [t for t in app.tasks.values() if isinstance(t, RedlockTaskMixin)]
    if not locked:
        return []
    settings, redlock = app_settings_and_redlock(app)
    problems = []
    if len(settings.masters) % 2 == 0:
        problems.append(
            f"redlock_masters: {len(settings.masters)} masters is even; a quorum of "
            f"{len(settings.masters) // 2 + 1} tolerates no more failures than "
            f"{len(settings.masters) - 1} would"
        )
    broker = str(app.conf.broker_url or "")
    visibility = (app.conf.broker_transport_options or {}).get("visibility_timeout", 3600)
    for task in locked:
        options = task.lock_options(settings)
        if task.lock_ttl is not None:
            # Refused by the Redlock at every acquire otherwise, under the name "ttl".
            redlock.check_ttl(f"task {task.name!r}: lock_ttl", options.ttl)
        if not options.heartbeat:
            problems.append(
                f"task {task.name!r}: lock_heartbeat is off, so its lock lasts lock_ttl "
                f"{options.ttl} s; a run longer than that is no longer exclusive"
            )
        if options.slot is not None and options.release == "on_expiry":
            period = slot_period(options.slot, time.time())
            if options.ttl < period:
                problems.append(
                    f"task {task.name!r}: lock_slot with lock_release='on_expiry' and lock_ttl "
                    f"{options.ttl:g} s, shorter than its schedule's period ({period:g} s): copies "
                    "of one tick from beats that do not share one leader (two plain beats) arrive "
                    "up to a period apart, and a copy that comes after the lock expired runs again"
                )
        acks_late = task.acks_late if task.acks_late is not None else app.conf.task_acks_late
        if acks_late and broker.startswith(("redis://", "rediss://", "redis+socket://")):
            longest = max(options.ttl, float(task.time_limit or app.conf.task_time_limit or 0))
            if visibility < longest:
                problems.append(
                    f"task {task.name!r}: acks_late with a Redis broker whose visibility_timeout "
                    f"({visibility} s) is shorter than its lock TTL or time limit ({longest} s): "
                    "the broker redelivers a running task, and the copy waits on the lock"
                )
    return problems


def _connect_hooks() -> None:
    """The worker and publish hooks, connected once a locked task is defined."""
    hooks.connect(
        (celery_signals.worker_init, startup_checks),
        (celery_signals.task_revoked, enqueue.release_revoked_marker),
    )
