"""What a new link says first, and what it learns: the server's identity, and whether it is an
independent Redis master at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection
from redis.credentials import UsernamePasswordCredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .. import wire

# Why a Sentinel-managed master is refused.
FAILOVER = (
    "Redlock needs independent masters, each reached directly: a failover-managed master loses "
    "its locks on failover (the replica promoted in its place may never have received them, and "
    "grants them again), so give one redis:// URL per master server"
)
# The kind under which a server that does not speak RESP is reported, wherever it shows.
NOT_REDIS = "not-redis"


class Unfit(RedisConnectionError):
    """A new link's handshake found a server that is no Redis master of its own (see
    Master.unfit); the message says what it is."""


class Silent(RedisTimeoutError):
    """A new link's server took the connection and did not answer the handshake in time."""


def connection_options(
    connection_class: type[redis.Connection], kwargs: dict[str, Any], request_timeout: float
) -> dict[str, Any]:
    options = dict(kwargs)
    options.update(
        socket_timeout=request_timeout,
        socket_connect_timeout=request_timeout,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        retry_on_error=[],
        health_check_interval=0,
        socket_keepalive=True,
        protocol=2,  # wire.Reader parses RESP2
        redis_connect_func=_no_handshake,
    )
    # redis-py 8 turns on "maintenance notifications" for URLs, which it refuses to run on a
    # RESP2 connection without hiredis; they are push messages we would not read anyway.
    options.pop("maint_notifications_config", None)
    options.pop("maint_notifications_pool_handler", None)
    if issubclass(connection_class, redis.UnixDomainSocketConnection):
        options.pop("socket_keepalive", None)
    return options


def _no_handshake(conn: AbstractConnection) -> None:
    """Stands in for redis-py's handshake (a round trip per command): see handshake_commands."""


def handshake_commands(conn: AbstractConnection) -> list[tuple[Any, ...]]:
    """What a new link sends before anything else, in one write: AUTH, CLIENT SETNAME and SELECT
    as the master's options ask, then ``INFO server`` (the server's run_id and mode) and ``INFO
    replication`` (its role): see :func:`check_identity`. (Master._open adds the scripts' loads.)"""
    commands: list[tuple[Any, ...]] = []
    if conn.credential_provider is not None or conn.username or conn.password:
        provider = conn.credential_provider or UsernamePasswordCredentialProvider(
            conn.username, conn.password
        )
        commands.append(("AUTH", *provider.get_credentials()))
    if conn.client_name:
        commands.append(("CLIENT", "SETNAME", conn.client_name))
    if conn.db:
        commands.append(("SELECT", conn.db))
    commands.append(("INFO", "server"))
    commands.append(("INFO", "replication"))
    return commands


def info_field(info: object, name: bytes) -> str:
    """The value of field ``name`` in an ``INFO`` reply ("" where there is none)."""
    if not isinstance(info, bytes):
        return ""
    start = info.find(b"\n" + name + b":")
    if start < 0:
        return ""
    start += len(name) + 2
    end = info.find(b"\r\n", start)
    return info[start : end if end >= 0 else len(info)].decode("ascii", "replace")


def check_identity(server: object, replication: object) -> None:
    """Raise :class:`Unfit` if a new link's ``INFO server`` and ``INFO replication`` replies
    say its server is no Redis master of its own. (A server that will not say is taken as one.)"""
    mode = info_field(server, b"redis_mode") or info_field(server, b"server_mode")  # valkey 8
    if mode == "cluster":
        raise Unfit(
            "a cluster node (cluster-enabled): a cluster moves keys between its nodes and fails over "
            "to replicas that never saw a lock; give one URL per independent server"
        )
    if mode == "sentinel":
        raise Unfit("a Sentinel, which holds no keys; give the URL of each master server itself")
    if info_field(replication, b"role") in ("slave", "replica"):
        of = f"{info_field(replication, b'master_host')}:{info_field(replication, b'master_port')}"
        raise Unfit(
            f"a replica of {of}: it keeps only what its master sends it (a resync drops our keys, "
            "and a read-only one refuses them); give the URL of each independent master"
        )


def describe(connection_class: type[redis.Connection], kwargs: dict[str, Any]) -> str:
    """How a master is named in messages: host:port, or its socket path (plus a non-zero db)."""
    if issubclass(connection_class, redis.UnixDomainSocketConnection):
        name = str(kwargs.get("path"))
    else:
        name = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    db = int(kwargs.get("db") or 0)
    return f"{name}/{db}" if db else name


def accept(commands: Sequence[Sequence[Any]], replies: list[Any], refused: Callable[[str, str], None]) -> str:
    """Judge a new link's replies (its handshake's ``commands``', then its script loads') and
    return the server's run_id; raises for a server the lock cannot use, and reports through
    ``refused`` (``Master.refused``) a refusal that leaves the link usable."""
    answers, loaded = replies[: len(commands)], replies[len(commands) :]
    for command, reply in zip(commands, answers, strict=True):
        _check_reply(str(command[0]), reply, refused)
    check_identity(answers[-2], answers[-1])
    # A refused SCRIPT LOAD (an ACL without it) leaves the link usable: each script is then
    # cached by the EVAL sent after its first NOSCRIPT. Reported, as that costs a round trip.
    refusal = next((reply for reply in loaded if isinstance(reply, wire.ReplyError)), None)
    if refusal is not None:
        refused("refused SCRIPT LOAD (scripts go by EVAL after a NOSCRIPT)", refusal)
    return info_field(answers[-2], b"run_id")


def _check_reply(name: str, reply: Any, refused: Callable[[str, str], None]) -> None:
    if name == "INFO":
        # An INFO refused (renamed, or an ACL user without it) leaves the server unidentified,
        # not unusable; one refused for want of AUTH means every command will be.
        if isinstance(reply, wire.ReplyError) and not reply.startswith("NOAUTH"):
            return
        if isinstance(reply, bytes):
            return
    elif reply == b"OK":
        return
    if isinstance(reply, wire.ReplyError):
        refused(f"refused {name} on a new connection", reply)
        raise RedisConnectionError(f"{name} refused: {reply}")
    raise wire.ProtocolError(f"{name} answered {reply!r}")  # an echo server, say
