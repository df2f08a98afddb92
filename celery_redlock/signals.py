"""The documented import path of the lock signals; they live in :mod:`celery_redlock.celery.signals`."""

from .celery.signals import enqueue_deduplicated, lock_acquired, lock_contended, lock_lost, lock_released

__all__ = ["enqueue_deduplicated", "lock_acquired", "lock_contended", "lock_lost", "lock_released"]
