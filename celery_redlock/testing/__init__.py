"""Real servers for tests: ours, and users' own suites (see the pytest fixtures); and the overlap
check that reads what holders recorded while they ran."""

from __future__ import annotations

from .celery import CeleryBeat, CeleryProcess, CeleryProcessError, CeleryWorker
from .overlap import Hold, Overlap, find_overlaps
from .proxy import Proxy, ProxySet
from .servers import RedisServer, ServerError, ServerSet, free_port, server_binary

__all__ = [
    "CeleryBeat",
    "CeleryProcess",
    "CeleryProcessError",
    "CeleryWorker",
    "Hold",
    "Overlap",
    "Proxy",
    "ProxySet",
    "RedisServer",
    "ServerError",
    "ServerSet",
    "find_overlaps",
    "free_port",
    "server_binary",
]
