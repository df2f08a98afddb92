"""The asyncio floor: ``floor.py``'s commands over asyncio streams, nothing else.

One ``asyncio.open_connection`` per master. A command is written to every stream, then every
reply is awaited; a release too is written to the masters that granted, and their replies
awaited before it returns (as the library's release does). No timeouts, no votes, no error
handling, no parser beyond reading lines: every reply a lock command gets is one line. It is the
least an asyncio client can do for the same lock, a yardstick, not a lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from urllib.parse import urlparse

from floor import RELEASE_SHA, RELEASE_SOURCE, pack


class AsyncRawMasters:
    """One asyncio stream per master; ``owed`` counts unread replies per stream."""

    def __init__(self) -> None:
        self.readers: list[asyncio.StreamReader] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.owed: list[int] = []
        self.quorum = 0

    @classmethod
    async def open(cls, urls: Sequence[str]) -> AsyncRawMasters:
        masters = cls()
        for url in urls:
            parsed = urlparse(url)
            reader, writer = await asyncio.open_connection(
                parsed.hostname or "127.0.0.1", parsed.port or 6379
            )
            masters.readers.append(reader)
            masters.writers.append(writer)
        masters.owed = [0] * len(urls)
        masters.quorum = len(urls) // 2 + 1
        for reader, writer in zip(masters.readers, masters.writers, strict=True):
            writer.write(pack("SCRIPT", "LOAD", RELEASE_SOURCE))
            await reader.readline()  # the digest, a bulk string: two lines
            await reader.readline()
        return masters

    async def call(self, packed: bytes, indexes: Sequence[int] | None = None) -> list[bytes]:
        """Write ``packed`` to every master (or those at ``indexes``), then await each one's
        reply (its line, no CRLF), the owed replies first."""
        chosen = range(len(self.writers)) if indexes is None else indexes
        for i in chosen:
            self.writers[i].write(packed)
        replies = []
        for i in chosen:
            reader = self.readers[i]
            for _ in range(self.owed[i]):
                await reader.readline()
            self.owed[i] = 0
            replies.append((await reader.readline())[:-2])
        return replies

    async def set_nx(self, key: str, token: str, ttl_ms: int) -> list[int]:
        """SET NX PX on every master; the indexes of those that granted it."""
        replies = await self.call(pack("SET", key, token, "NX", "PX", ttl_ms))
        return [i for i, reply in enumerate(replies) if reply == b"+OK"]

    def retract(self, key: str, token: str, indexes: Sequence[int]) -> None:
        """The compare-and-delete at ``indexes``, not waited for (read before the next reply)."""
        packed = pack("EVALSHA", RELEASE_SHA, 1, key, token)
        for i in indexes:
            self.writers[i].write(packed)
            self.owed[i] += 1

    async def release(self, key: str, token: str, indexes: Sequence[int]) -> None:
        """The compare-and-delete at ``indexes``, replies awaited."""
        await self.call(pack("EVALSHA", RELEASE_SHA, 1, key, token), indexes)

    async def aclose(self) -> None:
        for writer in self.writers:
            writer.close()
        for writer in self.writers:
            await writer.wait_closed()
