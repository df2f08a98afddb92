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
