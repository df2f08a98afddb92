"""The RESP2 packer and reply reader that carry lock traffic.

The reader is fed the bytes a real master sends back, whole and split at every byte, since a
``recv`` may end anywhere inside a reply.
"""

from __future__ import annotations

import socket

import pytest

from celery_redlock.lock import scripts
from celery_redlock.lock.wire import (
    NOTHING,
    SHORT_RUNS,
    SLOT,
    ProtocolError,
    Reader,
    ReplyError,
    Template,
    pack,
)
from celery_redlock.testing import ServerSet

COMMANDS = [
    ("SET", "wire:a", "token", "NX", "PX", 60_000),
    ("SET", "wire:a", "token", "NX", "PX", 60_000),  # refused: nil
    ("GET", "wire:a"),
    ("GET", "wire:missing"),
    ("EVAL", scripts.RELEASE.source, 1, "wire:a", "token"),
    ("EXISTS", "wire:a"),
    ("SET", "wire:é", b"\x00\xffbinary", "PX", 60_000),
    ("GET", "wire:é"),
    ("MGET", "wire:é", "wire:missing"),
    ("NOSUCHCOMMAND",),
    ("EVAL", "return {1, {2, 'x'}, redis.error_reply('boom')}", 0),
]
EXPECTED = [
    b"OK",
    None,
    b"token",
    None,
    1,
    0,
    b"OK",
    b"\x00\xffbinary",
    [b"\x00\xffbinary", None],
    "ERR",
    [1, [2, b"x"], "boom"],
]


def raw_replies(masters: ServerSet) -> bytes:
    """What a real master answers to COMMANDS, as bytes off the socket."""
    with socket.create_connection((masters[0].host, masters[0].port), timeout=5) as sock:
        sock.sendall(b"".join(pack(c) for c in COMMANDS))
        data = b""
        reader = Reader()
        replies = 0
        while replies < len(COMMANDS):
            chunk = sock.recv(65536)
            assert chunk, "the master closed the connection"
            data += chunk
            reader.feed(chunk)
            while reader.get() is not NOTHING:
                replies += 1
    return data


def check(replies: list[object]) -> None:
    assert len(replies) == len(EXPECTED)
    for got, expected in zip(replies, EXPECTED, strict=True):
        if expected == "ERR":
            assert isinstance(got, ReplyError) and got.startswith("ERR unknown command"), got
        elif isinstance(expected, list) and isinstance(expected[-1], str):
            assert isinstance(got, list) and got[:-1] == expected[:-1]
            assert isinstance(got[-1], ReplyError) and got[-1].endswith("boom")
        else:
            assert got == expected


@pytest.mark.timeout(30)
def test_reader_parses_a_real_masters_replies_whole_and_split(masters: ServerSet) -> None:
    data = raw_replies(masters)
    whole = Reader()
    whole.feed(data)
    replies = []
    while (reply := whole.get()) is not NOTHING:
        replies.append(reply)
    check(replies)
    assert not whole.buffered()

    for cut in range(1, len(data)):
        reader = Reader()
        replies = []
        for part in (data[:cut], data[cut:]):
            reader.feed(part)
            while (reply := reader.get()) is not NOTHING:
                replies.append(reply)
        check(replies)

    reader = Reader()
    replies = []
    for byte in data:
        reader.feed(bytes([byte]))
        while (reply := reader.get()) is not NOTHING:
            replies.append(reply)
    check(replies)


def test_reader_rejects_what_is_not_resp2() -> None:
    reader = Reader()
    reader.feed(b"HTTP/1.1 400 Bad Request\r\n")
    with pytest.raises(ProtocolError, match=r"HTTP/1\.1"):
        reader.get()
    reader = Reader()
    reader.feed(b":twelve\r\n")
    with pytest.raises(ProtocolError):
        reader.get()


def test_pack_refuses_values_it_cannot_send_faithfully() -> None:
    with pytest.raises(TypeError, match="float"):
        pack(("SET", "k", 1.5))
    with pytest.raises(TypeError, match="bool"):
        pack(("SET", "k", True))


def test_a_template_packs_what_pack_packs() -> None:
    # Fixed parts are %-escaped inside the template's format: a script with a literal % in it
    # and a key with one must both come out byte for byte as pack() makes them.
    script = "return string.format('%d%%', 5)"
    template = Template(("EVAL", script, 1, SLOT, SLOT, "PX", SLOT))
    for key, token, ttl in [("k", "t", 1), ("wire:%d é", b"\x00\xff%s", 60_000), ("", "", 0)]:
        assert template.pack(key, token, ttl) == pack(("EVAL", script, 1, key, token, "PX", ttl))
    with pytest.raises(TypeError, match="3 arguments, got 2"):
        template.pack("k", "t")
    with pytest.raises(TypeError, match="float"):
        template.pack("k", "t", 1.5)


def test_short_runs_read_as_the_reader_reads_them() -> None:
    # The link takes a recv that is exactly one of these whole, without the reader; the table
    # must say what the reader would have said: how many replies, and the last of them.
    assert len(SHORT_RUNS) == 4 + 4**2 + 4**3
    for data, (count, last) in SHORT_RUNS.items():
        reader = Reader()
        reader.feed(data)
        replies = []
        while (reply := reader.get()) is not NOTHING:
            replies.append(reply)
        assert (len(replies), replies[-1]) == (count, last), data
