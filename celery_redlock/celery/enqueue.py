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

**What frees the key.** The end of the run (its lock's release); a revoke of the queued message
(the worker that discards it deletes the marker by its value); a message that expires likewise;
a lost message (purged, a broker that lost it) by the marker's TTL; a dead worker by the run
lock's TTL. A publish that fails (broker down) deletes the marker it took.

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
import hashlib
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery.utils import uuid

from .._fork import pid
from .._validate import number
from ..errors import AlreadyQueued, ConfigError, LockNotAcquired
from ..lock import markers
from ..lock.holder import Holder
from ..lock.markers import HandoverLock
from ..lock.redlock import Redlock
from ..lock.resource import HOLDER_SEPARATOR, Lock, lock_key
from . import signals
from .held import Held
from .settings import RedlockSettings, app_settings_and_redlock, enqueue_mode

logger = logging.getLogger("celery_redlock.enqueue")

#: The message header that carries the marker: ``{"name": resource name, "value": marker value}``.
MARKER_HEADER = "redlock_marker"
# Options that make a call part of a canvas: a caller already holds its pre-assigned result id.
CANVAS_OPTIONS = ("chain", "link", "link_error", "chord", "group_id", "parent_id", "root_id")
# Set on a run's request when it re-published itself: (marker value, ttl) its lock becomes.
_REQUEUE_ATTR = "_redlock_requeue"
_HELD_ATTR = "_redlock_held"  # see task.py: the Held of the current run
# A publish whose marker no quorum granted and whose holder no quorum agrees on (two publishers
# splitting the vote, a master down) tries again after a short random delay, this many times.
PLACE_ATTEMPTS = 8
PLACE_RETRY_DELAY = 0.02
# How long a publish waits for the key of a run whose result is already stored (see _after_finish).
FINISHING_WAIT = 1.0
_HOST = json.dumps(socket.gethostname())


def check_task_options(cls: Any, task_name: str) -> None:
    """Definition-time checks of ``lock_enqueue`` / ``lock_enqueue_ttl`` (see task.py)."""
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
    request = task.request
    if task_id is not None and task_id == getattr(request, "id", None) and not request.called_directly:
        return _republish(task, publish, args, kwargs, task_id, options)
    settings, redlock = app_settings_and_redlock(task.app)
    name = task.lock_name(tuple(args or ()), kwargs or {})
    task_id = task_id or uuid()
    ttl = marker_ttl(task, settings, options)
    value = markers.new_value(_holder(task, task_id, ttl))
    placed = _place(redlock, name, value, ttl)
    # A finished run's lock is released within ms, unless it is left to expire (on_expiry, a
    # rate limit): then the key stays taken, and the duplicate is one at once.
    if isinstance(placed, str) and task.lock_release != "on_expiry" and _finished(task, placed):
        placed = _after_finish(task, redlock, name, value, ttl, placed)
    if isinstance(placed, str) or placed is None:
        existing = placed
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
    headers = dict(options.get("headers") or {})
    headers[MARKER_HEADER] = {"name": name, "value": value, "masters": masters_fingerprint(redlock)}
    options["headers"] = headers
    try:
        return publish(args, kwargs, task_id=task_id, **options)
    except BaseException:
        # Not published (or not known to be): a marker no message carries would only block the
        # key for its TTL.
        markers.drop(redlock, name, value)
        raise


def _place(redlock: Redlock, name: str, value: str, ttl: float) -> markers.Placed | str | None:
    """The placed marker; or, when the key is taken, the task id its holder names (None when the
    holder records none). Raises :class:`LockNotAcquired` when neither is known after
    ``PLACE_ATTEMPTS`` tries."""
    placed = markers.place(redlock, name, value, ttl)
    for attempt in range(1, PLACE_ATTEMPTS + 1):
        if placed.value is not None:
            return placed
        if any(v.kind == "held" for v in placed.votes):
            text = redlock.holder(name)
            if text is not None:
                return Holder.parse(text).task
        if attempt == PLACE_ATTEMPTS:
            break
        # Split between two publishers (each retracted its part), or freed meanwhile, or a master
        # that did not answer: a short, growing random delay, then one more try.
        time.sleep(random.uniform(0, PLACE_RETRY_DELAY * attempt))
        placed = markers.place(redlock, name, value, ttl)
    raise LockNotAcquired(
        name, placed.votes, attempts=PLACE_ATTEMPTS, elapsed=placed.elapsed, quorum=redlock.quorum
    )


def _finished(task: Any, task_id: str) -> bool:
    """Whether ``task_id``'s result is already stored as ready: its run has ended and its lock
    is on its way out (the tracer stores the result before ``after_return`` releases). One read
    of the result backend, on the duplicate path only; False without a backend."""
    try:
        return bool(task.AsyncResult(task_id).ready())
    except Exception:  # no result backend (DisabledBackend), or it failed: not known to be done
        return False


def _after_finish(
    task: Any, redlock: Redlock, name: str, value: str, ttl: float, existing: str
) -> markers.Placed | str | None:
    """The key is still held by a run whose result is stored: it is being released, within
    milliseconds (or its holder died in between and it expires). Try again until it is free, for
    up to ``FINISHING_WAIT`` seconds; a caller that waited for the result and publishes again at
    once must not be handed the result it already has."""
    deadline = time.monotonic() + FINISHING_WAIT
    delay = 0.002
    while time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
        placed = _place(redlock, name, value, ttl)
        if not isinstance(placed, str) or placed != existing:
            return placed
    return existing


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
    request = task.request
    held: Held | None = getattr(request, _HELD_ATTR, None)
    if held is None or held.finished or not held.lock.owned():
        return publish(args, kwargs, task_id=task_id, **options)
    settings, redlock = app_settings_and_redlock(task.app)
    ttl = marker_ttl(task, settings, options)
    value = markers.new_value(_holder(task, task_id, ttl))
    name = task.lock_name(tuple(args or ()), kwargs or {})
    headers = dict(options.get("headers") or {})
    headers[MARKER_HEADER] = {"name": name, "value": value, "masters": masters_fingerprint(redlock)}
    if name != held.lock.name:
        # Retried with arguments of another resource: that key gets a marker of its own, and
        # this run's lock is released as usual when it ends (nothing to swap it for).
        placed = _place(redlock, name, value, ttl)
        if isinstance(placed, str) or placed is None:
            logger.warning(
                "task %s[%s]: retried for %s, which is queued or running as %s; published without "
                "a marker (its run is locked as usual)",
                task.name,
                task_id,
                name,
                placed,
            )
            del headers[MARKER_HEADER]
        options["headers"] = headers
        try:
            return publish(args, kwargs, task_id=task_id, **options)
        except BaseException:
            if not (isinstance(placed, str) or placed is None):
                markers.drop(redlock, name, value)
            raise
    options["headers"] = headers
    result = publish(args, kwargs, task_id=task_id, **options)
    setattr(request, _REQUEUE_ATTR, (value, ttl))
    return result


def hand_back(request: Any, held: Held) -> bool:
    """At the end of a run that re-published itself: swap its lock for the new message's marker
    instead of releasing it. True if the lock was dealt with here (released or swapped)."""
    pending = getattr(request, _REQUEUE_ATTR, None)
    if pending is None:
        return False
    setattr(request, _REQUEUE_ATTR, None)
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
    lock.release(linger=False)
    logger.debug("task %s: lock %s handed to its re-published message", held.task_id, lock.name)
    return True


def run_lock(redlock: Redlock, request: Any, name: str, ttl: float, holder: str) -> Lock:
    """The lock a run takes: over from its message's marker if it carries one for ``name``."""
    carried = marker_of(request)
    if carried is not None and carried[0] == name:
        fingerprint = _carried_fingerprint(request)
        if fingerprint is not None and fingerprint != masters_fingerprint(redlock):
            # A publisher on other masters (a deploy that moved them, a process on the old list):
            # its marker is out of reach here and blocks that key there until its TTL.
            logger.warning(
                "task %s: its message was marked on different masters (fingerprint %s; this "
                "worker's is %s): the marker cannot be taken over, and the key stays refused to "
                "publishers on those masters until the marker's TTL; check redlock_masters",
                getattr(request, "id", "?"),
                fingerprint,
                masters_fingerprint(redlock),
            )
            return redlock.lock(name, ttl, holder=holder)
        return HandoverLock(redlock, name, ttl, holder=holder, marker=carried[1])
    return redlock.lock(name, ttl, holder=holder)


def masters_fingerprint(redlock: Redlock) -> str:
    """A short digest of the masters a marker was taken on (their names, in order of name)."""
    names = "\n".join(sorted(master.name for master in redlock.masters))
    return hashlib.sha256(names.encode()).hexdigest()[:12]


def _carried_fingerprint(request: Any) -> str | None:
    raw = _header(request)
    value = raw.get("masters") if isinstance(raw, Mapping) else None
    return value if isinstance(value, str) else None


def marker_of(request: Any) -> tuple[str, str] | None:
    """(resource name, marker value) from a request's ``redlock_marker`` header, if any."""
    raw = _header(request)
    if isinstance(raw, Mapping):
        name, value = raw.get("name"), raw.get("value")
        if isinstance(name, str) and isinstance(value, str):
            return name, value
    return None


def _header(request: Any) -> Any:
    raw = getattr(request, MARKER_HEADER, None)
    if raw is None:
        headers = getattr(request, "headers", None)
        if isinstance(headers, Mapping):
            raw = headers.get(MARKER_HEADER)
    if raw is None:
        request_dict = getattr(request, "request_dict", None)  # a worker Request, not a Context
        if isinstance(request_dict, Mapping):
            raw = request_dict.get(MARKER_HEADER)
    return raw


def marker_ttl(task: Any, settings: RedlockSettings, options: Mapping[str, Any]) -> float:
    """How long a marker lasts: ``lock_enqueue_ttl`` counted from when the message is due (its
    countdown or ETA), so a delayed message keeps its key until it may run, and that long after."""
    base = task.lock_enqueue_ttl if task.lock_enqueue_ttl is not None else settings.enqueue_ttl
    delay = 0.0
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown is not None:
        delay = float(countdown)
    elif isinstance(eta, dt.datetime):
        when = eta if eta.tzinfo is not None else eta.replace(tzinfo=dt.timezone.utc)
        delay = when.timestamp() - time.time()
    elif isinstance(eta, str):
        try:
            parsed = dt.datetime.fromisoformat(eta)
        except ValueError:
            parsed = None
        if parsed is not None:
            when = parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.timezone.utc)
            delay = when.timestamp() - time.time()
    return float(base) + max(0.0, delay)


def _holder(task: Any, task_id: str, ttl: float) -> str:
    """The marker's holder record: the run's fields (see task.py), ``since`` the publish, and
    ``"queued": true``, which tells an operator the task has not started."""
    return (
        f'{{"task":{json.dumps(task_id)},"name":{json.dumps(task.name)},"host":{_HOST},"pid":{pid()},'
        f'"since":{time.time():.3f},"ttl":{ttl:g},"queued":true}}'
    )


def queued_task_id(task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    """The id of the task queued or running for these arguments' resource, or None (free, or
    held by something that records no task id). One round to the masters; nothing published."""
    _, redlock = app_settings_and_redlock(task.app)
    text = redlock.holder(task.lock_name(args, kwargs))
    return None if text is None else Holder.parse(text).task


def is_queued(task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a publish with these arguments would find its resource taken (a task queued or
    running for it, or any other holder). One round; nothing published."""
    _, redlock = app_settings_and_redlock(task.app)
    return redlock.holder(task.lock_name(args, kwargs)) is not None


def release_revoked_marker(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_revoked``: a queued message revoked (or expired) before its run will never take its
    key over; delete its marker, by value, so the key is free at once. A run that already took
    the key over left no marker to delete (the compare finds its token), and is released by its
    own exit path."""
    carried = marker_of(request)
    if carried is None:
        return
    app = getattr(sender, "app", None)
    if app is None:
        from celery import current_app

        app = current_app
    task_id = getattr(request, "id", None)
    try:
        redlock = app_settings_and_redlock(app)[1]
        markers.drop(redlock, carried[0], carried[1])
        if isinstance(task_id, str) and _run_holds(redlock, carried[0], task_id):
            # A retry copy discarded while the run that published it still holds the key: that
            # run swaps its lock for this very marker when it ends (REQUEUE), after this drop.
            # Drop it again once it is there (bounded by the marker's own TTL).
            threading.Thread(
                target=_drop_when_handed_back,
                args=(redlock, carried[0], carried[1], task_id),
                name="redlock-revoked-marker",
                daemon=True,
            ).start()
    except Exception:  # a signal handler's failure is logged by nobody else
        logger.exception("deleting the marker of revoked task %s failed", task_id or "?")
        return
    logger.info("task %s revoked: its marker on %s deleted", task_id or "?", carried[0])


def _run_holds(redlock: Redlock, name: str, task_id: str) -> bool:
    """Whether a run of ``task_id`` (not a marker) holds ``name`` on any master."""
    for value in redlock.read_everywhere(lock_key(redlock.key_prefix, name)):
        if value is not None:
            holder = Holder.parse(value.decode("utf-8", "replace").partition(HOLDER_SEPARATOR)[2])
            if holder.task == task_id and "queued" not in holder.text:
                return True
    return False


def _drop_when_handed_back(redlock: Redlock, name: str, value: str, task_id: str) -> None:
    """Poll until the run of ``task_id`` let go of ``name``; delete the marker ``value`` if it
    was handed to it. Gives up with the marker's TTL, when it would be gone anyway."""
    holder = Holder.parse(value.partition(HOLDER_SEPARATOR)[2])
    deadline = time.monotonic() + (holder.ttl if holder.ttl is not None else 3600.0)
    wanted = value.encode()
    while time.monotonic() < deadline:
        values = redlock.read_everywhere(lock_key(redlock.key_prefix, name))
        if wanted in values:
            markers.drop(redlock, name, value)
        elif not _run_holds(redlock, name, task_id):
            return
        time.sleep(0.25)
