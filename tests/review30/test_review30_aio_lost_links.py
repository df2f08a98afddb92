"""Review of 97e25c9: links lost under asyncio rounds, with the loop busy, on real masters.

Site.unanswered is now the one handler of entries a lost link never answered: the releases kept,
the waiting votes failed at once. Checked here: a release written to a master that is then
restarted with its data (its reply never read) still deletes the key there, once; a vote lost
with its link is one "error" per master, not two outcomes for a slot (a Gather that counted a
slot twice would end early and report some master as late); an acquire after a restart under a
busy loop is granted by every master again (nothing marks the restarted one unfit).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from celery_redlock import AsyncRedlock
from celery_redlock.testing import ServerSet
from tests.asyncio.conftest import take
from tests.onmasters import holding
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def persistent() -> Iterator[ServerSet]:
    with ServerSet(5, persistent=True) as servers:
        yield servers


def test_a_release_whose_link_is_lost_to_a_restart_still_deletes_the_key_there(persistent: ServerSet) -> None:
    servers = persistent
    servers.ensure_running()

    async def main() -> tuple[bool, list[str], list[str]]:
        async with AsyncRedlock(servers.urls, ttl=30.0, request_timeout=1.0, retry_count=0) as rl:
            lock = rl.lock("review30:lost-release")
            assert await take(lock), lock.last_error
            assert all(v.kind == "yes" for v in lock.last_votes), lock.last_votes
            key = lock.key
            servers[0].pause()  # its DEL will sit unread in its socket
            released = await lock.release()  # four answered: a quorum, not waited for the fifth
            # Killed with its DEL unread and brought back with its data (the key, TTL 30 s),
            # while the loop is busy: the reset is read only afterwards.
            servers[0].restart(keep_data=True)
            time.sleep(0.3)
            gone = await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_for(lambda: not any(holding(servers, key)), 10.0)
            )
            assert gone, f"the kept release never reached the restarted master: {holding(servers, key)}"
            # Killed again under idle links, loop busy: the next round's votes there fail at
            # once, each slot once; then, back, it grants again (not refused for good).
            for server in list(servers)[:2]:
                server.kill()
            time.sleep(0.3)
            other = rl.lock("review30:after-kill")
            started = time.monotonic()
            assert await other.acquire(blocking=False), other.last_error
            took = time.monotonic() - started
            votes = [v.kind for v in other.last_votes]
            await other.release()
            assert took < 0.5, took  # not the 1 s request timeout
            for server in list(servers)[:2]:
                server.restart(keep_data=True)
            time.sleep(0.3)
            again = rl.lock("review30:after-restart")
            deadline = time.monotonic() + 10.0
            while True:
                assert await take(again), again.last_error
                back = [v.kind for v in again.last_votes]
                await again.release()
                if back == ["yes"] * 5 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)  # a restarted master's backoff
            return released, votes, back

    released, votes, back = asyncio.run(main())
    assert released
    assert len(votes) == 5 and votes[:2] == ["error", "error"] and votes[2:] == ["yes"] * 3, votes
    assert back == ["yes"] * 5, back
