"""The quorum rule, vote accounting and ownership semantics on real masters."""

from __future__ import annotations

import itertools
import pickle
import time
from collections.abc import Iterator

import pytest

from celery_redlock import LockLost, LockNotAcquired, Redlock
from celery_redlock.testing import ServerSet

from .conftest import keys_on, take, values_on

SUBSETS = [c for r in range(6) for c in itertools.combinations(range(5), r)]


@pytest.fixture
def answering(masters: ServerSet, transport: str) -> Iterator[Redlock]:
    """``rl`` with a request_timeout a loaded host keeps, for the tests that count every master's
    vote: their subject is the count, not a reply within 0.1 s (a late one votes "timeout")."""
    with Redlock(masters.urls, retry_count=0, request_timeout=1.0, transport=transport) as instance:
        yield instance


def test_acquire_succeeds_iff_a_quorum_is_free(masters: ServerSet, answering: Redlock) -> None:
    rl = answering
    assert len(SUBSETS) == 32  # every subset of the five masters, from none to all
    for taken in SUBSETS:
        for server in masters:
            server.flushall()
        for i in taken:
            client = masters[i].client()
            client.set("redlock:res", "someone-else", px=60_000)
            client.close()
        lock = rl.lock("res", ttl=10)
        got = lock.acquire(blocking=False)
        free = 5 - len(taken)
        assert got == (free >= 3), f"occupied {taken}: acquire returned {got}"
        values = values_on(masters, "redlock:res")
        if got:
            ours = [v for v in values.values() if v == lock.token.encode()]
            assert len(ours) == free
            lock.release()
            values = values_on(masters, "redlock:res")
        # Only the other token's keys remain: nothing of ours, after a failure or a release.
        assert sorted(a for a, v in values.items() if v is not None) == sorted(
            masters[i].address for i in taken
        ), f"occupied {taken}: keys left {values}"
        assert all(v in (None, b"someone-else") for v in values.values())
        if not got:
            assert lock.last_error is not None
            held = [v for v in lock.last_error.votes if v.kind == "held"]
            assert len(held) == len(taken)


def test_failed_vote_account_names_every_master(masters: ServerSet, answering: Redlock) -> None:
    rl = answering
    first = rl.lock("acct", ttl=10)
    assert take(first)
    second = rl.lock("acct", ttl=10)
    assert not second.acquire(blocking=False)
    error = second.last_error
    assert isinstance(error, LockNotAcquired)
    assert {v.master for v in error.votes} == {s.address for s in masters}
    assert all(v.kind == "held" for v in error.votes)
    assert error.quorum == 3 and error.held_by_other
    for server in masters:
        assert server.address in str(error)
    with pytest.raises(LockNotAcquired), rl.lock("acct", ttl=10, blocking=False):
        pass
    first.release()


def contended_error(rl: Redlock, name: str) -> LockNotAcquired:
    """The error of a second acquisition of ``name`` while a first holds it."""
    first = rl.lock(name, ttl=10)
    assert take(first)
    second = rl.lock(name, ttl=10)
    assert not second.acquire(blocking=False)
    first.release()
    error = second.last_error
    assert error is not None
    return error


def test_errors_survive_pickling_with_their_votes(rl: Redlock) -> None:
    original = contended_error(rl, "pickle")
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is LockNotAcquired
    assert copy.votes == original.votes and str(copy) == str(original)
    lost = pickle.loads(pickle.dumps(LockLost("pickle", "expired")))
    assert type(lost) is LockLost and lost.resource == "pickle" and lost.reason == "expired"


def test_owned_validity_token_and_locked(rl: Redlock) -> None:
    lock = rl.lock("state", ttl=5)
    assert not lock.owned() and lock.validity == 0.0 and lock.token is None
    assert not lock.locked()
    assert take(lock)
    assert lock.owned() and 4.8 < lock.validity <= 5.0
    assert lock.token is not None and len(lock.token) == 40
    assert lock.locked() and rl.lock("state").locked()
    lock.release()
    assert not lock.owned() and lock.token is None and not lock.locked()
    lock.release()  # a second release does nothing


def test_tokens_are_unique_per_acquisition(rl: Redlock) -> None:
    lock = rl.lock("tokens", ttl=5)
    seen = set()
    for _ in range(20):
        assert take(lock)
        seen.add(lock.token)
        lock.release()
    assert len(seen) == 20


def test_extend_replaces_the_ttl_on_a_quorum(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("ext", ttl=1)
    assert take(lock)
    assert lock.extend(ttl=20)
    assert lock.validity > 19
    # On a quorum (a master whose acquire answered late had its grant retracted): never more.
    pttls = [server.client().pttl("redlock:ext") for server in masters]
    assert sum(19_000 < pttl <= 20_000 for pttl in pttls) >= rl.quorum and max(pttls) <= 20_000, pttls
    assert lock.extend(ttl=2)  # replaces, never adds
    assert all(s.client().pttl("redlock:ext") <= 2000 for s in masters)
    lock.release()


def test_extend_after_expiry_fails_and_creates_nothing(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("expired", ttl=0.2)
    assert take(lock)
    deadline = time.monotonic() + 5
    while any(keys_on(masters, "redlock:expired").values()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert not lock.extend(ttl=10)
    assert not any(keys_on(masters, "redlock:expired").values())
    with pytest.raises(LockLost):
        lock.ensure()


def test_extend_of_a_lock_retaken_by_another_fails(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("retaken", ttl=5)
    assert take(lock)
    for server in masters:  # the lock expired everywhere and someone else took it
        server.client().set("redlock:retaken", "other", px=60_000)
    assert not lock.extend()
    assert lock.lost_reason
    assert not lock.owned()
    assert all(s.client().get("redlock:retaken") == b"other" for s in masters)
    lock.release()
    assert all(s.client().get("redlock:retaken") == b"other" for s in masters)


def test_release_never_deletes_another_tokens_key(masters: ServerSet, rl: Redlock) -> None:
    lock = rl.lock("mine", ttl=5)
    assert take(lock)
    masters[0].client().set("redlock:mine", "other", px=60_000)
    lock.release()
    assert masters[0].client().get("redlock:mine") == b"other"
    assert not any(keys_on(masters, "redlock:mine").get(s.address) for s in list(masters)[1:])


def test_a_flushed_script_cache_breaks_nothing(masters: ServerSet, rl: Redlock) -> None:
    # Scripts travel by digest; a master that lost them answers NOSCRIPT, runs nothing, and the
    # transport sends it the source (EVAL) within the call: the extension and the release work.
    lock = rl.lock("noscript", ttl=5)
    assert take(lock)
    for server in masters:
        server.client().script_flush()
    assert lock.extend()
    for server in masters:
        server.client().script_flush()
    lock.release()
    deadline = time.monotonic() + 5
    while any(keys_on(masters).values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(keys_on(masters).values())


def test_blocking_acquire_waits_for_the_release(masters: ServerSet, rl: Redlock) -> None:
    holder = rl.lock("wait", ttl=0.5)
    assert take(holder)
    waiter = Redlock(masters.urls, retry_delay=0.05)
    try:
        started = time.monotonic()
        assert waiter.lock("wait", ttl=5).acquire(timeout=5)
        assert time.monotonic() - started >= 0.3  # it had to wait for the expiry
    finally:
        waiter.close()


def test_timeout_bounds_a_blocking_acquire(rl: Redlock) -> None:
    holder = rl.lock("bounded", ttl=30)
    assert take(holder)
    started = time.monotonic()
    assert not rl.lock("bounded").acquire(timeout=0.5)
    assert 0.4 < time.monotonic() - started < 2.0
    holder.release()


def test_errors_survive_a_json_round_trip(rl: Redlock) -> None:
    """Celery's JSON result backend keeps an exception's args and rebuilds it as cls(*args)."""
    import json

    original = contended_error(rl, "json")
    rebuilt = LockNotAcquired(*json.loads(json.dumps(original.args)))
    assert rebuilt.votes == original.votes and str(rebuilt) == str(original)
    assert rebuilt.held_by_other
    lost = LockLost(*json.loads(json.dumps(LockLost("json", "expired").args)))
    assert str(lost) == "lock 'json' lost: expired"
