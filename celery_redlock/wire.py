"""The Redis wire protocol (RESP2), as far as lock commands and their replies need it.

Every lock operation sends one tiny command to each master and reads one tiny reply back, so
the cost per operation is set by syscalls and per-call Python work, not by bytes. This module
packs a command once per round and parses replies out of whatever a ``recv`` returned, without
redis-py's per-reply machinery. Connections are still made by redis-py (TLS, AUTH, ACL users,
SELECT); only the lock traffic goes through here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final


class ProtocolError(Exception):
    """The master sent something that is not a RESP2 reply; the connection must be dropped."""


class ReplyError(str):
    """An error reply (``-ERR ...``) from a master: a value, not an exception, because it is
    one master's answer among N."""

    __slots__ = ()


class _Nothing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOTHING"


# What Reader.get returns while no complete reply is buffered (None is a valid reply: nil).
NOTHING: Final = _Nothing()


def _encode(arg: Any) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode("utf-8", "surrogatepass")
    if isinstance(arg, int) and not isinstance(arg, bool):
        return b"%d" % arg
    raise TypeError(f"cannot send a {type(arg).__name__} to a master: {arg!r}")


def pack(command: Sequence[Any]) -> bytes:
    """One command as a RESP2 array of bulk strings."""
    out = bytearray(b"*%d\r\n" % len(command))
    for arg in command:
        kind = type(arg)
        if kind is str:
            data = arg.encode("utf-8", "surrogatepass")
        elif kind is bytes:
            data = arg
        else:
            data = _encode(arg)
        out += b"$%d\r\n" % len(data)
        out += data
        out += b"\r\n"
    return bytes(out)


class Reader:
    """Replies parsed out of the bytes fed to it, in order; partial replies wait for more."""

    __slots__ = ("_buffer", "_position")

    def __init__(self) -> None:
        self._buffer = b""
        self._position = 0

    def feed(self, data: bytes) -> None:
        if self._position:
            self._buffer = self._buffer[self._position:] + data
            self._position = 0
        else:
            self._buffer += data

    def buffered(self) -> bool:
        return self._position < len(self._buffer)

    def get(self) -> Any:
        """The next complete reply, or :data:`NOTHING` until one has been fed in full."""
        reply, end = self._parse(self._position)
        if end < 0:
            return NOTHING
        self._position = end
        return reply

    def _parse(self, start: int) -> tuple[Any, int]:
        # (reply, index after it) or (None, -1) while incomplete.
        buffer = self._buffer
        line_end = buffer.find(b"\r\n", start)
        if line_end < 0:
            return None, -1
        kind = buffer[start:start + 1]
        line = buffer[start + 1:line_end]
        after = line_end + 2
        try:
            if kind == b"+":
                return line, after
            if kind == b":":
                return int(line), after
            if kind == b"-":
                return ReplyError(line.decode("utf-8", "replace")), after
            if kind == b"$":
                size = int(line)
                if size < 0:
                    return None, after
                if len(buffer) < after + size + 2:
                    return None, -1
                return buffer[after:after + size], after + size + 2
            if kind == b"*":
                count = int(line)
                if count < 0:
                    return None, after
                items = []
                for _ in range(count):
                    item, after = self._parse(after)
                    if after < 0:
                        return None, -1
                    items.append(item)
                return items, after
        except ValueError:
            pass
        raise ProtocolError(f"unexpected reply from a master: {buffer[start:line_end + 2]!r}")
