"""What the lock masters hold, read straight from each server (not through a lock)."""

from __future__ import annotations

from collections.abc import Iterable

from celery_redlock.testing import RedisServer


def pttls(masters: Iterable[RedisServer], key: str) -> list[int]:
    """``key``'s PTTL on each master, in milliseconds (-2: no such key, -1: no expiry)."""
    found = []
    for server in masters:
        client = server.client()
        try:
            found.append(int(client.pttl(key)))
        finally:
            client.close()
    return found


def holding(masters: Iterable[RedisServer], key: str) -> list[bool]:
    """Whether each master has ``key`` (EXISTS: a reentrant lock's key is a hash)."""
    found = []
    for server in masters:
        client = server.client()
        try:
            found.append(bool(client.exists(key)))
        finally:
            client.close()
    return found


def set_on(masters: Iterable[RedisServer], key: str, value: str | None, px: int = 10_000) -> None:
    """``key`` set to ``value`` for ``px`` ms (None: deleted) on each of ``masters``, directly:
    what a split vote, another holder, or a key expiring on some masters leaves there."""
    for server in masters:
        client = server.client(socket_timeout=5)
        try:
            if value is None:
                client.delete(key)
            else:
                client.set(key, value, px=px)
        finally:
            client.close()
