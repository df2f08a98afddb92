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
failure, in :meth:`retry` before the retry is published (so the retried run can take it), and by
the ``task_postrun`` hook for ignore and reject, which ``after_return`` does not see. Releases
from ``after_return`` and the hook may linger up to ``redlock_release_linger`` to travel with
this process's next command to the masters; the retry, revoke and shutdown ones go at once.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Retry
from celery.states import IGNORED, SUCCESS

from . import hooks, signals
from .errors import ConfigError, LockNotAcquired
from .heartbeat import process_heartbeat
from .keys import KeySpec, LockKey, compile_lock_key
from .redlock import Lock
from .settings import (
    CONTENDED_POLICIES,
    RELEASE_POLICIES,
    RedlockSettings,
    app_redlock,
    choice,
    count_or_none,
    positive,
)
from .slots import PUBLISHED_HEADER, SLOT_SEPARATOR, slot_name

logger = logging.getLogger("celery_redlock.task")

ATTEMPT_HEADER = "redlock_attempt"
hooks.connect()  # idempotent; makes the release and publish hooks part of defining a task
_REQUEST_ATTR = "_redlock_held"


@dataclass
class Held:
    """The lock one execution holds, and when it got it."""

    lock: Lock
    task_id: str
    acquired_at: float
    expire: bool
    finished: bool = False

    @property
    def held_for(self) -> float:
        return time.monotonic() - self.acquired_at


@dataclass(frozen=True)
class LockOptions:
    """One task's lock options, with the app's settings filled in."""

    ttl: float
    contended: str
    retry_backoff: float
    retry_backoff_max: float
    max_retries: int | None
    heartbeat: bool
    heartbeat_interval: float | None
    max_hold: float | None
    release: str
    slot: Any


# Every lock held by an execution in this process: released at worker (process) shutdown and on
# revoke-with-terminate, when no after_return will run.
_held: dict[str, Held] = {}
_held_mutex = threading.Lock()


def held_locks() -> list[Held]:
    with _held_mutex:
        return list(_held.values())


def release_all(reason: str) -> int:
    """Release every lock held in this process (a shutting-down worker); how many there were."""
    with _held_mutex:
        entries = list(_held.values())
        _held.clear()
    for entry in entries:
        process_heartbeat().forget(entry.lock)
        try:
            entry.lock.release(linger=False)
        except Exception:  # one unreachable quorum must not keep the others held
            logger.exception("releasing %s at %s failed", entry.lock.name, reason)
        else:
            logger.warning("released lock %s of task %s: %s", entry.lock.name, entry.task_id, reason)
    return len(entries)


def release_task(task_id: str, reason: str) -> bool:
    """Release the lock held in this process by execution ``task_id``, if any."""
    with _held_mutex:
        entry = _held.pop(task_id, None)
    if entry is None:
        return False
    process_heartbeat().forget(entry.lock)
    entry.lock.release(linger=False)
    logger.warning("released lock %s of task %s: %s", entry.lock.name, task_id, reason)
    return True


def finish_after_run(task: Any, task_id: str | None, state: str) -> None:
    """``task_postrun``: release what ``after_return`` did not (an ignored, rejected or
    terminated run). Every task of the process ends here, locked or not, and after_return has
    nearly always released already: a look in the registry is all that costs."""
    if task_id is not None and task_id in _held and isinstance(task, RedlockTaskMixin):
        task._redlock_finish(state)


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
    lock_retry_backoff: float | None = None
    lock_retry_backoff_max: float | None = None
    lock_max_retries: int | None = None
    lock_heartbeat: bool = True
    lock_heartbeat_interval: float | None = None
    lock_max_hold: float | None = None
    lock_release: str = "on_return"
    lock_slot: Any = None

    _redlock_key: LockKey | None = None
    _redlock_options: tuple[int, LockOptions] | None = None

    # Provided by celery.Task; declared for the type checker.
    name: str
    app: Any
    request: Any
    time_limit: float | None
    acks_late: bool

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        func, bound = _resolve_run(cls)
        if func is None:
            return  # an abstract base: nothing to bind against yet
        task_name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}"
        cls._redlock_key = compile_lock_key(cls.lock_key, func, task_name, bound=bound)
        cls._redlock_options = None
        _check_static_options(cls, task_name)

    # -- the current execution's lock -------------------------------------------------------------
    @property
    def redlock(self) -> Lock | None:
        """The lock the current execution holds (or held), else None."""
        held: Held | None = getattr(self.request, _REQUEST_ATTR, None)
        return held.lock if held is not None else None

    def lock_name(self, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The resource name a call with these arguments locks (without the slot)."""
        if self.lock_key is None:
            return self.name
        key = self._redlock_key
        if key is None:
            raise ConfigError(f"task {self.name!r}: lock_key was not compiled")
        return key.render(tuple(args), kwargs or {})

    def lock_options(self, settings: RedlockSettings) -> LockOptions:
        cached = self._redlock_options
        if cached is not None and cached[0] == id(settings):
            return cached[1]
        options = _resolve_options(self, settings)
        type(self)._redlock_options = (id(settings), options)
        return options

    # -- lifecycle ----------------------------------------------------------------------------------
    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        parent = getattr(super(), "before_start", None)
        if parent is not None:
            parent(task_id, args, kwargs)
        self._redlock_acquire(task_id, args, kwargs)

    def after_return(self, status: str, retval: Any, task_id: str, args: tuple[Any, ...],
                     kwargs: dict[str, Any], einfo: Any) -> None:
        try:
            self._redlock_finish(status)
        finally:
            parent = getattr(super(), "after_return", None)
            if parent is not None:
                parent(status, retval, task_id, args, kwargs, einfo)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's retry, releasing the lock first so the retried run can take it.

        The retried run starts its lock attempts afresh: the lock retries this run needed
        before it got in are not charged to the next one's ``lock_max_retries``.
        """
        # At once, not lingering: the retry may be picked up by another worker straight away.
        self._redlock_finish("RETRY", linger=False)
        if _header(self.request, ATTEMPT_HEADER):
            headers = dict(getattr(self.request, "headers", None) or {})
            headers.update(kwargs.get("headers") or {})
            headers[ATTEMPT_HEADER] = 0
            kwargs["headers"] = headers
        return super().retry(*args, **kwargs)  # type: ignore[misc]

    # -- the work ---------------------------------------------------------------------------------
    def _redlock_acquire(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        settings, redlock = app_redlock(self.app)
        options = self.lock_options(settings)
        name = self.lock_name(args, kwargs)
        request = self.request  # a lookup through Celery's request stack each time
        if options.slot is not None:
            published = _header(request, PUBLISHED_HEADER)
            if published is None:
                raise ConfigError(
                    f"task {self.name!r}: lock_slot needs the {PUBLISHED_HEADER!r} message header, "
                    "added at publish time by celery_redlock.hooks (import celery_redlock in the "
                    "publishing process)"
                )
            name = f"{name}{SLOT_SEPARATOR}{slot_name(options.slot, float(published))}"
        lock = redlock.lock(name, options.ttl)
        started = time.monotonic()
        if lock.acquire(blocking=False):
            held = Held(lock, task_id, time.monotonic(), options.release == "on_expiry")
            setattr(request, _REQUEST_ATTR, held)
            with _held_mutex:
                _held[task_id] = held
            if options.heartbeat:
                process_heartbeat().keep(
                    lock, interval=options.heartbeat_interval, max_hold=options.max_hold,
                    on_lost=self._redlock_on_lost(task_id, held),
                )
            if signals.lock_acquired.receivers:  # the hot path: no payload when nobody listens
                signals.lock_acquired.send(
                    sender=self, key=name, task_id=task_id, token=lock.token, ttl=lock.ttl,
                    validity=lock.validity, elapsed=held.acquired_at - started,
                )
            logger.debug("task %s[%s] acquired %s", self.name, task_id, name)
            return
        error = lock.last_error
        assert error is not None
        self._redlock_contended(task_id, name, options, error)

    def _redlock_contended(self, task_id: str, name: str, options: LockOptions,
                           error: LockNotAcquired) -> None:
        attempt = int(_header(self.request, ATTEMPT_HEADER) or 0)
        why = "held by another run" if error.held_by_other else "no quorum of masters answered"
        policy = options.contended
        if policy == "retry" and options.max_retries is not None and attempt >= options.max_retries:
            policy = "exhausted"
        countdown = 0.0
        if policy == "retry":
            ceiling = min(options.retry_backoff_max, options.retry_backoff * 2.0 ** attempt)
            countdown = random.uniform(0.0, ceiling)
        signals.lock_contended.send(sender=self, key=name, task_id=task_id, policy=policy,
                                    attempt=attempt, countdown=countdown, error=error)
        if policy == "retry":
            logger.info("task %s[%s]: lock %s %s; retry %d in %.2f s", self.name, task_id, name,
                        why, attempt + 1, countdown)
            raise self._redlock_retry(attempt + 1, countdown, error)
        if policy == "skip":
            logger.warning("task %s[%s] skipped: lock %s %s", self.name, task_id, name, why)
            self.backend.store_result(  # type: ignore[attr-defined]
                task_id, {"skipped": "lock contended", "key": name, "reason": why,
                          "votes": [v.as_dict() for v in error.votes]},
                IGNORED, request=self.request,
            )
            raise Ignore(f"lock {name} {why}")
        if policy == "exhausted":
            logger.error("task %s[%s] failed: lock %s %s after %d lock retries", self.name, task_id,
                         name, why, attempt)
            raise LockNotAcquired(name, error.votes, attempts=attempt + 1, elapsed=error.elapsed,
                                  validity=error.validity, quorum=error.quorum)
        logger.warning("task %s[%s] failed: lock %s %s", self.name, task_id, name, why)
        raise error

    def _redlock_retry(self, attempt: int, countdown: float, error: LockNotAcquired) -> Retry:
        """Publish the same message again, later, without spending the task's own retries."""
        request = self.request
        headers = dict(getattr(request, "headers", None) or {})
        headers[ATTEMPT_HEADER] = attempt
        published = _header(request, PUBLISHED_HEADER)
        if published is not None:
            headers[PUBLISHED_HEADER] = published  # the slot is the original publish's
        sig = self.signature_from_request(  # type: ignore[attr-defined]
            request, None, None, countdown=countdown, retries=request.retries, headers=headers,
        )
        sig.apply_async()
        return Retry(f"lock contended (attempt {attempt})", exc=error, when=countdown, sig=sig)

    def _redlock_on_lost(self, task_id: str, held: Held) -> Callable[[Lock, str], None]:
        def on_lost(lock: Lock, reason: str) -> None:
            logger.error("task %s[%s]: lock %s lost after %.1f s: %s", self.name, task_id,
                         lock.name, held.held_for, reason)
            signals.lock_lost.send(sender=self, key=lock.name, task_id=task_id, reason=reason,
                                   held_for=held.held_for)

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
        with _held_mutex:
            if _held.get(held.task_id) is held:
                del _held[held.task_id]
        process_heartbeat().forget(held.lock)
        expire = held.expire and state == SUCCESS
        if not expire:
            held.lock.release(linger=linger)
        if signals.lock_released.receivers:
            signals.lock_released.send(sender=self, key=held.lock.name, task_id=held.task_id,
                                       held_for=held.held_for, state=state, expire=expire)
        logger.debug("task %s[%s] %s %s", self.name, held.task_id,
                     "left to expire" if expire else "released", held.lock.name)


class RedlockTask(RedlockTaskMixin, Task):  # type: ignore[misc]
    """A Celery task locked per resource with Redlock; use as ``@app.task(base=RedlockTask, ...)``."""

    abstract = True


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def _check_static_options(cls: type[RedlockTaskMixin], task_name: str) -> None:
    """Fail at class creation on option values that are wrong whatever the settings."""

    def name(option: str) -> str:
        return f"task {task_name!r}: {option}"

    if cls.lock_ttl is not None:
        positive(name("lock_ttl"), cls.lock_ttl)
    if cls.lock_contended is not None:
        choice(name("lock_contended"), cls.lock_contended, CONTENDED_POLICIES)
    for option in ("lock_retry_backoff", "lock_retry_backoff_max"):
        positive(name(option), getattr(cls, option), allow_none=True, allow_zero=True)
    count_or_none(name("lock_max_retries"), cls.lock_max_retries)
    positive(name("lock_heartbeat_interval"), cls.lock_heartbeat_interval, allow_none=True)
    positive(name("lock_max_hold"), cls.lock_max_hold, allow_none=True)
    choice(name("lock_release"), cls.lock_release, RELEASE_POLICIES)
    if not isinstance(cls.lock_heartbeat, bool):
        raise ConfigError(f"{name('lock_heartbeat')} must be True or False, got {cls.lock_heartbeat!r}")
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
        raise ConfigError(f"task {task.name!r}: heartbeat interval {interval} s must be shorter than "
                          f"the lock TTL {ttl} s, or every lock expires between two beats")
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
        retry_backoff=(task.lock_retry_backoff if task.lock_retry_backoff is not None
                       else settings.retry_backoff),
        retry_backoff_max=(task.lock_retry_backoff_max if task.lock_retry_backoff_max is not None
                           else settings.retry_backoff_max),
        max_retries=(task.lock_max_retries if task.lock_max_retries is not None
                     else settings.max_retries),
        heartbeat=task.lock_heartbeat,
        heartbeat_interval=interval,
        max_hold=max_hold,
        release=task.lock_release,
        slot=slot,
    )


def _beat_schedule_of(task: RedlockTaskMixin) -> Any:
    entries = [
        entry.get("schedule") for entry in (task.app.conf.beat_schedule or {}).values()
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
