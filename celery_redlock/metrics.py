"""The documented import path of the Prometheus metrics (the ``metrics`` extra); they live in
:mod:`celery_redlock.celery.metrics`. ``enable()`` is the one call; ``redlock_metrics`` the one
setting."""

from .celery.metrics import MastersCollector, disable, enable, serve

__all__ = ["MastersCollector", "disable", "enable", "serve"]
