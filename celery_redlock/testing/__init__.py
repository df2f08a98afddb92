"""Real servers for tests: ours, and users' own suites (see the pytest fixtures)."""

from __future__ import annotations

from .servers import RedisServer, ServerError, ServerSet, free_port, server_binary

__all__ = ["RedisServer", "ServerError", "ServerSet", "free_port", "server_binary"]
