"""The documented import path of the lock signals; they live in :mod:`celery_redlock.celery.signals`."""

from .celery.signals import lock_acquired, lock_contended, lock_lost, lock_released

__all__ = ["lock_acquired", "lock_contended", "lock_lost", "lock_released"]
