"""An acquire attempt stops waiting once a quorum granted (Redlock.try_acquire's INVARIANT).

Properties, each attacked with real masters (paused, or behind a proxy that holds one link's
bytes back):

- a slow or stopped master costs a granted attempt nothing: it votes ``pending``;
- the lock's release reaches every master after the SET it undoes, even when the SET was not
  waited for and another round of the process holds the links the attempt would have parked:
  no key of a released lock is left on any master;
- extensions in the meantime (one lock, or a heartbeat's batch) do not disturb that order.
"""

from __future__ import annotations

import time

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import ProxySet, ServerSet

from .conftest import every_vote, keys_on, take, wait_for

pytestmark = pytest.mark.timeout(60)


def set_calls(server: object) -> int:
    """How many SETs the server has run (its command statistics)."""
    client = server.client()  # type: ignore[attr-defined]
    try:
        stats = client.info("commandstats").get("cmdstat_set", {})
    finally:
        client.close()
    return int(stats.get("calls", 0))


def warm(redlock: Redlock) -> None:
    """Every master's link made and answering, one set parked (the usual steady state)."""
    deadline = time.monotonic() + 10
    while redlock.read_everywhere("warm-up") != [None] * len(redlock.masters):
        assert time.monotonic() < deadline, "the masters never all answered"


def test_a_paused_master_costs_a_granted_attempt_nothing(masters: ServerSet, transport: str) -> None:
    request_timeout = 2.0
    with Redlock(masters.urls, retry_count=0, request_timeout=request_timeout, transport=transport) as rl:
        warm(rl)
        masters[4].pause()
        try:
            lock = rl.lock("stopped-one", ttl=30)
            started = time.monotonic()
            assert lock.acquire(blocking=False), lock.last_error
            took = time.monotonic() - started
            kinds = [vote.kind for vote in lock.last_votes]
            assert kinds[4] == "pending" and kinds.count("yes") >= 3 and set(kinds) == {"yes", "pending"}, (
                kinds
            )
            assert took < request_timeout / 4, f"{took:.3f} s: the attempt waited for the paused master"
            started = time.monotonic()
            assert lock.release()
            if transport == "fast":
                # The reference transport's lane for master 4 writes nothing more until the SET
                # is answered: its release is bounded by request_timeout, not free.
                assert time.monotonic() - started < request_timeout / 4
        finally:
            masters[4].resume()
        # The paused master runs the SET, then the release queued behind it on the same link.
        client = masters[4].client()
        try:
            assert wait_for(lambda: client.ping() and not client.exists(lock.key), 5.0), "key left"
        finally:
            client.close()
        assert wait_for(lambda: not any(keys_on(masters, lock.key).values()), 5.0), keys_on(masters, lock.key)


@pytest.mark.parametrize("extend", ["none", "extend", "extend_many"])
def test_a_release_is_never_overtaken_by_the_set_it_undoes(masters: ServerSet, extend: str) -> None:
    """Master 4's link holds the attempt's SET back (a proxy delays its bytes); the attempt is
    granted by the others without it. Another round of the process then holds the links the
    attempt would have parked (as a heartbeat's or another thread's would), so anything else
    sent to master 4 goes on a new link, which nothing delays. The release must still reach
    master 4 after the SET, or the SET lands after it and leaves the released lock's key
    there until its TTL."""
    hold_back = 0.5
    with (
        ProxySet([server.address for server in masters]) as proxies,
        Redlock(proxies.urls, retry_count=0, request_timeout=2.0) as rl,
    ):
        warm(rl)
        sets_before = set_calls(masters[4])
        proxies[4].delay(hold_back, "up")
        lock = rl.lock("overtaken", ttl=30)
        assert lock.acquire(blocking=False), lock.last_error
        assert lock.last_votes[4].kind == "pending", lock.last_votes
        proxies[4].delay(0, "up")  # bytes sent from now on pass at once (new links' too)
        other = rl._round()  # takes a parked set if there is one
        try:
            if extend == "extend":
                assert lock.extend()
            elif extend == "extend_many":
                assert rl.extend_many([lock]) == [True]
            assert lock.release()
        finally:
            other.close()
        # Once the held-back SET has run on master 4, nothing of the released lock is left, or
        # soon: the release returned on a quorum's replies, and the others' are on their way. A
        # key the release overtook would stay for its TTL (30 s).
        assert wait_for(lambda: set_calls(masters[4]) > sets_before, 5.0), "the SET never landed"
        assert wait_for(lambda: not any(keys_on(masters, lock.key).values()), 5.0), keys_on(masters, lock.key)
        # The links the attempt kept serve the next lock correctly.
        again = rl.lock("overtaken", ttl=30)
        assert take(again), again.last_error
        assert every_vote(again) == ["yes"] * 5, again.last_votes
        again.release()


def test_a_lock_acquired_again_after_running_out_drops_its_kept_exchange(masters: ServerSet) -> None:
    """An attempt's kept exchange belongs to its token: a lock that ran out unreleased and is
    acquired anew closes the old one (its links go back) and keeps the new attempt's."""
    with Redlock(masters.urls, retry_count=0, request_timeout=0.5) as rl:
        warm(rl)
        masters[4].pause()
        try:
            lock = rl.lock("ran-out", ttl=0.8)
            assert lock.acquire(blocking=False), lock.last_error
            first = lock._exchange
            assert first is not None
            assert wait_for(lambda: not lock.owned(), 5.0)
            # The running masters expired the first token's key (master 4 is paused).
            assert wait_for(lambda: not any(keys_on(masters, lock.key).values()), 5.0)
            assert lock.acquire(blocking=False), lock.last_error
            # Kept anew, or none where master 4 voted an error (the reference transport's lane
            # still waits on the first SET's reply, and writes nothing behind it in time).
            assert lock._exchange is not first
            assert lock._exchange is not None or lock.last_votes[4].kind == "error", lock.last_votes
            assert lock.release()
            assert lock._exchange is None
        finally:
            masters[4].resume()
        assert wait_for(lambda: not any(keys_on(masters, lock.key).values()), 5.0), keys_on(masters, lock.key)
