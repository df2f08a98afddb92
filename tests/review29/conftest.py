"""Review 29's fixtures: the asyncio suite's real masters (five embedded servers on loopback)."""

from __future__ import annotations

from tests.asyncio.conftest import masters, server_set

__all__ = ["masters", "server_set"]
