"""What a run that did not get its lock does, by ``lock_contended``: wait, retry, skip or fail."""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

from celery import Task
from celery.exceptions import Ignore, Retry

from ..errors import LockNotAcquired
from ..lock.holder import parse
from ..lock.reentrant import ReentrantLock
from ..lock.resource import Lock
from . import enqueue, signals
from .hooks import PUBLISH_ID_HEADER, hard_time_limit, worker_time_limits
from .lockoptions import LockOptions
from .runholder import header, holder_task, naming_holder, same_publish
from .runstate import RunState
from .slots import PUBLISHED_HEADER, SLOT_HEADER
from .tracer import SKIPPED

logger = logging.getLogger("celery_redlock.task")


# How long an eager run (apply(), task_always_eager) retries while no quorum of masters answers
# before it fails naming them: a test or a script is better told at once than made to hang.
EAGER_UNAVAILABLE_WAIT = 2.0
ATTEMPT_HEADER = "redlock_attempt"
# What a wait for the lock leaves before the run's hard time limit, besides two rounds to the
# masters (the wait's last attempt may end a request timeout late; asking for the holder,
# storing the run's RETRY state and publishing the lock retry follow it): see _wait_cap.
HARD_LIMIT_MARGIN = 1.0


def contended(
    task: Task,
    run: RunState,
    task_id: str,
    lock: Lock | ReentrantLock,
    options: LockOptions,
    error: LockNotAcquired,
    started: float,
) -> None:
    """What a run that did not get its lock does, by ``lock_contended``: retry later, skip,
    or fail. An eager run (``apply()``, ``task_always_eager``) never publishes: it waits
    in-process (see wait_eager)."""
    request = task.request
    attempt = int(header(request, ATTEMPT_HEADER) or 0)
    policy = options.contended
    if policy == "wait" and error.contended:
        if wait(task, task_id, lock, options, started):
            task._redlock_hold(run, lock, task_id, options, started)
            return
        # Not freed in time (or revoked): the wait was one attempt, and the retry policy
        # (lock_retry_backoff, lock_max_retries) takes over.
        error = lock.last_error or error
        policy = "retry"
    policy, why, error, holder = _decide(request, task_id, lock, options, error, policy, attempt)
    if getattr(request, "is_eager", False):
        wait_eager(task, run, task_id, lock, options, policy, why, attempt, started)
        return
    countdown = 0.0
    if policy == "retry":
        countdown = options.backoff(attempt)
    signals.lock_contended.send(
        sender=task,
        key=lock.name,
        task_id=task_id,
        policy=policy,
        attempt=attempt,
        countdown=countdown,
        error=error,
    )
    if policy == "retry":
        logger.log(
            logging.INFO if error.contended else logging.WARNING,
            "task %s[%s]: lock %s %s; retry %d in %.2f s",
            task.name,
            task_id,
            lock.name,
            why,
            attempt + 1,
            countdown,
        )
        raise retry(task, run, attempt + 1, countdown, error)
    give_up(task, run, task_id, lock.name, policy, why, attempt, error, holder)


class _Decision(NamedTuple):
    """What a run that did not get its lock does: ``policy`` is retry, skip, fail or exhausted
    (out of lock retries); ``why`` is said in its log line, ``error`` is what it raises or
    retries with, and ``holder`` the task id of the run holding the lock, when asked for."""

    policy: str
    why: str
    error: LockNotAcquired
    holder: str | None = None


def _decide(
    request: Any,
    task_id: str,
    lock: Lock | ReentrantLock,
    options: LockOptions,
    error: LockNotAcquired,
    policy: str,
    attempt: int,
) -> _Decision:
    """The run's policy (the task's, or retry after a wait that failed) turned into what it does,
    by why it did not get the lock and how many lock retries it has had."""
    why = "held by another run"
    if not error.contended:
        # INVARIANT (no lost work): a quorum missed because masters failed or did not answer
        # is unavailability, not contention. Nobody is shown to hold the lock, so the run is
        # never skipped or failed as a duplicate: it retries, within lock_max_retries, and
        # then fails naming the masters.
        policy = "retry"
        why = unavailable(error)
    if policy == "retry" and options.max_retries is not None and attempt >= options.max_retries:
        policy = "exhausted"
    decision = _Decision(policy, why, error)
    if policy != "retry" and error.contended:
        # Off the usual path: one more round, only when the answer changes what happens.
        return _decide_by_holder(request, task_id, lock, decision)
    return decision


def _decide_by_holder(
    request: Any, task_id: str, lock: Lock | ReentrantLock, decision: _Decision
) -> _Decision:
    """``decision`` (to skip, fail or give up) once the lock's holder is known: named in the
    error, and a retry after all when there is no one to skip or fail for."""
    text = lock.redlock.holder(lock.name)
    record = parse(text) if text else None
    holder = record.task if record is not None else None
    decision = decision._replace(error=naming_holder(decision.error, text), holder=holder)
    if text is None and decision.policy != "exhausted":
        # Gone between the two rounds (released, expired): no one to skip or fail for,
        # so this is a contended try like any other, retried.
        return decision._replace(policy="retry", why="released while its holder was asked for")
    if record is not None and holder == task_id and same_publish(record, request):
        # An earlier attempt of this very message holds it: a pool child that died
        # holding it (the broker redelivered the message), or a retry published before
        # its run ended. Skipping or failing would drop the work: wait for that lock to
        # go, whatever the mode (a dead run's lock expires with its TTL).
        return decision._replace(policy="retry", why="held by an earlier attempt of this same task")
    if holder == task_id:
        # Another publish that reused this task id (apply_async(task_id=...)): a
        # duplicate like any other, dealt with by the mode.
        return decision._replace(why="held by another publish of the same task id")
    return decision


def wait(task: Task, task_id: str, lock: Lock | ReentrantLock, options: LockOptions, started: float) -> bool:
    """Wait in this worker for the lock, woken by its release, up to ``lock_wait_timeout``;
    True once held. Capped so that neither time limit fires inside the wait (see
    :func:`_wait_cap`; the limits run from the run's start, ``started``, monotonic, before its
    first attempt); ended early when the worker process learns the task was revoked (not under
    prefork without terminate: the child never sees the revoked set, so it waits out its
    timeout as a running body would)."""
    timeout = options.wait_timeout
    cap = _wait_cap(task, lock.redlock.request_timeout)
    if cap is not None:
        timeout = max(0.0, min(timeout, cap - (time.monotonic() - started)))
    if getattr(task.request, "is_eager", False):
        timeout = min(timeout, options.ttl)  # an eager run gives up within one TTL in all
    from celery.worker import state as worker_state  # the worker's own, in this process

    revoked = worker_state.revoked
    started = time.monotonic()
    got = lock.acquire(timeout=timeout, cancelled=lambda: task_id in revoked)
    if not got and task_id in revoked:
        # Revoked while it waited: ended as a revoked run ends (no retry is published).
        logger.info("task %s[%s] revoked while it waited for %s", task.name, task_id, lock.name)
        # INVARIANT (a marker lasts no longer than its message): this message will never run
        # again, and Celery sends no task_revoked for a run that ends this way: its marker
        # (beside the key, where its failed attempts put it back) is deleted here, by value.
        enqueue.drop_abandoned_marker(sender=task, key=lock.name, policy="revoked")
        backend: Any = task.backend
        backend.mark_as_revoked(task_id, "revoked while waiting for its lock", request=task.request)
        raise Ignore()
    logger.debug(
        "task %s[%s]: waited %.3f s for %s: %s",
        task.name,
        task_id,
        time.monotonic() - started,
        lock.name,
        "held" if got else "not freed in time",
    )
    return got


def _wait_cap(task: Task, request_timeout: float) -> float | None:
    """How long, from the run's start, a wait for the lock may last within this run's time
    limits (the call's, else the task's, else the worker's own, else the app's); None when it
    has none.

    INVARIANT (a marker lasts no longer than its message): a wait ends before either limit
    fires. A soft limit raised inside it would fail the run as a body's exception would; a hard
    limit kills the pool child, which then runs nothing of its own again, so a run still waiting
    (its message's marker not yet taken over) could neither delete the marker nor publish its
    lock retry (the worker's main process deletes the marker, see :mod:`.discarded`, but the
    work is lost). The hard limit leaves :data:`HARD_LIMIT_MARGIN` and two rounds for what
    follows a wait that failed (its last attempt, asking for the holder, publishing the lock
    retry), the soft limit one round (the last attempt)."""
    request = task.request
    limits = getattr(request, "timelimit", None) or (None, None)
    hard = hard_time_limit(task, request, task.app.conf.task_time_limit)
    worker_soft = worker_time_limits()[1]
    soft = (
        (limits[1] if len(limits) > 1 else None)
        or getattr(task, "soft_time_limit", None)
        or worker_soft
        or task.app.conf.task_soft_time_limit  # the pool's default, app-wide
    )
    caps = [
        float(limit) - margin
        for limit, margin in ((hard, HARD_LIMIT_MARGIN + 2 * request_timeout), (soft, request_timeout))
        if limit
    ]
    return max(0.0, min(caps)) if caps else None


def give_up(
    task: Task,
    run: RunState,
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
        logger.warning("task %s[%s] skipped: lock %s %s", task.name, task_id, name, why)
        # A success whose value says it was skipped: every part of Celery then treats it as
        # a finished run (a terminal task-succeeded event, a chord header member counted,
        # a chain's next task called with it, no result stored under ignore_result).
        marker = {SKIPPED: True, "key": name, "reason": why, "holder": holder}
        run.skipped(marker)
        return
    if policy == "exhausted":
        logger.error(
            "task %s[%s] failed: lock %s %s after %d lock retries", task.name, task_id, name, why, attempt
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
    logger.warning("task %s[%s] failed: lock %s %s", task.name, task_id, name, why)
    raise error


def wait_eager(
    task: Task,
    run: RunState,
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
    test or a script, which must not hang on a lock nobody releases. While no quorum of
    masters answers it waits at most :data:`EAGER_UNAVAILABLE_WAIT` seconds, then fails with
    the error that names them.

    Nothing is published: a lock retry sent to the broker from an eager call would also be
    re-applied in-process by Celery, and run twice (or recurse without end)."""
    give_up_at = started + options.ttl  # from the first attempt: a wait mode's wait included
    unavailable_until = time.monotonic() + EAGER_UNAVAILABLE_WAIT
    while policy == "retry":
        error = lock.last_error
        assert error is not None
        if options.max_retries is not None and attempt >= options.max_retries:
            policy = "exhausted"
            break
        delay = options.backoff(attempt)
        bounded = options.max_retries is None or not error.contended
        bound = give_up_at if error.contended else min(give_up_at, unavailable_until)
        if bounded and time.monotonic() + delay > bound:
            policy = "exhausted"
            break
        signals.lock_contended.send(
            sender=task,
            key=lock.name,
            task_id=task_id,
            policy="retry",
            attempt=attempt,
            countdown=delay,
            error=error,
        )
        logger.log(
            logging.INFO if error.contended else logging.WARNING,
            "task %s[%s] (eager): lock %s %s; retry %d in %.2f s",
            task.name,
            task_id,
            lock.name,
            why,
            attempt + 1,
            delay,
        )
        time.sleep(delay)
        attempt += 1
        if lock.acquire(blocking=False):
            task._redlock_hold(run, lock, task_id, options, started)
            return
    error = lock.last_error
    assert error is not None
    if not error.contended:
        why = unavailable(error)
    signals.lock_contended.send(
        sender=task,
        key=lock.name,
        task_id=task_id,
        policy=policy,
        attempt=attempt,
        countdown=0.0,
        error=error,
    )
    holder = None
    if error.contended:
        text = lock.redlock.holder(lock.name)
        holder, error = holder_task(text), naming_holder(error, text)
    give_up(task, run, task_id, lock.name, policy, why, attempt, error, holder)


def retry(task: Task, run: RunState, attempt: int, countdown: float, error: LockNotAcquired) -> Retry:
    """The same message again, later, without spending the task's own retries: published once
    this run's RETRY state is stored (see the INVARIANT below)."""
    request = task.request
    headers = dict(getattr(request, "headers", None) or {})
    headers[ATTEMPT_HEADER] = attempt
    # The retried run keeps the slot of the original message, whatever time it runs at.
    for name in (SLOT_HEADER, PUBLISHED_HEADER, PUBLISH_ID_HEADER, enqueue.MARKER_HEADER):
        value = header(request, name)
        if value is not None:
            headers[name] = value
    if run.published is not None and headers.get(PUBLISHED_HEADER) is None:
        headers[PUBLISHED_HEADER] = run.published  # the time an unstamped message was placed by
    sig = task.signature_from_request(
        request,
        None,
        None,
        countdown=countdown,
        retries=request.retries,
        headers=headers,
    )
    # INVARIANT (a lock retry's outcome is the retried copy's): the copy is published only once
    # the tracer has stored this run's RETRY state (hooks.publish_lock_retry, on the task_retry
    # signal the tracer sends right after that store). Published here, a copy that got the lock
    # at once and finished on another worker could store its SUCCESS first, and this run's
    # RETRY, stored after it, would stand for ever: the work done, its result never seen.
    run.retry_later(sig)
    return Retry(f"lock contended (attempt {attempt})", exc=error, when=countdown, sig=sig)


def unavailable(error: LockNotAcquired) -> str:
    """Why a run did not get its lock when masters, not a holder, denied the quorum."""
    granted = sum(1 for v in error.votes if v.kind == "yes")
    held = sum(1 for v in error.votes if v.kind == "held")
    if granted >= error.quorum:
        # Granted by a quorum, but the round outlasted what the TTL allowed: nothing was held.
        return (
            f"unavailable: a quorum granted it, but the round took {error.elapsed * 1000:.0f} ms "
            "and left no validity (slow masters, or a loaded host)"
        )
    failing = "; ".join(error.unavailable_masters) or "masters refused or failed"
    # What the others said too: four of five answering and split 2-2 is no outage, but the
    # fifth master decides, which is why the run retries rather than being refused.
    return (
        f"unavailable: no quorum could be decided without the masters that did not answer "
        f"({failing}); {granted} granted, {held} held by another run, quorum {error.quorum}"
    )
