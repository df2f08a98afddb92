"""``RedlockTask``: a Celery task that runs at most once at a time per resource, fleet-wide.

    @app.task(base=RedlockTask, lock_key="invoice:<invoice_id>", lock_ttl=60.0)
    def charge(invoice_id, amount=0): ...

Where the lock is taken, and why there: in ``before_start``, which Celery's tracer calls in the
executing worker right before the body. Every way a task reaches a worker (``delay``, beat,
``send_task``, canvas members, broker redeliveries) passes through it, and raising ``Retry`` or
``Ignore`` from it ends the run without running the body, with the state Celery already knows
how to record. Overriding ``__call__`` is not needed and would also lock direct calls.

Per-execution state (the :class:`Lock` and its timings, the skip marker, ...) is one
:class:`.runstate.RunState` per run, on ``self.request``, which Celery keeps per execution and per
thread; the task instance is shared by every thread of a threads pool.

INVARIANT (release happens-before completion): a run's lock is released, the masters' replies
received (within ``request_timeout``), as its body ends, before the tracer stores its result,
publishes its chain's next link, callbacks or chord counter, or sends its terminal event; on
success, failure, retry, ignore and reject alike. Celery does all of that before
``after_return``, so a release there would let the next step of the same resource find the
finished step's lock and be skipped, failed or retried as a duplicate. The release is therefore
made by ``__call__`` (which the tracer calls because we define it) when the body returns or
raises (:func:`.tracer.run_and_finish`). ``after_return`` and the ``task_postrun`` hook remain
as backstops for what that could not release (a subclass ``__call__`` that bypasses ours, a
terminate signal); each release is idempotent. A body that calls ``self.retry()`` still keeps
its lock until it has really ended.

INVARIANT (a retry's outcome is its copy's): a run whose body retries (``raise self.retry()``)
keeps its lock until the tracer has stored its RETRY state and run ``on_retry``, and the
``task_postrun`` hook releases it (Celery calls no ``after_return`` for RETRY; postrun is sent
whatever the store did). A retry is not the task's completion:
its copy, published by Celery before the body raised (so no crash can lose it), is the same
task going on. Released as the body ended, the copy could take the lock at once on another
worker, finish, and store SUCCESS before the RETRY it follows, which would then stand for
ever: the work done, its result never seen. Held, the copy finds its own earlier attempt on the
key and waits for it (see contend.contended).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery import Task
from celery.states import IGNORED, SUCCESS

from .._fork import pid
from ..errors import ConfigError, NotLocked, name_masters
from ..lock.heartbeat import process_heartbeat
from ..lock.reentrant import ReentrantLock, forget_holding
from ..lock.resource import Lock
from . import contend, enqueue, signals
from . import held as registry
from . import options as option_table
from .contend import ATTEMPT_HEADER, EAGER_UNAVAILABLE_WAIT
from .held import Held
from .hooks import PUBLISH_ID_HEADER, hard_time_limit
from .keys import KeySpec, LockKey, compile_lock_key
from .lockoptions import LockOptions, check_static_options, resolve_options
from .runholder import header, holder_text
from .runstate import NOT_TRACED, UNDER_GUARD, RunState, begin, run_of
from .settings import (
    RedlockSettings,
    app_settings_and_redlock,
)
from .slots import PUBLISHED_HEADER, SLOT_HEADER, SLOT_SEPARATOR, read_stamp, slot_name
from .startup import check_app, connect_hooks, probe_masters, startup_checks
from .tracer import (
    SKIPPED,
    call_ahead_of_mixin,
    guard_call,
    is_skipped,
    resolve_run,
    run_and_finish,
)

logger = logging.getLogger("celery_redlock.task")

# Where these were before the module was split; kept so that imports of this path go on working.
__all__ = [
    "ATTEMPT_HEADER",
    "EAGER_UNAVAILABLE_WAIT",
    "SKIPPED",
    "LockOptions",
    "RedlockTask",
    "RedlockTaskMixin",
    "check_app",
    "is_skipped",
    "probe_masters",
    "startup_checks",
]


class RedlockTaskMixin:
    """Adds the lock to any Celery task base: ``class Mine(RedlockTaskMixin, MyBase)``.

    Task options (class attributes, or ``@app.task(...)`` keywords); ``None`` means the
    app's ``redlock_*`` setting. See ``docs/settings.md``.
    """

    # The options (see options.py, where each is declared with its default, setting and doc;
    # install_defaults gives them their values below the class). Typed here for the checker.
    lock_key: KeySpec
    lock_ttl: float | None
    lock_contended: str | None
    lock_reentrant: bool | None
    lock_fenced: bool | None
    lock_wait_timeout: float | None
    lock_retry_backoff: float | None
    lock_retry_backoff_max: float | None
    lock_max_retries: int | None
    lock_heartbeat: bool
    lock_heartbeat_interval: float | None
    lock_max_hold: float | None
    lock_release: str
    lock_slot: Any
    lock_enqueue: str | bool | None
    lock_enqueue_ttl: float | None

    _redlock_task = True  # what startup.is_locked looks for (it cannot import this class)
    _redlock_key: LockKey | None = None
    _redlock_options: tuple[int, LockOptions] | None = None
    _redlock_unstamped_logged = False
    _redlock_custom_call = False  # see __init_subclass__

    # Provided by celery.Task; declared for the type checker.
    name: str
    app: Any
    request: Any
    request_stack: Any
    time_limit: float | None
    acks_late: bool

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if Task in mro and mro.index(Task) < mro.index(RedlockTaskMixin):
            # Celery's Task ahead of the mixin shadows every hook of ours (before_start,
            # __call__, apply_async, ...): the task would run with no lock at all.
            bases = ", ".join(b.__name__ for b in cls.__bases__)
            raise ConfigError(
                f"task class {cls.__qualname__!r} (bases {bases}): RedlockTaskMixin must come before "
                "Celery's Task in the bases, e.g. class MyBase(RedlockTaskMixin, MyTaskBase); as "
                "listed, Celery's hooks shadow the lock's and the task would run unlocked"
            )
        # A __call__ that comes before ours in the MRO (the subclass's own, or a wrapping base
        # listed before the mixin) may call ``run`` itself: a skipped run must return its marker
        # before any of it runs, or its body runs unlocked, and a locked run must be released
        # as its body ends. The __call__ the class resolves to is guarded, whichever it is.
        resolved = call_ahead_of_mixin(cls, RedlockTaskMixin)
        if resolved is not None and not getattr(resolved, "_redlock_guarded", False):
            cls.__call__ = guard_call(resolved)  # type: ignore[method-assign]
        func, bound = resolve_run(cls)
        if func is None:
            return  # an abstract base: nothing to bind against yet
        connect_hooks()
        # A user's base with a __call__ of its own (a wrapper around every run) is called as the
        # tracer would have called it without us; Celery's own __call__ is skipped, as the tracer
        # skips it, for a run it traces.
        cls._redlock_custom_call = any(
            "__call__" in klass.__dict__
            for klass in cls.__mro__
            if klass is not RedlockTaskMixin and not klass.__module__.startswith("celery.")
        )
        task_name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}"
        for klass in cls.__mro__:  # a misspelt option on the task or on a base of the user's
            if klass is RedlockTaskMixin or klass.__module__.startswith("celery."):
                continue
            option_table.refuse_unknown(klass.__dict__.items(), task_name, klass.__qualname__)
        cls._redlock_key = compile_lock_key(cls.lock_key, func, task_name, bound=bound)
        cls._redlock_options = None
        check_static_options(cls, task_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The body, or, for a run skipped by ``lock_contended="skip"``, its marker instead.

        Defining ``__call__`` makes Celery's tracer call the task rather than its ``run``. The
        tracer's one call of a run (its RunState begun in before_start, not yet entered) returns
        the skip marker or calls ``run`` as the tracer would; any later call under that request is
        a direct call from the body, and anything else (``charge(42)``) is Celery's own
        ``__call__``, which gives the call a request of its own.
        """
        run = run_of(self.request_stack.top)
        marker, traced = (None, NOT_TRACED) if run is None else run.enter()
        if marker is not None:
            return marker
        if run is None or not traced:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        if traced == UNDER_GUARD:  # a subclass's __call__ around this one releases
            return self._redlock_body(args, kwargs)
        # The tracer's call of a locked run: released as the body ends (see the module's
        # INVARIANT).
        return run_and_finish(self, run, self._redlock_body, args, kwargs)

    def _redlock_body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the body as the tracer would have without us."""
        if self._redlock_custom_call:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        return self.run(*args, **kwargs)  # type: ignore[attr-defined]

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
        """Whether a task is queued (or being published) or running for the resource these
        arguments name (one round to the masters; nothing is published). Raises
        :class:`~celery_redlock.MastersUnavailable` when too few masters answered to tell."""
        return enqueue.is_queued(self, args, kwargs)

    def queued_task_id(self, *args: Any, **kwargs: Any) -> str | None:
        """The id of the task queued or running for the resource these arguments name, or None
        (also while its publish has not returned: no message may ever carry that id). Raises
        :class:`~celery_redlock.MastersUnavailable` when too few masters answered to tell."""
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
        run = run_of(request)
        if run is None or run.held is None:
            raise NotLocked(_not_locked_why(self, request))
        return run.held.lock

    def lock_name(self, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The resource name a call with these arguments locks (without the slot); for a task
        without ``lock_key``, ``%task:<task name>``, which no template can render."""
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
        options = resolve_options(self, settings)
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
            # The run is looked up through its request, not the registry: the registry has one
            # entry per task id, and two executions of one task id in a process (a reused id
            # on a threads pool) would hide one run's lock behind the other's.
            self._redlock_finish(status)
        finally:
            parent = getattr(super(), "after_return", None)
            if parent is not None:
                parent(status, retval, task_id, args, kwargs, einfo)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's retry; the lock stays held until the body has ended.

        Celery may decide not to retry (``MaxRetriesExceededError``, caught by the body to run a
        fallback), and ``retry(throw=False)`` returns into the body: both still run under the
        lock. It is released once the run's RETRY state is stored (see the module's INVARIANT); a
        retried copy that arrives before then finds this very task's lock and waits for it (see
        contend.contended).

        The retried run starts its lock attempts afresh: the lock retries this run needed
        before it got in are not charged to the next one's ``lock_max_retries``. It carries
        this run's publish id (see :data:`.hooks.PUBLISH_ID_HEADER`): it is this run going on.
        """
        request = self.request
        publish = header(request, PUBLISH_ID_HEADER)
        if publish is not None or header(request, ATTEMPT_HEADER):
            headers = dict(getattr(request, "headers", None) or {})
            headers.update(kwargs.get("headers") or {})
            if header(request, ATTEMPT_HEADER):
                headers[ATTEMPT_HEADER] = 0
            if publish is not None:
                headers[PUBLISH_ID_HEADER] = publish
            kwargs["headers"] = headers
        return super().retry(*args, **kwargs)  # type: ignore[misc]

    def replace(self, sig: Any) -> Any:
        """Celery's replace. In an eager run the replacement runs here, inside this body, under
        the same task id: the lock is released first (the body is ending), or the replacement
        would wait for a lock its own caller holds. A worker's replacement is published and
        waits for the release at this body's end (see same_publish)."""
        if getattr(self.request, "is_eager", False):
            self._redlock_finish(str(IGNORED))
        return super().replace(sig)  # type: ignore[misc]

    # -- the work ---------------------------------------------------------------------------------
    def _redlock_acquire(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = self.request  # a lookup through Celery's request stack each time
        settings, redlock = app_settings_and_redlock(self.app)
        run = begin(request, settings)
        options = self.lock_options(settings)
        name = self.lock_name(args, kwargs)
        if options.slot is not None:
            name = f"{name}{SLOT_SEPARATOR}{self._redlock_slot(request, options.slot)}"
        # Who holds it, stored beside the token in the same SET: a contender tells an earlier
        # attempt of its own task from a duplicate, and an operator sees which task, where,
        # since when and for how long a TTL (the record lock.admin reads; see lock/holder.py).
        holder = holder_text(self, options, task_id, request)
        lock: Lock | ReentrantLock
        if options.reentrant:
            # This execution is one owner: code its body calls re-enters through app_redlock(app).
            run.open_scope()
            lock = redlock.lock(name, options.ttl, holder=holder, reentrant=True)
        elif options.fenced:
            lock = redlock.lock(name, options.ttl, holder=holder, fenced=True)
        else:
            # Taken over from its message's marker, if it carries one (lock_enqueue).
            lock = enqueue.run_lock(redlock, request, name, options.ttl, holder)
        started = time.monotonic()
        if lock.acquire(blocking=False):
            self._redlock_hold(run, lock, task_id, options, started, request)
            return
        error = lock.last_error
        assert error is not None
        try:
            contend.contended(self, run, task_id, lock, options, error, started)
        finally:
            if options.reentrant and run.held is None:
                run.close_scope()  # not held (retried, skipped, failed): the scope ends here

    def _redlock_hold(
        self,
        run: RunState,
        acquired: Lock | ReentrantLock,
        task_id: str,
        options: LockOptions,
        started: float,
        request: Any = None,
    ) -> None:
        """Record the lock this run has just acquired, and keep it alive while the body runs
        (``request``: the run's, if at hand; looked up otherwise)."""
        # A reentrant lock is kept by its holding's inner Lock, which any thread may extend or
        # release (the view answers only for the owner asking).
        lock = acquired.holding() if isinstance(acquired, ReentrantLock) else acquired
        assert lock is not None
        held = Held(
            lock,
            task_id,
            time.monotonic(),
            options.release == "on_expiry",
            reentrant=isinstance(acquired, ReentrantLock),
        )
        run.acquired(held)
        registry.register(held)
        if options.heartbeat:
            request = self.request if request is None else request
            assert run.settings is not None  # given by begin()
            process_heartbeat().keep(
                lock,
                interval=options.heartbeat_interval,
                max_hold=self._redlock_max_hold(options, request, run.settings),
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

    def _redlock_max_hold(
        self, options: LockOptions, request: Any, settings: RedlockSettings
    ) -> float | None:
        """How long this run's heartbeat may keep its lock: ``lock_max_hold`` when given; else
        the hard time limit that applies to this run (see :func:`.hooks.hard_time_limit`) where
        the pool enforces it by killing the process (prefork); else no cap. A cap from a limit
        that does not end the body (the threads pool, a call that raised its own limit) would
        let the lock expire under a running body."""
        if options.max_hold is not None:
            return options.max_hold
        if not _in_prefork_child():
            return None
        hard = hard_time_limit(self, request, settings.task_time_limit)
        return float(hard) if hard else None

    def _redlock_slot(self, request: Any, spec: Any) -> str:
        """The slot this run belongs to: the beat's stamp, taken as it is, when the message has
        one; else computed from the publish time (see :mod:`.slots` for what that cannot know)."""
        stamp = header(request, SLOT_HEADER)
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
        published = header(request, PUBLISHED_HEADER)
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
        in a later slot than its publish. The time is kept in the run's state, and a lock retry
        publishes it as if it had been stamped, so the retried run stays in the same slot.
        """
        at = _eta_timestamp(getattr(request, "eta", None))
        source = "its eta"
        if at is None:
            at, source = time.time(), "this worker's clock at the start of the run"
        run = run_of(request)
        if run is not None:  # carried by contend.retry
            run.placed_by(at)
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

    def _redlock_finish(self, state: str, run: RunState | None = None) -> None:
        """Release (or leave to expire) the current execution's lock, waiting for a quorum's
        replies; idempotent. A release round that fails is logged, and the run completes as it
        would have: the lock is no longer this run's, and its TTL bounds what is left of it."""
        if run is None:  # the backstops (after_return, task_postrun, an eager replace)
            run = run_of(self.request)
        # Kept reachable through self.redlock after the release; only the duty is dropped.
        held = None if run is None else run.finish()
        if run is None or held is None:
            return
        registry.unregister(held)
        process_heartbeat().forget(held.lock)
        if held.reentrant:
            # The execution's holding ends with it, whatever depth its body left behind.
            forget_holding(held.lock)
            run.close_scope()
        expire = held.expire and state == SUCCESS
        if not expire and not enqueue.hand_back(held, run.take_requeue()):
            _release_or_warn(self.name, held)
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


option_table.install_defaults(RedlockTaskMixin)


class RedlockTask(RedlockTaskMixin, Task):  # type: ignore[misc]
    """A Celery task locked per resource with Redlock; use as ``@app.task(base=RedlockTask, ...)``."""

    abstract = True


# (pid, whether that process is a prefork pool child): asked once per process, not per run.
_prefork_child: tuple[int, bool] | None = None


def _in_prefork_child() -> bool:
    """Whether this process is a prefork pool child, whose hard time limit kills it."""
    global _prefork_child
    me = pid()
    if _prefork_child is None or _prefork_child[0] != me:
        from billiard.process import current_process

        _prefork_child = (me, type(current_process()).__name__ != "_MainProcess")
    return _prefork_child[1]


def _release_or_warn(task_name: str, held: Held) -> None:
    """Release ``held``'s lock; a round that no quorum answered is said at WARNING, never raised:
    the run's own outcome is what the caller waits for. The warning names the masters that did
    not answer (an operator's first question), from the votes the failed round kept."""
    try:
        released = held.lock.release()
    except Exception as exc:  # a refused master, a closed Redlock: the run still completes
        released = False
        logger.debug("releasing %s raised", held.lock.name, exc_info=True)
        detail = f": {exc}"
    else:
        detail = "" if released else f" ({'; '.join(name_masters(held.lock.release_votes))})"
    if not released:
        logger.warning(
            "task %s[%s]: the release of lock %s was not confirmed by a quorum of masters%s; "
            "it expires within its TTL (%g s) at the latest",
            task_name,
            held.task_id,
            held.lock.name,
            detail,
            held.lock.ttl,
        )


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
