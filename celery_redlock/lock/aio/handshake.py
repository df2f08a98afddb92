"""A new asyncio link: connected, and its handshake answered, by a deadline.

The handshake is the blocking transports' (:mod:`..transport.handshake`): AUTH, CLIENT SETNAME
and SELECT as the master's options ask, ``INFO server`` and ``INFO replication`` (its run id,
and whether it is a Redis master of its own), then a ``SCRIPT LOAD`` of every script, all in one
write; the replies are judged by the same rule (``Master.accept_handshake``). Only the socket is
asyncio's, and for a ``rediss://`` master its TLS (the site's context, :mod:`.tls`): the TCP
connect and the TLS handshake are one step, bounded by the connect's deadline like the rest.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import redis

from .. import wire
from ..transport.commands import Outcome, script_loads
from ..transport.handshake import Silent, handshake_commands
from .link import Entry, Link, Sink, let_go_in_a_child
from .site import LINK_LOST, Site


class _Replies(Sink):
    """The handshake's replies, in order; done once all have come."""

    def __init__(self, count: int) -> None:
        self.values: list[Any] = [None] * count
        self.missing = count
        self.done = asyncio.get_running_loop().create_future()

    def put(self, slot: int, outcome: Outcome) -> None:
        self.values[slot] = outcome
        self.missing -= 1
        if not self.missing and not self.done.done():
            self.done.set_result(None)

    def waiting(self) -> bool:
        return not self.done.done()


async def open_link(site: Site, deadline: float, load_scripts: bool = True) -> Link:
    """A new link to ``site``'s master by ``deadline`` (see the module docstring); raises
    ``ConnectionError`` (or ``TimeoutError``, ``OSError``) and leaves nothing open.
    ``load_scripts``: it also loads every script (a listening link, which runs none, does not)."""
    master = site.master
    if master.unfit or master.refusal:
        raise ConnectionError(master.unfit or master.refusal)
    loop = asyncio.get_running_loop()
    options = master._options
    conn = master._connection_class(**options)  # only read for its options; never connected
    link = Link(master, lambda lost, entries: site.unanswered(entries, LINK_LOST))
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no time left to connect within request_timeout")
    tls = site.tls
    if issubclass(master._connection_class, redis.UnixDomainSocketConnection):
        opening = _open(link, [(socket.AF_UNIX, socket.SOCK_STREAM, 0, "", str(options["path"]))])
    else:
        host, port = options.get("host", "localhost"), options.get("port", 6379)
        infos = _numeric(host, port) or loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        # The host name is sent (SNI) and checked against the certificate, as redis-py does.
        opening = _open(link, infos, tls, host)
    try:
        await asyncio.wait_for(opening, remaining)
    except asyncio.TimeoutError:
        what = "TCP connect and TLS handshake" if tls is not None else "TCP connect"
        raise TimeoutError(f"no {what} within request_timeout ({site.request_timeout:g} s)") from None
    try:
        link.run_id = await _greet(link, conn, site, deadline, load_scripts)
    except BaseException:
        link.close()
        raise
    return link


def _numeric(host: str, port: int) -> list[Any] | None:
    """``host``'s one address when it is an IP address (getaddrinfo's tuple), as the loop's own
    connect finds it without a resolver thread; None for a name."""
    for family, address in ((socket.AF_INET, (host, port)), (socket.AF_INET6, (host, port, 0, 0))):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", address)]
    return None


async def _open(link: Link, addresses: Any, tls: Any = None, host: str | None = None) -> None:
    """Connect ``link`` to the first of ``addresses`` (getaddrinfo's tuples, or an awaitable of
    them) that accepts, then make it the socket's protocol (over TLS if ``tls``).

    The socket is made here, not by the loop, and registered for a forked child before its
    connect begins: a fork while it is under way (for as long as request_timeout against a slow
    master, or a TLS handshake) must let go of it too, or the child keeps the parent's
    connection open after the parent is gone (see link.let_go_in_a_child)."""
    loop = asyncio.get_running_loop()
    if not isinstance(addresses, list):
        addresses = await addresses
    failure: OSError = OSError("no address to connect to")
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        let_go_in_a_child(sock)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            failure = exc
            continue
        except BaseException:
            sock.close()
            raise
        try:
            if family == socket.AF_UNIX:
                await loop.create_unix_connection(lambda: link, sock=sock)
            else:
                await loop.create_connection(
                    lambda: link, sock=sock, ssl=tls, server_hostname=host if tls is not None else None
                )
        except BaseException:
            sock.close()
            raise
        return
    raise failure


async def _greet(link: Link, conn: Any, site: Site, deadline: float, load_scripts: bool) -> str:
    """The handshake on a new ``link`` (and the scripts' loads), its replies checked by
    ``deadline``: the master's run id. Raises what makes the link unusable."""
    commands = handshake_commands(conn)
    loads = script_loads() if load_scripts else []
    everything = [*commands, *loads]
    replies = _Replies(len(everything))
    link.write(
        b"".join(map(wire.pack, everything)),
        [Entry(replies, j, None, False) for j in range(len(everything))],
    )
    remaining = deadline - time.monotonic()
    try:
        await asyncio.wait_for(asyncio.shield(replies.done), max(0.0, remaining))
    except asyncio.TimeoutError:
        raise Silent(
            f"accepted the connection and did not answer within {site.request_timeout:g} s (a "
            "connect's bound: request_timeout; a paused or overloaded server, or no Redis server)"
        ) from None
    if link.protocol_error is not None:
        raise link.protocol_error  # what it sent is not RESP: no Redis server (Site.connect)
    if link.closed:
        # Lost before every reply came (see Site.unanswered): the missing ones read as
        # errors, which the checks would take for the server's own answers (a refused
        # AUTH) and never contact the master again. A lost connection.
        raise ConnectionError("the connection was lost during the handshake")
    return site.master.accept_handshake(commands, [_value(o) for o in replies.values])


def _value(outcome: Outcome) -> Any:
    """An outcome back as the reply the handshake checks read (an error as a ReplyError)."""
    if outcome.kind == "error":
        return wire.ReplyError(outcome.detail.partition(": ")[2])
    return outcome.value
