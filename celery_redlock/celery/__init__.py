"""The Celery integration: RedlockTask, its settings and hooks, the HA beat scheduler, the
``celery redlock`` command. Built on :mod:`celery_redlock.lock`; touches no socket itself.

Nothing here is imported by ``import celery_redlock``: see the package's lazy exports.
"""
