"""Issue 26 review: the one vote tally (lock/tally.py) decides a re-entry by its own predicate. A
master whose R_ENTER answers 0 no longer holds the token: that is a refusal, never a grant, even
while the holding's own validity has time left."""

from __future__ import annotations

import threading

import pytest

from celery_redlock import LockLost, Redlock
from celery_redlock.testing import ServerSet
from tests.core.conftest import take_everywhere

from .conftest import TRANSPORTS


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_reentry_where_a_quorum_lost_the_key_is_lost_not_granted(
    masters: ServerSet, transport: str
) -> None:
    """The key is deleted on two masters of three while its owner's validity lasts (an operator's
    force-release, masters restarted empty), and another owner takes the lock there. The first
    owner's re-entry must raise LockLost; granted, it would hold beside the new owner."""
    with Redlock(masters.urls, retry_count=0, transport=transport) as rl:
        lock = rl.lock("reenter-gone", ttl=30, reentrant=True)
        take_everywhere(lock)  # the premise: deleted on two masters, it is left on one
        for server in masters[:2]:
            client = server.client()
            try:
                client.delete("redlock:reenter-gone")
            finally:
                client.close()
        taken: list[bool] = []
        holding, done = threading.Event(), threading.Event()

        def other_owner() -> None:
            theirs = rl.lock("reenter-gone", ttl=30, reentrant=True)
            taken.append(theirs.acquire(blocking=False))
            holding.set()
            done.wait(10)
            theirs.release()

        other = threading.Thread(target=other_owner)
        other.start()
        assert holding.wait(10) and taken == [True]
        assert lock.owned()  # its own validity has not run out: only the masters can tell
        with pytest.raises(LockLost):
            lock.acquire(blocking=False)
        assert not lock.owned() and lock.depth == 1
        lock.release()
        done.set()
        other.join(10)
