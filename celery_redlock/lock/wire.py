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

# Nearly every reply a lock command gets is one of these whole lines (OK, 1, 0, nil).
_SHORT_REPLIES: Final[dict[bytes, Any]] = {b"+OK\r\n": b"OK", b":1\r\n": 1, b":0\r\n": 0, b"$-1\r\n": None}


def _short_runs(longest: int) -> dict[bytes, tuple[int, Any]]:
    runs: dict[bytes, tuple[int, Any]] = {}
    layer = dict(_SHORT_REPLIES)  # every run of `count` short replies -> its last reply
    for count in range(1, longest + 1):
        runs.update((data, (count, last)) for data, last in layer.items())
        layer = {data + line: value for data in layer for line, value in _SHORT_REPLIES.items()}
    return runs


# What one recv usually holds: the replies owed to commands nobody waited for (carried releases)
# and then this round's own, all short. Looked up whole, as (how many replies, the last one).
SHORT_RUNS: Final[dict[bytes, tuple[int, Any]]] = _short_runs(3)


def _encode(arg: Any) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode("utf-8", "surrogatepass")
    if isinstance(arg, int) and not isinstance(arg, bool):
        return b"%d" % arg
    raise TypeError(f"cannot send a {type(arg).__name__} to a master: {arg!r}")


def _bulk(arg: Any) -> bytes:
    data = arg.encode("utf-8", "surrogatepass") if type(arg) is str else _encode(arg)
    return b"$%d\r\n%b\r\n" % (len(data), data)


def pack(command: Sequence[Any]) -> bytes:
    """One command as a RESP2 array of bulk strings."""
    return b"*%d\r\n" % len(command) + b"".join(map(_bulk, command))


class _Slot:
    __slots__ = ()

    def __repr__(self) -> str:
        return "SLOT"


# Marks, in a Template's command, an argument given per call.
SLOT: Final = _Slot()


class Template:
    """A command packed once, but for the arguments marked :data:`SLOT`, which ``pack`` fills.

    A lock sends the same few commands on every call, and the script's source alone is over a
    hundred bytes; only the key, the token and the TTL change. The fixed parts are packed here,
    and each call is then one ``%`` format of the whole command.
    """

    __slots__ = ("_format", "_slots")

    def __init__(self, command: Sequence[Any]) -> None:
        pieces = [b"*%d\r\n" % len(command)]
        for arg in command:
            pieces.append(b"$%d\r\n%b\r\n" if arg is SLOT else _bulk(arg).replace(b"%", b"%%"))
        self._format = b"".join(pieces)
        self._slots = sum(1 for arg in command if arg is SLOT)

    def pack(self, *values: Any) -> bytes:
        if len(values) != self._slots:
            raise TypeError(f"this command takes {self._slots} arguments, got {len(values)}")
        fields: list[Any] = []
        for value in values:
            data = value.encode("utf-8", "surrogatepass") if type(value) is str else _encode(value)
            fields += (len(data), data)
        return self._format % tuple(fields)


class Reader:
    """Replies parsed out of the bytes fed to it, in order; partial replies wait for more."""

    __slots__ = ("_buffer", "_position")

    def __init__(self) -> None:
        self._buffer = b""
        self._position = 0

    def feed(self, data: bytes) -> None:
        if self._position >= len(self._buffer):  # all read: the usual case, nothing to keep
            self._buffer = data
            self._position = 0
        elif self._position:
            self._buffer = self._buffer[self._position :] + data
            self._position = 0
        else:
            self._buffer += data

    def buffered(self) -> bool:
        return self._position < len(self._buffer)

    def get(self) -> Any:
        """The next complete reply, or :data:`NOTHING` until one has been fed in full."""
        start = self._position
        line_end = self._buffer.find(b"\n", start) + 1
        if line_end:
            short = _SHORT_REPLIES.get(self._buffer[start:line_end], NOTHING)
            if short is not NOTHING:
                self._position = line_end
                return short
        reply, end = self._parse(start)
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
        kind = buffer[start : start + 1]
        line = buffer[start + 1 : line_end]
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
                return buffer[after : after + size], after + size + 2
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
        raise ProtocolError(f"unexpected reply from a master: {buffer[start : line_end + 2]!r}")
