"""Signals that let users observe locking. Sent with the task as ``sender``.

Every signal carries ``key`` (the resource name, without the key prefix), ``task_id``, and
timings in seconds:

- ``lock_acquired(key, task_id, token, ttl, validity, elapsed)``: before the body runs.
- ``lock_contended(key, task_id, policy, attempt, countdown, error)``: the lock was not taken;
  ``policy`` is what happens next (``retry``, ``skip``, ``fail``, or ``exhausted`` when the lock
  retries ran out); ``error`` is the :class:`LockNotAcquired` with the per-master votes.
- ``lock_lost(key, task_id, reason, held_for)``: an extension failed while the body ran. Sent
  from the heartbeat thread, not the task's own.
- ``lock_released(key, task_id, held_for, state, expire)``: after the body; ``expire`` is true
  when the lock was left to expire (``lock_release="on_expiry"``) rather than deleted.
- ``enqueue_deduplicated(key, task_id, existing, mode)``: a publish with ``lock_enqueue`` found its
  key queued or running as task ``existing`` (None if its holder records no task id) and sent
  nothing; ``task_id`` is the id the call would have had, ``mode`` what the caller got
  (``return_existing`` or ``raise``). Sent in the publishing process.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

lock_acquired = Signal(
    name="lock_acquired",
    providing_args={"key", "task_id", "token", "ttl", "validity", "elapsed", "fence"},
)
lock_contended = Signal(
    name="lock_contended",
    providing_args={"key", "task_id", "policy", "attempt", "countdown", "error"},
)
lock_lost = Signal(name="lock_lost", providing_args={"key", "task_id", "reason", "held_for"})
lock_released = Signal(
    name="lock_released",
    providing_args={"key", "task_id", "held_for", "state", "expire"},
)

enqueue_deduplicated = Signal(
    name="enqueue_deduplicated",
    providing_args={"key", "task_id", "existing", "mode"},
)

__all__ = ["enqueue_deduplicated", "lock_acquired", "lock_contended", "lock_lost", "lock_released"]
