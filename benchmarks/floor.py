"""The floor both benchmarks measure against: Redlock's commands over raw sockets, nothing else.

One blocking socket per master. A command is written to every socket, then every reply is read;
a release too is written to the masters that granted, and their replies read before it returns,
which is what the library's release does (a release that returned before the masters applied it
would let a contender that starts right after it find the lock held). There are no timeouts (a
paused master would hang it), no votes, no error handling and no parser beyond counting lines:
every reply a lock command gets (``+OK``, ``$-1``, ``:1``, ``:0``) is one line. It is a yardstick, not a lock.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence
from urllib.parse import urlparse

# The compare-and-delete without the library's PUBLISH (which wakes waiters): the floor
# keeps the release as it was before waiting existed, so the ratio shows what the publish costs.
RELEASE_SOURCE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""
# Sent by digest, as the library sends every script (loaded on each socket when it connects).
RELEASE_SHA = hashlib.sha1(RELEASE_SOURCE.encode()).hexdigest()


def pack(*args: object) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


class RawMasters:
    """One plain blocking socket per master; ``owed`` counts unread replies per socket."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.socks: list[socket.socket] = []
        for url in urls:
            parsed = urlparse(url)
            sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(sock)
        self.owed = [0] * len(self.socks)
        self.quorum = len(self.socks) // 2 + 1
        for sock in self.socks:  # its reply, the digest, is a bulk string: two lines
            sock.sendall(pack("SCRIPT", "LOAD", RELEASE_SOURCE))
            data = b""
            while data.count(b"\r\n") < 2:
                data += sock.recv(65536)

    def call(self, packed: bytes, indexes: Sequence[int] | None = None) -> list[bytes]:
        """Write ``packed`` to every master (or those at ``indexes``), then read each one's
        reply (its line, no CRLF)."""
        chosen = range(len(self.socks)) if indexes is None else indexes
        for i in chosen:
            self.socks[i].sendall(packed)
        replies = []
        for i in chosen:
            sock = self.socks[i]
            lines = self.owed[i] + 1  # the owed releases' replies come first
            data = b""
            while data.count(b"\r\n") < lines:
                data += sock.recv(65536)
            self.owed[i] = 0
            replies.append(data.split(b"\r\n")[-2])  # the last line is this command's reply
        return replies

    def set_nx(self, key: str, token: str, ttl_ms: int) -> list[int]:
        """SET NX PX on every master; the indexes of those that granted it."""
        replies = self.call(pack("SET", key, token, "NX", "PX", ttl_ms))
        return [i for i, reply in enumerate(replies) if reply == b"+OK"]

    def retract(self, key: str, token: str, indexes: Sequence[int]) -> None:
        """The compare-and-delete on the masters at ``indexes``, not waited for: each socket
        reads its reply in front of its next command's (a failed attempt's retraction)."""
        packed = pack("EVALSHA", RELEASE_SHA, 1, key, token)
        for i in indexes:
            self.socks[i].sendall(packed)
            self.owed[i] += 1

    def release(self, key: str, token: str, indexes: Sequence[int]) -> None:
        """The compare-and-delete on the masters at ``indexes``, replies read."""
        self.call(pack("EVALSHA", RELEASE_SHA, 1, key, token), indexes)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
