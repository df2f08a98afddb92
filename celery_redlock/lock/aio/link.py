"""One asyncio connection to one master: commands written in order, replies matched in order.

A :class:`Link` is an :class:`asyncio.Protocol`: ``data_received`` parses replies with
:mod:`..wire` and hands each to the :class:`Entry` at the head of the link's queue, so a reply
always reaches the command it answers, whoever still waits for it. A caller that stops waiting
(its deadline passed, its task was cancelled) leaves its entries queued: their replies are read
and dropped as they come, and the link *owes* them until then; it is never handed to another
exchange while it does (see :mod:`.site`). Nothing here blocks: a write is ``transport.write``.

NOSCRIPT (the master lost its scripts and ran nothing): the command is written again as
``EVAL`` on the same link, at once, while someone still waits for it or when it must not be lost
(a release); a vote whose caller stopped waiting ran nothing and is not sent again (sent after
its retraction, it could set a key nobody deletes).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import weakref
from collections.abc import Callable
from typing import Any, cast

from ..._fork import let_go_of_inherited, on_fork_in_child
from .. import wire
from ..transport.commands import COMMON_OK, NOSCRIPT, REPLY_ERROR, Command, Outcome, eval_form
from ..transport.master import Master

logger = logging.getLogger("celery_redlock.aio.link")


class Sink:
    """Where the replies of one call go: one slot per command (see ``exchange.Gather``)."""

    def put(self, slot: int, outcome: Outcome) -> None: ...

    def waiting(self) -> bool:
        """Whether the caller still waits for its replies."""
        return False


class Entry:
    """One command written on a link, waiting for its reply: who wants it (``sink``, None if
    nobody), and whether it must not be lost (``keep``: a release, sent again elsewhere if the
    link is lost before it is answered)."""

    __slots__ = ("command", "keep", "sink", "slot")

    def __init__(self, sink: Sink | None, slot: int, command: Command | None, keep: bool) -> None:
        self.sink = sink
        self.slot = slot
        self.command = command
        self.keep = keep


def outcome_of(reply: Any, master: Master) -> Outcome:
    """A reply as an outcome, worded as the blocking transports word it."""
    if type(reply) is not list:
        common = COMMON_OK.get(reply)
        if common is not None:
            return common
    if isinstance(reply, wire.ReplyError):
        if not reply.startswith(NOSCRIPT):
            # No lock command fails on a master that serves us: reported (rate-limited).
            master.refused("refused a command", reply)
        return Outcome("error", detail=REPLY_ERROR + reply)
    return Outcome("ok", reply)


class Link(asyncio.Protocol):
    """One connection to ``master`` (see the module docstring)."""

    def __init__(self, master: Master, on_lost: Callable[[Link, list[Entry]], None]) -> None:
        self.master = master
        self.transport: asyncio.Transport | None = None
        self.reader = wire.Reader()
        self.queue: collections.deque[Entry] = collections.deque()
        self.closed = False
        # Why this side closed it: what the server sent was not RESP (see data_received).
        self.protocol_error: wire.ProtocolError | None = None
        self.run_id = ""
        # Called once the queue empties (the site then takes the link back as idle).
        self.on_drained: Callable[[Link], None] | None = None
        self._on_lost = on_lost
        let_go_in_a_child(self)

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, read and written: asyncio's own, or one that only has its methods
        # (uvloop's TCPTransport and UnixTransport subclass no asyncio class), hence no check.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        queue = self.queue
        reader.feed(data)
        try:
            while True:
                reply = reader.get()
                if reply is wire.NOTHING:
                    break
                if not queue:
                    raise wire.ProtocolError(f"a reply nobody asked for: {reply!r}")
                entry = queue.popleft()
                # The usual reply (OK, 1, 0, nil) to someone waiting, without _answer's checks:
                # outcome_of's first rule, which no NOSCRIPT or error reply meets.
                common = COMMON_OK.get(reply) if type(reply) is not list else None
                if common is not None and entry.sink is not None:
                    entry.sink.put(entry.slot, common)
                else:
                    self._answer(entry, reply)
        except wire.ProtocolError as exc:
            logger.warning("master %s sent what is not a reply: %s", self.master.name, exc)
            self.protocol_error = exc
            self.close()
            return
        if not queue and self.on_drained is not None:
            on_drained, self.on_drained = self.on_drained, None
            on_drained(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        entries = list(self.queue)
        self.queue.clear()
        self.on_drained = None
        self._on_lost(self, entries)

    # -- use ----------------------------------------------------------------------------------------
    def write(self, data: bytes, entries: list[Entry]) -> None:
        """Write ``data`` (the packed commands of ``entries``, in order); their replies go to
        their sinks. On a closed link the entries are given to ``on_lost`` at once."""
        if self.closed or self.transport is None or self.transport.is_closing():
            self._on_lost(self, entries)
            return
        self.transport.write(data)
        self.queue.extend(entries)

    def owes(self) -> bool:
        return bool(self.queue)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()  # connection_lost follows, from the loop
        self.closed = True

    def _answer(self, entry: Entry, reply: Any) -> None:
        sink = entry.sink
        if type(reply) is wire.ReplyError and reply.startswith(NOSCRIPT):
            resent = eval_form(entry.command)
            if resent is not None and (entry.keep or (sink is not None and sink.waiting())):
                assert self.transport is not None
                self.transport.write(resent)
                self.queue.append(Entry(sink, entry.slot, None, entry.keep))
                return
            if entry.keep:
                logger.warning("master %s lost a script and a release could not be resent", self.master.name)
        if sink is not None:
            sink.put(entry.slot, outcome_of(reply, self.master))


# The protocol of every connection this process made (a Link; a listening link's ear, once the
# subscriber has switched its transport to it), held weakly: a forked child lets go of its copies
# of their sockets.
_made: weakref.WeakSet[asyncio.Protocol] = weakref.WeakSet()
# The socket of every connect this process began, from before its connect: a fork while the
# connect is under way (the protocol has no transport yet) finds it here.
_opened: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def let_go_in_a_child(connection: asyncio.Protocol | socket.socket) -> None:
    """Register ``connection``, a socket or a protocol (whose ``transport`` attribute is its
    connection's, once made): a forked child lets go of its copy of that socket (see
    :func:`_let_go_inherited`)."""
    if isinstance(connection, socket.socket):
        _opened.add(connection)
    else:
        _made.add(connection)


def _let_go_inherited() -> None:
    """In a forked child: let go of the child's copy of every connection's socket.

    The child never runs its parent's event loop, and whatever holds the parent's AsyncRedlock
    (a module, a coroutine frame that was running at the fork) keeps its links, and their
    sockets, for as long as the child lives: the parent's connections would stay open on the
    masters after the parent is gone (see ``_fork.let_go_of_inherited``).
    """
    protocols, opened = list(_made), list(_opened)
    _made.clear()
    _opened.clear()
    transports = [getattr(protocol, "transport", None) for protocol in protocols]
    sockets = [t.get_extra_info("socket") for t in transports if t is not None]
    # A socket met twice (its connect registered it, and then its transport) is let go of once
    # and is then /dev/null's: the second time changes nothing.
    let_go_of_inherited([*(sock for sock in sockets if sock is not None), *opened])


on_fork_in_child(_let_go_inherited)
