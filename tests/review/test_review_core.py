"""The lock core's release, seen from the masters: a release that is waited for must still reach
a master it could not be written to (``keep``), as the fire-and-forget one does; and it returns
once a quorum has *granted* the release, not once a quorum has merely answered."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from celery_redlock import Redlock
from celery_redlock.lock import masters as master_module
from celery_redlock.testing import ProxySet, ServerSet

from ..waiting import wait_for


def _keys_left(servers: Any, key: str) -> list[int]:
    found = []
    for server in servers:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        try:
            found.append(int(client.exists(key)))
        finally:
            client.close()
    return found


@pytest.fixture(scope="module")
def masters() -> Any:
    with ServerSet(3) as servers:
        yield servers


@pytest.mark.timeout(60)
def test_a_waited_release_a_master_could_not_be_written_is_kept_for_its_next_link(masters: ServerSet) -> None:
    """One master of three resets every connection as ``release()`` is called: a quorum answers,
    so it returns True; the master that missed it must get it on its next link (the commit's
    "the command is kept for a master with no link"), not keep the key for the 30 s TTL."""
    masters.ensure_running()
    with (
        ProxySet([server.address for server in masters]) as proxies,
        Redlock(proxies.urls, retry_count=0, request_timeout=0.5) as rl,
    ):
        lock = rl.lock("review-kept-waited", ttl=30)
        assert lock.acquire(blocking=False), lock.last_error
        proxies.proxies[0].cut()
        assert lock.release() is True
        assert _keys_left(masters[1:], "redlock:review-kept-waited") == [0, 0]
        assert _keys_left(masters[:1], "redlock:review-kept-waited") == [1]  # not written yet
        proxies.heal()
        healed = time.monotonic()
        gone = wait_for(
            lambda: _keys_left(masters[:1], "redlock:review-kept-waited") == [0],
            master_module.BACKOFF_CAP + 3.0,
        )
        assert gone, (
            "the master that missed the waited release still holds the key "
            f"{time.monotonic() - healed:.1f} s after it came back (it keeps it until the 30 s TTL)"
        )


@pytest.mark.timeout(60)
def test_a_release_returns_once_a_quorum_granted_it_not_once_a_quorum_answered(masters: ServerSet) -> None:
    """Master 0 answers the release with an error (its ACL refuses scripts), master 1 deletes the
    key at once, master 2 deletes it but its reply comes 0.3 s late: two masters of three released
    it, a quorum, so ``release()`` is True; counting master 0's error as one of the quorum's
    answers would return False at once, with master 2's reply still on its way."""
    masters.ensure_running()
    admin = redis.Redis.from_url(masters[0].url, socket_timeout=5)
    with (
        ProxySet([server.address for server in masters]) as proxies,
        Redlock(proxies.urls, retry_count=0, request_timeout=2.0) as rl,
    ):
        lock = rl.lock("review-enough", ttl=30)
        assert lock.acquire(blocking=False), lock.last_error
        admin.execute_command("ACL", "SETUSER", "default", "-@scripting")
        try:
            proxies.proxies[2].delay(0.3, "down")
            released = lock.release()
        finally:
            admin.execute_command("ACL", "SETUSER", "default", "+@all")
            admin.close()
        assert _keys_left(masters[1:], "redlock:review-enough") == [0, 0]
        assert released is True, "a release that took effect on two masters of three answered False"
