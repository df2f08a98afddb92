"""Real servers for tests: ours, and users' own suites (see the pytest fixtures)."""

from __future__ import annotations

from .celery import CeleryBeat, CeleryProcess, CeleryProcessError, CeleryWorker
from .proxy import Proxy, ProxySet
from .servers import RedisServer, ServerError, ServerSet, free_port, server_binary

__all__ = [
    "CeleryBeat",
    "CeleryProcess",
    "CeleryProcessError",
    "CeleryWorker",
    "Proxy",
    "ProxySet",
    "RedisServer",
    "ServerError",
    "ServerSet",
    "free_port",
    "server_binary",
]
