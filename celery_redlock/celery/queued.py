"""The markers queued messages carry: how long a marker lasts (:func:`marker_ttl`), what a
message's ``redlock_marker`` header says, the lock its run takes (:func:`run_lock`), and what
deletes a marker that no run will take over (see :mod:`.enqueue` for the whole story), and
what holds a task's key (:class:`Existing`, :func:`queued_task_id`, :func:`is_queued`).

- :func:`release_revoked_marker` (``task_revoked``): a queued message revoked or expired;
- :func:`drop_abandoned_marker` (``lock_contended``): a run that gives up its lock (skipped,
  failed, out of lock retries) instead of taking its key over.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeGuard

from ..errors import MastersUnavailable
from ..lock import markers
from ..lock.holder import parse
from ..lock.markers import HandoverLock, side_key
from ..lock.redlock import Redlock
from ..lock.resource import HOLDER_SEPARATOR, Lock, lock_key
from .settings import RedlockSettings, app_settings_and_redlock

logger = logging.getLogger("celery_redlock.enqueue")

#: The message header that carries the marker: ``{"name": resource name, "value": marker value}``.
MARKER_HEADER = "redlock_marker"


def marker_ttl(task: Any, settings: RedlockSettings, options: Mapping[str, Any]) -> float:
    """How long a marker lasts: ``lock_enqueue_ttl`` counted from when the message is due (its
    countdown or ETA), so a delayed message keeps its key until it may run, and that long after;
    and never past its ``expires``. A marker that outlived its message's expiry would hand later
    calls the id of a message every worker discards: their work would never run. Below the
    Redlock's ``min_ttl`` (the message expires at once), the caller publishes it unmarked."""
    base = task.lock_enqueue_ttl if task.lock_enqueue_ttl is not None else settings.enqueue_ttl
    countdown = options.get("countdown")
    delay = float(countdown) if countdown is not None else _seconds_until(options.get("eta"))
    ttl = float(base) + max(0.0, delay or 0.0)
    # The call's, else the task's own (Celery merges it into the message later; an explicit
    # None in the call clears it, as Celery reads it).
    expires = options["expires"] if "expires" in options else getattr(task, "expires", None)
    # A number is seconds from now (as Celery reads it, not from the countdown); else a time.
    left = float(expires) if isinstance(expires, int | float) else _seconds_until(expires)
    return ttl if left is None else min(ttl, left)


def _seconds_until(when: Any) -> float | None:
    """Seconds from now until ``when`` (a datetime, or its ISO text; naive is UTC), if it is one."""
    if isinstance(when, str):
        try:
            when = dt.datetime.fromisoformat(when)
        except ValueError:
            return None
    if not isinstance(when, dt.datetime):
        return None
    aware = when if when.tzinfo is not None else when.replace(tzinfo=dt.timezone.utc)
    return aware.timestamp() - time.time()


def run_lock(redlock: Redlock, request: Any, name: str, ttl: float, holder: str) -> Lock:
    """The lock a run takes: over from its message's marker if it carries one for ``name``.

    Always the handover lock, whatever masters the message says it was marked on: it compares
    the marker's whole (random) value, so on masters that never saw the marker it takes the key
    as a plain lock would, and on the same servers reached under other names (a proxy, a DNS
    alias, localhost for 127.0.0.1) it takes its own marker over instead of being refused by it
    until the marker's TTL."""
    carried = marker_of(request)
    if carried is None or carried[0] != name:
        return redlock.lock(name, ttl, holder=holder)
    fingerprint = carried_fingerprint(request)
    if fingerprint is not None and fingerprint != masters_fingerprint(redlock):
        logger.warning(
            "task %s: its message was marked on different masters, or the same ones named "
            "otherwise (fingerprint %s; this worker's is %s): if they are other servers, the "
            "marker there keeps the key refused to publishers on them until its TTL; check "
            "redlock_masters",
            getattr(request, "id", "?"),
            fingerprint,
            masters_fingerprint(redlock),
        )
    owner = getattr(request, "task", None)  # the task's name, in a worker's request
    side = side_key(redlock.key_prefix, name, owner) if isinstance(owner, str) else None
    return HandoverLock(redlock, name, ttl, holder=holder, marker=carried[1], side=side)


def masters_fingerprint(redlock: Redlock) -> str:
    """A short digest of the masters a marker was taken on (their names, in order of name)."""
    names = "\n".join(sorted(master.name for master in redlock.masters))
    return hashlib.sha256(names.encode()).hexdigest()[:12]


def carried_fingerprint(request: Any) -> str | None:
    raw = _header(request)
    value = raw.get("masters") if isinstance(raw, Mapping) else None
    return value if isinstance(value, str) else None


def marker_of(request: Any) -> tuple[str, str] | None:
    """(resource name, marker value) from a request's ``redlock_marker`` header, if any."""
    raw = _header(request)
    if raw is not None and _is_mapping(raw):
        name, value = raw.get("name"), raw.get("value")
        if isinstance(name, str) and isinstance(value, str):
            return name, value
    return None


def _header(request: Any) -> Any:
    raw = getattr(request, MARKER_HEADER, None)
    if raw is None:
        headers = getattr(request, "headers", None)
        if _is_mapping(headers):
            raw = headers.get(MARKER_HEADER)
    if raw is None:
        request_dict = getattr(request, "request_dict", None)  # a worker Request, not a Context
        if _is_mapping(request_dict):
            raw = request_dict.get(MARKER_HEADER)
    return raw


def _is_mapping(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """``isinstance(value, Mapping)``, with the usual answers (a dict, None) found first: every
    run asks, and the abstract class's check is a Python call."""
    return type(value) is dict or (value is not None and isinstance(value, Mapping))


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
        owner = getattr(sender, "name", None)
        side = side_key(redlock.key_prefix, carried[0], owner) if isinstance(owner, str) else None
        markers.drop(redlock, carried[0], carried[1], side)
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


def drop_abandoned_marker(
    sender: Any = None, key: str | None = None, policy: str | None = None, **_: Any
) -> None:
    """``lock_contended``: a run that gives up its lock (skipped, failed, out of lock retries)
    will never take its key over; delete its message's marker, by value, wherever it waits (on
    the lock key, or beside it on the task's side key). A retried run keeps it: the retried
    message carries it on."""
    request = getattr(sender, "request", None)
    carried = None if policy == "retry" or request is None else marker_of(request)
    if carried is None or carried[0] != key:
        return
    try:
        redlock = app_settings_and_redlock(sender.app)[1]
        markers.drop(redlock, carried[0], carried[1], side_key(redlock.key_prefix, carried[0], sender.name))
    except Exception:  # a signal handler's failure is logged by nobody else
        logger.exception("deleting the marker of task %s (%s) failed", getattr(request, "id", "?"), policy)


def _run_holds(redlock: Redlock, name: str, task_id: str) -> bool:
    """Whether a run of ``task_id`` (not a marker) holds ``name`` on any master."""
    for value in redlock.read_everywhere(lock_key(redlock.key_prefix, name)):
        record = (
            None if value is None else parse(value.decode("utf-8", "replace").partition(HOLDER_SEPARATOR)[2])
        )
        if record is not None and record.task == task_id and not record.queued:
            return True
    return False


def _drop_when_handed_back(redlock: Redlock, name: str, value: str, task_id: str) -> None:
    """Poll until the run of ``task_id`` let go of ``name``; delete the marker ``value`` if it
    was handed to it. Gives up with the marker's TTL, when it would be gone anyway."""
    record = parse(value.partition(HOLDER_SEPARATOR)[2])
    deadline = time.monotonic() + (record.ttl if record is not None and record.ttl is not None else 3600.0)
    wanted = markers.published(value).encode()  # the form the run hands its lock back as
    while time.monotonic() < deadline:
        values = redlock.read_everywhere(lock_key(redlock.key_prefix, name))
        if wanted in values:
            markers.drop(redlock, name, value)
        elif not _run_holds(redlock, name, task_id):
            return
        time.sleep(0.25)


class Existing(NamedTuple):
    """A publish's key taken by its own task: the id the marker or run names (None when its
    record names none), whether it is a queued message's marker, and its value. ``pending``: a
    marker whose publish has not returned yet (its publisher may still fail, or die): no message
    is known to carry the id it names."""

    task_id: str | None
    queued: bool
    value: str
    pending: bool = False


def existing_of(value: str) -> Existing:
    """What a value of this task's (its marker or its run's lock) found on its key says."""
    record = parse(value.partition(HOLDER_SEPARATOR)[2])
    if record is None:
        return Existing(None, True, value)
    # A marker is placed for PUBLISH_WINDOW and swapped for its published form (markers.keep)
    # once the broker has its message. Pending is what the marker says (published: false), not
    # a guess from its age: a publisher's slow placement or another host's clock would make a
    # marker whose publish never returned look published, and hand out a task id no message
    # carries. A marker that says nothing was written by a version without the flag.
    pending = record.queued and record.published is False
    return Existing(record.task, record.queued, value, pending)


def _own_holder(
    task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, pending: bool, question: str
) -> Existing | None:
    """The queued message or the run of this task that holds its key for these arguments: one
    round, both keys read (the lock key, and the task's side key). ``pending``: a marker whose
    publish has not returned counts too (else it is passed over).

    INVARIANT (an answer, never a guess): None only when the masters that answered rule out
    every value of this task being on a quorum. Where the masters that did not answer could
    complete one (what is seen of it, plus them, reaches a quorum), it raises
    :class:`MastersUnavailable` naming them: "not queued" would make a caller publish again, or
    conclude that its work was lost."""
    _, redlock = app_settings_and_redlock(task.app)
    name = task.lock_name(args, kwargs)
    keys = [lock_key(redlock.key_prefix, name), side_key(redlock.key_prefix, name, task.name)]
    with redlock._round() as rnd:
        replies = rnd.call_many(
            [[("GET", key) for key in keys]] * len(redlock.masters), redlock.request_timeout
        )
    silent = _silent(redlock, replies)
    undecided = False  # a value of this task's that the silent masters could make a quorum's
    for j in (1, 0):  # a marker beside the key is this task's; the lock key's may be another's
        for holder, count in _this_tasks_values(task.name, [mine[j] for mine in replies]):
            counted = pending or not holder.pending  # else passed over, however many hold it
            if count >= redlock.quorum and counted:
                return holder
            # Could be a quorum's with the silent masters; and a marker seen only as placed may
            # be published on one of them (then it is published: see _this_tasks_values).
            if count + len(silent) >= redlock.quorum and (counted or silent):
                undecided = True
    if undecided or len(silent) >= redlock.quorum:
        raise MastersUnavailable(name, silent, question)
    return None


def _silent(redlock: Redlock, replies: list[list[Any]]) -> list[str]:
    """The masters of which some reply of the round did not come back ``ok``."""
    return [
        master.name
        for master, mine in zip(redlock.masters, replies, strict=True)
        if any(outcome.kind != "ok" for outcome in mine)
    ]


def _this_tasks_values(task_name: str, outcomes: list[Any]) -> list[tuple[Existing, int]]:
    """Each value of ``task_name``'s that the masters' ``outcomes`` (one key's GET on each) show,
    with how many show it. A marker as placed and as kept (published) are one marker: counted
    together, and published once any master shows it so (keep() may have reached only some)."""
    counts: dict[str, int] = {}
    shown: dict[str, str] = {}  # per marker, the form to go by: published where seen so
    for outcome in outcomes:
        if outcome.kind == "ok" and isinstance(outcome.value, bytes):
            text = outcome.value.decode("utf-8", "replace")
            form = markers.published(text)
            counts[form] = counts.get(form, 0) + 1
            shown[form] = form if text == form else shown.get(form, text)
    found = []
    for form, count in counts.items():
        record = parse(form.partition(HOLDER_SEPARATOR)[2])
        if record is not None and record.name == task_name:
            found.append((existing_of(shown[form]), count))
    return found


def queued_task_id(task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    """The id of this task's message queued, or its run running, for these arguments' resource;
    None when neither (another task's or holder's lock is no answer). One round; nothing
    published. Raises :class:`MastersUnavailable` when too few masters answered to tell.

    INVARIANT (only a published message answers, as in _place_settled): while a publish has not
    returned, its id is handed to nobody (None): that publish may still fail, or its publisher
    die before the broker has the message, and no message would then carry the id."""
    found = _own_holder(task, args, kwargs, pending=False, question="which task is queued")
    return None if found is None else found.task_id


def is_queued(task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a message of this task is queued, or being published, or its run running, for
    these arguments' resource: a publish now would not put another in the queue (it waits for
    a publish under way to return, see _place_settled). One round; nothing published. Raises
    :class:`MastersUnavailable` when too few masters answered to tell."""
    return _own_holder(task, args, kwargs, pending=True, question="whether a task is queued") is not None
