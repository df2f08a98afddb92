"""One server must never cast two votes: masters that are one server are refused."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import redis

from ...errors import ConfigError
from .master import Master

logger = logging.getLogger("celery_redlock.masters")

# How long building a Redlock may wait for the masters' host names to resolve (all at once),
# to find two names of one server; a name not resolved by then is compared as written.
RESOLVE_TIMEOUT = 1.0


def refuse_shared_servers(masters: Sequence[Master]) -> None:
    """Raise ``ConfigError`` if two masters are one server, which would cast several votes.

    One server is one host and port (whatever names or databases reach it: ``localhost`` and
    ``127.0.0.1``, ``/0`` and ``/1``) or one unix socket (whatever path or symlink leads to it).
    Host names are resolved here, at construction, all at once and for ``RESOLVE_TIMEOUT`` at
    most; a name that does not resolve in time is compared as written (a server reached under
    two unresolved names is then caught at first contact, by its run id).
    """
    endpoints: list[tuple[str, Any]] = []
    for master in masters:
        options = master._options
        if issubclass(master._connection_class, redis.UnixDomainSocketConnection):
            endpoints.append(("unix", os.path.realpath(str(options.get("path")))))
        else:
            endpoints.append((str(options.get("host", "localhost")), int(options.get("port", 6379))))
    seen: dict[tuple[str, Any], Master] = {}
    for master, addresses in zip(masters, _resolve(endpoints), strict=True):
        for address in addresses:
            other = seen.get(address)
            if other is not None and other is not master:
                same = (
                    f"{master.name} is listed more than once"
                    if other.name == master.name
                    else f"{other.name} and {master.name} are one server"
                )
                raise ConfigError(
                    f"masters: {same}; each master must be an independent server, or one server "
                    "would cast several votes"
                )
        for address in addresses:
            seen[address] = master


class Identified(Protocol):
    """A new link as :func:`identify` reads it (the fast transport's, or an asyncio one)."""

    run_id: str

    def close(self) -> None: ...


def identify(masters: Sequence[Master], i: int, link: Identified) -> str:
    """Why master i's new link may carry nothing, or "": its server (by the run_id its
    handshake read) is another master's. Two URLs may lead to one server where nothing in them
    tells (a proxy, a NAT, an alias, another database of it); the run_id does. Both masters are
    then refused for good (their links closed), and the link is closed."""
    run_id = link.run_id
    master = masters[i]
    for other in masters:
        if run_id and other is not master and other.run_id == run_id:
            reason = (
                f"masters {other.name} and {master.name} are one server (run_id {run_id}): "
                "each master must be an independent server, or one server would cast several "
                "votes; this Redlock grants nothing until it is built with independent masters"
            )
            link.close()
            other.refuse(reason)
            master.refuse(reason)
            return reason
    return ""


def _resolve(endpoints: Sequence[tuple[str, Any]]) -> list[set[tuple[str, Any]]]:
    """Each endpoint's addresses: (ip, port) pairs, the unix path, or the name as written."""
    found: list[set[tuple[str, Any]]] = []
    lookups: dict[int, list[str]] = {}  # endpoint index -> the addresses its name resolved to
    for index, (host, port) in enumerate(endpoints):
        ip = _canonical_ip(host) if host != "unix" else None
        found.append({(ip, port)} if ip is not None else {(host.lower(), port)})
        if ip is None and host != "unix":
            lookups[index] = []
    if lookups:
        # getaddrinfo has no timeout of its own: each lookup runs in a daemon thread that is
        # left behind (and cannot hold up exit) if the resolver hangs.
        threads = []
        for index, answers in lookups.items():
            host, port = endpoints[index]
            thread = threading.Thread(
                target=_lookup, args=(host, port, answers), name="redlock-resolve", daemon=True
            )
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + RESOLVE_TIMEOUT
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for index, answers in lookups.items():
            found[index] |= {(ip, endpoints[index][1]) for ip in list(answers)}
    return found


def _lookup(host: str, port: int, answers: list[str]) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return  # unresolvable: the name as written is all there is to compare
    answers.extend(ip for ip in (_canonical_ip(str(info[4][0])) for info in infos) if ip is not None)


def _canonical_ip(text: str) -> str | None:
    """One spelling per host address; None if ``text`` is not an IP address."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        # The IPv6 loopback is the same host as the IPv4 one: a server listening on one
        # (Redis's default bind is "127.0.0.1 -::1") is the one listening on the other.
        if ip.is_loopback:
            return "127.0.0.1"
    return str(ip)
