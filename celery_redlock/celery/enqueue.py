"""Deduplication at publish (``lock_enqueue``): one message per resource in the queue.

    @app.task(base=RedlockTask, lock_key="invoice:<invoice_id>", lock_enqueue="return_existing")
    def charge(invoice_id): ...

    charge.delay(42)   # published; the key "invoice:42" is marked as queued by this task id
    charge.delay(42)   # not published: the AsyncResult of the first (or AlreadyQueued, "raise")

**One key, two holders in turn.** The marker a publish takes *is* the run's lock key: a plain
lock value whose holder text names the queued task id (and ``"queued": true``), set on a quorum
of the same masters by the same rules, for ``lock_enqueue_ttl`` seconds (plus any countdown or
ETA). The message carries the marker's value in its ``redlock_marker`` header. When the run
starts, its lock is a :class:`~celery_redlock.lock.markers.HandoverLock`, whose acquire
swaps the marker's value for the run's own token in one step on each master (compared on the
whole value, not the task id). So:

- there is no gap: on every master the key holds the marker until the same step makes it hold
  the run's lock, and a duplicate publish is refused throughout;
- the run is never refused by its own marker: the swap accepts it, as it accepts a free key (a
  marker that expired while the message waited);
- a redelivered copy of a message whose run already took the key over (``acks_late``, a worker
  lost) finds the run's token, not the marker, and waits as any copy of its own task does today
  (until the dead run's lock expires, ``lock_ttl``).

From then on it is the run's lock (heartbeat, release on every exit path, expiry if the worker
dies). A run that re-publishes itself (``self.retry()``) gets a new marker in the new message,
and when the run ends its lock is swapped for that marker instead of released (REQUEUE): the
retried message stays the one queued for the key. The lock retries of ``lock_contended`` carry
the marker header on as it is.

**A marker belongs to its task.** A publish is a duplicate only of a queued message or a run of
*its own task* for the resource. Tasks that share a ``lock_key`` share the lock (their runs
exclude each other), not their deduplication: a publish that finds another task's marker or run
on the key (or any other holder) is published, with its marker set *beside* the key, on a key of
its own task's (``<lock key>~enqueued:<task name>``, see :func:`.markers.side_key`). That marker
answers the task's next publishes; its run waits for the lock key as any contender does (by
``lock_contended``) and takes it over with the same HANDOVER, which deletes the side marker in
the same step (an attempt that no quorum granted puts it back, see ``markers.HandoverLock``).
A run that gives up instead (skipped, failed, out of lock retries) deletes its message's marker
(:func:`drop_abandoned_marker`).

**A marker lasts as long as its message can arrive.** It is placed for ``PUBLISH_WINDOW``
seconds (at most its full TTL): the time the publish has to reach the broker. Once the broker
has accepted the message, one more round extends it to ``lock_enqueue_ttl`` (plus any countdown
or ETA, never past the message's ``expires``: see :func:`.queued.marker_ttl`) and swaps it for
its published form (``markers.keep``). A publisher killed in between (or a publish that never
returns) leaves a marker that expires within the window, not an hour of publishes answered with
a task id no message carries. **Only a published marker answers a duplicate**: a call that
finds one still unpublished waits until it is published or gone (:func:`_place_settled`).
A publish slower than the window finds its marker gone: it is logged, and its message is queued
unmarked (its run takes the key free; a duplicate published meanwhile is not refused).

**What frees the key.** The end of the run (its lock's release); a revoke of the queued message
(the worker that discards it deletes the marker by its value); a message that expires likewise;
a lost message (purged, a broker that lost it) by the marker's TTL; a dead worker by the run
lock's TTL. A publish that fails (broker down) deletes the marker it took; a publisher that dies
before its publish, by the publish window.

**Where it does not apply.** Eager calls (``task_always_eager``, ``apply()``) take no marker and
publish nothing: the run's own lock is taken as always. ``app.send_task(name)`` does not go
through the task class, so it takes no marker and is not deduplicated (its run is an ordinary
locked run); code that has the class registered should publish with
``app.signature(name, args=...).apply_async()``, which does. Canvas members (a call carrying
``chain``, ``link``, ``link_error``, ``chord``, ``group_id``, ``parent_id`` or ``root_id``) take
the marker when the key is free, but when it is taken they are published anyway, without one:
someone already waits on their pre-assigned result id (the group, the chord, the chain's last
result), which another task's result cannot stand in for; their runs are locked as usual, and
``lock_contended`` decides. Masters that give no quorum either way (down, split) make the
publish fail with :class:`LockNotAcquired`: nothing is published unmarked.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery.utils import uuid

from .._fork import pid
from .._validate import number
from ..errors import UNANSWERED, AlreadyQueued, ConfigError, LockNotAcquired, name_masters
from ..lock import markers
from ..lock.holder import HolderRecord, parse
from ..lock.markers import side_key
from ..lock.redlock import Redlock
from ..lock.resource import HOLDER_SEPARATOR, lock_key
from . import hooks, signals
from .held import Held
from .hooks import PUBLISH_ID_HEADER
from .queued import MARKER_HEADER as MARKER_HEADER
from .queued import Existing, existing_of, masters_fingerprint
from .queued import drop_abandoned_marker as drop_abandoned_marker
from .queued import is_queued as is_queued
from .queued import marker_ttl as marker_ttl
from .queued import queued_task_id as queued_task_id
from .queued import release_revoked_marker as release_revoked_marker
from .queued import run_lock as run_lock
from .runstate import run_of
from .settings import RedlockSettings, app_settings_and_redlock, enqueue_mode

logger = logging.getLogger("celery_redlock.enqueue")

# Options that make a call part of a canvas: a caller already holds its pre-assigned result id.
CANVAS_OPTIONS = ("chain", "link", "link_error", "chord", "group_id", "parent_id", "root_id")
# A publish whose marker no quorum granted and whose holder no quorum agrees on tries again
# after a short random delay, growing with each try up to PLACE_DELAY_STEPS of PLACE_RETRY_DELAY.
# Masters not answering: PLACE_ATTEMPTS tries in all. A vote split between publishers (a quorum
# answered, none agreeing): on, for up to PUBLISH_WINDOW, since one of them will win it.
PLACE_ATTEMPTS = 8
PLACE_RETRY_DELAY = 0.02
PLACE_DELAY_STEPS = 10
# How long a publish waits for the key of a run whose result is already stored (see _after_finish).
FINISHING_WAIT = 1.0
# How long a marker lasts until the broker has its message (then: lock_enqueue_ttl). Long enough
# for a publish, with its connect, to reach a broker; short enough that the marker of a publisher
# that died before its publish refuses the key for seconds, not for lock_enqueue_ttl.
PUBLISH_WINDOW = 5.0
# How many publish windows a call waits for markers whose publish has not returned (each a new
# publisher's, placed as the last one's went) before it is refused (see _place_settled).
PENDING_WINDOWS = 3
_HOST = socket.gethostname()


def check_task_options(cls: Any, task_name: str) -> None:
    """Definition-time checks of ``lock_enqueue`` / ``lock_enqueue_ttl`` (see task.py); and the
    hook that deletes the marker of a run that gave up, connected once a locked task exists (an
    app-wide ``redlock_enqueue`` may mark any of them)."""
    hooks.connect((signals.lock_contended, drop_abandoned_marker))
    mode = enqueue_mode(f"task {task_name!r}: lock_enqueue", cls.lock_enqueue)
    if cls.lock_enqueue_ttl is not None:
        number(f"task {task_name!r}: lock_enqueue_ttl", cls.lock_enqueue_ttl, above=0, unit="seconds")
    if mode is None:
        return
    if cls.lock_slot is not None:
        raise ConfigError(
            f"task {task_name!r}: lock_enqueue cannot be combined with lock_slot: the slot is "
            "known only from the beat's stamp or the publish time, after the marker is taken"
        )
    if cls.lock_reentrant:
        raise ConfigError(
            f"task {task_name!r}: lock_enqueue cannot be combined with lock_reentrant=True: the "
            "marker is a plain lock value, which a reentrant lock's key cannot take over"
        )
    if cls.lock_fenced:
        raise ConfigError(
            f"task {task_name!r}: lock_enqueue cannot be combined with lock_fenced=True: the run "
            "takes its key over from the marker in one script, which hands out no fence"
        )


def mode_of(task: Any) -> str | None:
    """The task's enqueue mode: its own ``lock_enqueue``, else the app's ``redlock_enqueue``.

    The hot path of every publish of a locked task: a task with the option off and an app
    without the setting costs one ``app.conf`` look-up, and needs no masters configured.
    """
    mode = task.lock_enqueue
    if mode is False:
        return None
    if mode is None:
        if task.app.conf.get("redlock_enqueue", None) is None:
            return None
        settings, _ = app_settings_and_redlock(task.app)
        mode = settings.enqueue
        if mode is not None:
            _refuse_conflicts(task, settings)
    return mode  # type: ignore[no-any-return]


def _refuse_conflicts(task: Any, settings: RedlockSettings) -> None:
    """An app-wide ``redlock_enqueue`` meets a task it cannot serve: the same refusals as
    :func:`check_task_options` makes at definition for ``lock_enqueue`` on the task itself."""
    why = None
    if task.lock_slot is not None:
        why = "lock_slot: the slot is known only after the marker is taken"
    elif _reentrant(task, settings):
        why = "a reentrant lock (lock_reentrant / redlock_reentrant), whose key a marker cannot take over"
    elif task.lock_fenced if task.lock_fenced is not None else settings.fenced:
        why = "a fenced lock (lock_fenced / redlock_fenced): the handover script hands out no fence"
    if why is not None:
        raise ConfigError(
            f"task {task.name!r}: redlock_enqueue cannot be combined with {why}; set "
            "lock_enqueue=False on this task"
        )


def _reentrant(task: Any, settings: RedlockSettings) -> bool:
    return bool(task.lock_reentrant if task.lock_reentrant is not None else settings.reentrant)


def apply_async(
    task: Any,
    publish: Callable[..., Any],
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
) -> Any:
    """``task.apply_async`` with the task's enqueue mode; ``publish`` is Celery's own."""
    mode = mode_of(task)
    if mode is None or task.app.conf.task_always_eager:
        # Eager: Celery runs it here and now, publishing nothing; the run's lock is the lock.
        return publish(args, kwargs, task_id=task_id, **options)
    # The run publishing its own retry, if any. A task not yet bound to its app (a first publish
    # racing the app's lazy set-up in another thread) has no request stack: nothing runs it here.
    stack = task.request_stack
    request = stack.top if stack is not None else None
    if task_id is not None and request is not None and task_id == request.id and not request.called_directly:
        return _republish(task, publish, args, kwargs, task_id, options)
    settings, redlock = app_settings_and_redlock(task.app)
    name = task.lock_name(tuple(args or ()), kwargs or {})
    task_id = task_id or uuid()
    ttl = marker_ttl(task, settings, options)
    if ttl < redlock.min_ttl:
        # Its ``expires`` falls due before a marker could be placed: it will not run.
        return publish(args, kwargs, task_id=task_id, **options)
    headers, value = _new_marker(task, task_id, ttl, options)
    placed = _place_settled(task, redlock, name, value, min(ttl, PUBLISH_WINDOW))
    # Placing may have waited out other publishes: the marker's TTL is counted from now (its
    # ``expires`` is a time, not a length), and never below what a marker can be placed for.
    ttl = max(marker_ttl(task, settings, options), redlock.min_ttl)
    if isinstance(placed, Existing):
        existing = placed.task_id
        if any(options.get(option) is not None for option in CANVAS_OPTIONS):
            logger.info(
                "task %s[%s]: %s is queued or running as %s, but this call is a canvas member; "
                "published without a marker (its run is locked as usual)",
                task.name,
                task_id,
                name,
                existing,
            )
            return publish(args, kwargs, task_id=task_id, **options)
        return _duplicate(task, mode, name, task_id, existing)
    since = time.monotonic() - placed.elapsed  # the placing round's start
    # The value the placing attempt that won wrote (each attempt writes a new one: see _place).
    headers[MARKER_HEADER] = {"name": name, "value": placed.value, "masters": masters_fingerprint(redlock)}
    options["headers"] = headers
    result = _publish_marked(publish, args, kwargs, task_id, options, redlock, name, placed)
    _keep(task, redlock, placed, ttl, since)
    return result


def _new_marker(
    task: Any, task_id: str, ttl: float, options: Mapping[str, Any]
) -> tuple[dict[str, Any], str]:
    """The headers of the message to publish (a copy of the call's) and the value of its marker,
    whose holder record carries the message's publish id (hooks.stamp_publish_time keeps one
    that is set)."""
    headers = dict(options.get("headers") or {})
    publish_id = headers.setdefault(PUBLISH_ID_HEADER, secrets.token_hex(8))
    return headers, markers.new_value(_holder(task, task_id, ttl, publish_id))


def _place_settled(
    task: Any, redlock: Redlock, name: str, value: str, ttl: float
) -> markers.Placed | Existing:
    """:func:`_place`, except that a call is deduplicated only against a message known to be
    published, or a run: not against a marker whose publish has not returned (it may never be
    published), nor a run whose result is already stored while its lock is on its way out."""
    placed = _place(task, redlock, name, value, ttl)
    window = PUBLISH_WINDOW + redlock.request_timeout
    for _ in range(PENDING_WINDOWS):
        if not (isinstance(placed, Existing) and placed.pending):
            break
        # Handed that id, this call would run only if that publish succeeds. Wait (bounded by
        # the marker's window, which began before this call saw it, and one round to see it
        # gone) until it is published, or gone (then this call places its own). A marker that
        # outlives the window is another publisher's, placed as the first went: its own window.
        placed = _wait_out(task, redlock, name, value, ttl, placed, window, lambda found: not found.pending)
    if isinstance(placed, Existing) and placed.pending:
        # INVARIANT (only a published message answers a duplicate): refused, the caller knows.
        raise LockNotAcquired(
            name,
            attempts=PLACE_ATTEMPTS,
            quorum=redlock.quorum,
            holder=f"the marker of {task.name}[{placed.task_id}], whose publish has not returned "
            f"after {PENDING_WINDOWS} windows of {PUBLISH_WINDOW:g} s",
        )
    # A finished run's lock is released within ms, unless it is left to expire (on_expiry, a
    # rate limit): then the key stays taken, and the duplicate is one at once.
    if (
        isinstance(placed, Existing)
        and not placed.queued
        and placed.task_id is not None
        and task.lock_release != "on_expiry"
        and _finished(task, placed)
    ):
        held = placed.value
        return _wait_out(
            task, redlock, name, value, ttl, placed, FINISHING_WAIT, lambda found: found.value != held
        )
    return placed


def _publish_marked(
    publish: Callable[..., Any],
    args: Any,
    kwargs: Any,
    task_id: str,
    options: dict[str, Any],
    redlock: Redlock,
    name: str,
    placed: markers.Placed,
) -> Any:
    """Celery's publish of a message whose marker is ``placed``; the marker deleted if it fails."""
    try:
        return publish(args, kwargs, task_id=task_id, **options)
    except BaseException:
        # Not published (or not known to be): a marker no message carries would only block the
        # key for its TTL.
        assert placed.value is not None
        side = None if placed.key == lock_key(redlock.key_prefix, name) else placed.key
        markers.drop(redlock, name, placed.value, side)
        raise


def _keep(task: Any, redlock: Redlock, placed: markers.Placed, ttl: float, since: float) -> None:
    """The broker has the message: its marker, placed for the publish window at ``since``
    (monotonic, the placing round's start), is kept for its full ``ttl`` and marked published
    (one round, even when the window was the whole TTL: only a published marker answers a
    duplicate, see _place_settled). Its replies are read, so that a marker lost to a publish
    slower than the window, or to masters not answering, is said to be.

    A quorum that answered without holding the marker while the window still runs is the usual
    case of a fast worker, not a loss: the run took the marker over (and may have ended since),
    or a worker discarded the message and dropped it. Nothing is said of it."""
    assert placed.value is not None and placed.key is not None
    kept, votes = markers.keep(redlock, placed.key, placed.value, ttl)
    if kept:
        return
    window = min(ttl, PUBLISH_WINDOW)
    age = time.monotonic() - since
    unanswered = name_masters(votes, UNANSWERED)
    if age < window - redlock.drift(window) and len(votes) - len(unanswered) >= redlock.quorum:
        logger.debug(
            "task %s: the marker on %s was taken over before its publish returned", task.name, placed.key
        )
        return
    logger.warning(
        "task %s: the marker on %s was gone when its publish returned, %.1f s after it was placed "
        "for %g s%s: the message is queued unmarked, and a duplicate publish of it is not refused",
        task.name,
        placed.key,
        age,
        window,
        f" (not answering: {', '.join(unanswered)})" if unanswered else "",
    )


def _place(
    task: Any, redlock: Redlock, name: str, value: str, ttl: float, deadline: float | None = None
) -> markers.Placed | Existing:
    """The placed marker: on the lock key of ``name`` when it is free, else beside it, on the
    task's own side key, when another holds it. Or what holds it for this very task: its queued
    message's marker or its run. Raises :class:`LockNotAcquired` when neither is known after
    ``PLACE_ATTEMPTS`` tries with masters not answering, or a vote split between publishers
    until ``deadline`` (monotonic; by default ``PUBLISH_WINDOW`` from now: a caller that waits
    on its own deadline passes it, so that the two bounds do not add up)."""
    side = side_key(redlock.key_prefix, name, task.name)
    holder = value.partition(HOLDER_SEPARATOR)[2]
    if deadline is None:
        deadline = time.monotonic() + PUBLISH_WINDOW
    attempt = 0
    while True:
        attempt += 1
        # INVARIANT (an attempt's retraction never deletes a later attempt's grant): each attempt
        # writes a value of its own, as a Lock takes a new token per attempt. A failed attempt is
        # retracted by value, and that delete may reach a master late (kept for a master with
        # no link, or behind a late reply on an old link), after the next attempt's write there:
        # with one value for all attempts it deleted that grant, a quorum's marker fell below
        # quorum, and a second publisher placed its own (two messages for one key).
        value = markers.new_value(holder)
        placed = markers.place(redlock, name, side, value, ttl)
        if placed.value is None and placed.beside is None and placed.holder is not None:
            record = parse(placed.holder.partition(HOLDER_SEPARATOR)[2])
            if record is not None and record.name == task.name:
                return existing_of(placed.holder)
            # Another task's, or any other holder's: this task's marker waits beside the key
            # while that value is still there (else the next attempt starts over).
            placed = markers.place_beside(redlock, name, side, value, ttl, placed.holder)
        if placed.value is not None:
            return placed
        if placed.beside is not None:
            return existing_of(placed.beside)
        if not _place_again(redlock, placed, attempt, deadline):
            raise LockNotAcquired(
                name, placed.votes, attempts=attempt, elapsed=placed.elapsed, quorum=redlock.quorum
            )
        # Split between publishers (each retracted its part), freed or taken meanwhile, or a
        # master that did not answer: a short random delay, growing with each try.
        time.sleep(random.uniform(0, PLACE_RETRY_DELAY * min(attempt, PLACE_DELAY_STEPS)))


def _place_again(redlock: Redlock, placed: markers.Placed, attempt: int, deadline: float) -> bool:
    """Whether a publish refused by ``placed`` (no quorum for anything) tries once more.

    INVARIANT (a burst is not refused for its own contention): a round that every master
    answered without a quorum agreeing on a holder is a vote split between publishers of the
    key, each of which retracts its part and tries again after a random delay: one of them wins
    a round, and the others then find its marker. Such a publish goes on until ``deadline`` (the
    publish window), so that publishers of one key do not each give up after a few splits, nor
    after a split left by publishers killed mid-round (it expires within the window). A master
    that did not answer may hold the very value that would make the quorum (another task's lock
    on it and two more): no later round can be told from that one, so a few tries, then the
    caller is told, naming it."""
    if attempt < PLACE_ATTEMPTS:
        return True
    return not name_masters(placed.votes, UNANSWERED) and time.monotonic() < deadline


def _finished(task: Any, run: Existing) -> bool:
    """Whether the run holding the key has its result stored as ready. A run's release normally
    takes effect before its result is stored; a key still held by a finished run is one whose
    release was left to the backstop after the result (see tracer.run_and_finish), on its way
    out. A result stored before the run took the key (by its ``since``) is an earlier run's of a
    reused task id: this run is not finishing. One read of the result backend, on the duplicate
    path only; False without a backend."""
    try:
        result = task.AsyncResult(run.task_id)
        if not result.ready():
            return False
        done = result.date_done
    except Exception:  # no result backend (DisabledBackend), or it failed: not known to be done
        return False
    since = parse(run.value.partition(HOLDER_SEPARATOR)[2])
    started = None if since is None else since.since
    if isinstance(done, dt.datetime) and started is not None:
        done = done if done.tzinfo is not None else done.replace(tzinfo=dt.timezone.utc)
        # since is written to the ms: a result stored in the run's first ms is still its own.
        return done.timestamp() >= started - 0.001
    return True


def _wait_out(
    task: Any,
    redlock: Redlock,
    name: str,
    value: str,
    ttl: float,
    existing: Existing,
    seconds: float,
    settled: Callable[[Existing], bool],
) -> markers.Placed | Existing:
    """Place again, after a short growing delay, until the key is free (placed), or held by a
    holder of this task that is ``settled``, for up to ``seconds``; then the last answer.

    Waited out: a run whose result is stored, while its release takes effect (milliseconds;
    a caller that waited for the result and publishes again at once must not be handed the
    result it already has), up to FINISHING_WAIT; a marker whose publish has not returned, until
    it is published or deleted (a failed publish), or its window ends (a dead publisher)."""
    deadline = time.monotonic() + seconds
    delay = 0.002
    placed: markers.Placed | Existing = existing
    while time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
        placed = _place(task, redlock, name, value, ttl, deadline)
        if not isinstance(placed, Existing) or settled(placed):
            return placed
    return placed


def _duplicate(task: Any, mode: str, name: str, task_id: str, existing: str | None) -> Any:
    logger.info(
        "task %s: %s already queued or running as %s; not published (%s)",
        task.name,
        name,
        existing or "a holder with no task id",
        mode,
    )
    if signals.enqueue_deduplicated.receivers:
        signals.enqueue_deduplicated.send(
            sender=task, key=name, task_id=task_id, existing=existing, mode=mode
        )
    if mode == "raise" or existing is None:
        raise AlreadyQueued(name, existing, task.name)
    return task.AsyncResult(existing)


def _republish(
    task: Any,
    publish: Callable[..., Any],
    args: Any,
    kwargs: Any,
    task_id: str,
    options: dict[str, Any],
) -> Any:
    """A run publishing its own task id again: ``self.retry()`` from the body, or a lock retry
    from ``before_start``. Never a duplicate of itself.

    A run that holds its lock gives the new message a new marker; its lock becomes that marker
    when the run ends (:func:`hand_back`). A run that holds nothing (a lock retry) sends the
    message with the headers it was given, its marker header among them.
    """
    run = run_of(task.request)
    held = None if run is None else run.held
    if run is None or held is None or held.finished or not held.lock.owned():
        return publish(args, kwargs, task_id=task_id, **options)
    settings, redlock = app_settings_and_redlock(task.app)
    ttl = marker_ttl(task, settings, options)
    if ttl < redlock.min_ttl:  # expires before a marker could be placed: it will not run
        return publish(args, kwargs, task_id=task_id, **options)
    headers, value = _new_marker(task, task_id, ttl, options)
    name = task.lock_name(tuple(args or ()), kwargs or {})
    headers[MARKER_HEADER] = {"name": name, "value": value, "masters": masters_fingerprint(redlock)}
    options["headers"] = headers
    if name == held.lock.name:
        result = publish(args, kwargs, task_id=task_id, **options)
        # Published: the lock becomes the marker in its published form (see _place_settled).
        run.requeued(markers.published(value), ttl)
        return result
    # Retried with arguments of another resource: that key gets a marker of its own, and this
    # run's lock is released as usual when it ends (nothing to swap it for).
    placed = _place(task, redlock, name, value, min(ttl, PUBLISH_WINDOW))
    if isinstance(placed, Existing):
        logger.warning(
            "task %s[%s]: retried for %s, which is queued or running as %s; published without "
            "a marker (its run is locked as usual)",
            task.name,
            task_id,
            name,
            placed.task_id,
        )
        del headers[MARKER_HEADER]
        return publish(args, kwargs, task_id=task_id, **options)
    since = time.monotonic() - placed.elapsed  # the placing round's start
    headers[MARKER_HEADER]["value"] = placed.value  # the winning attempt's (see _place)
    result = _publish_marked(publish, args, kwargs, task_id, options, redlock, name, placed)
    _keep(task, redlock, placed, ttl, since)
    return result


def hand_back(held: Held, pending: tuple[str, float] | None) -> bool:
    """At the end of a run that re-published itself (``pending``: the new message's marker value
    and ttl, see RunState.requeued): swap its lock for that marker instead of releasing it.
    True if the lock was dealt with here (released or swapped)."""
    if pending is None:
        return False
    value, ttl = pending
    lock = held.lock
    token = lock.token
    if token is None:
        return False
    swapped = markers.hand_back(lock.redlock, lock.key, token, value, ttl)
    if not swapped:
        logger.warning(
            "task %s: lock %s could not be handed to its re-published message's marker (lost, or "
            "no quorum answered); the message is queued unmarked",
            held.task_id,
            lock.name,
        )
    # Forgets the token; on the masters the compare finds the marker (or nothing) and deletes
    # nothing of it.
    lock.release()
    logger.debug("task %s: lock %s handed to its re-published message", held.task_id, lock.name)
    return True


def _holder(task: Any, task_id: str, ttl: float, publish: str) -> str:
    """The marker's holder record: the run's fields (see task.py), ``since`` the publish, its
    ``publish`` id, and ``queued``, which tells an operator the task has not started. The
    fields every marker of the task shares are written once per task (and TTL, and process)."""
    cls = type(task)
    record = cls.__dict__.get("_redlock_marker_record")
    me = pid()
    if record is None or record.name != task.name or record.ttl != ttl or record.pid != me:
        record = HolderRecord(name=task.name, host=_HOST, pid=me, ttl=ttl, queued=True)
        setattr(cls, "_redlock_marker_record", record)  # noqa: B010 - on the class, not the instance
    return record.to_text(task=task_id, since=time.time(), publish=publish)
