"""Who holds a lock: the holder text stored beside the token, in the same SET.

The property: while a lock taken with a holder is held, ``Redlock.holder`` read by any client
gives that text; once released, None; the token stays unique per acquisition (its random part)
and release and extend work on the whole stored value.
"""

from __future__ import annotations

import pytest
import redis

from celery_redlock import ConfigError, LockNotAcquired, Redlock
from celery_redlock.lock.resource import HOLDER_SEPARATOR
from celery_redlock.testing import ServerSet

from .conftest import take


@pytest.mark.timeout(30)
def test_holder_is_read_by_another_client_and_gone_after_release(masters: ServerSet) -> None:
    with Redlock(masters.urls, retry_count=0) as mine, Redlock(masters.urls, retry_count=0) as other:
        lock = mine.lock("held-by", ttl=10, holder='{"task":"t-1","pid":42}')
        assert other.holder("held-by") is None  # free
        assert take(lock)
        token = lock.token
        assert token is not None
        random_part, _, text = token.partition(HOLDER_SEPARATOR)
        assert len(random_part) == 40 and text == '{"task":"t-1","pid":42}'
        assert other.holder("held-by") == '{"task":"t-1","pid":42}'
        # A contender is refused as ever, and learns nothing but the holder from the stored value.
        assert not other.lock("held-by", ttl=10).acquire(blocking=False)
        assert lock.extend(5.0)
        for url in masters.urls:
            client = redis.Redis.from_url(url)
            try:
                assert client.get("redlock:held-by") == token.encode()
                assert 0 < client.pttl("redlock:held-by") <= 5000
            finally:
                client.close()
        lock.release()
        assert other.lock("held-by", ttl=10).acquire(blocking=False)  # released on every master

        assert other.holder("held-by") == ""  # held, by a lock taken without a holder


@pytest.mark.timeout(30)
def test_holder_tokens_stay_unique_per_acquisition(masters: ServerSet) -> None:
    with Redlock(masters.urls, retry_count=0) as rl:
        lock = rl.lock("unique", ttl=10, holder="same holder")
        tokens = set()
        for _ in range(20):
            assert take(lock)
            tokens.add(lock.token)
            lock.release()
        assert len(tokens) == 20


@pytest.mark.timeout(30)
@pytest.mark.parametrize("holder", ["two\nlines", "cr\r", 42, None])
def test_a_holder_that_cannot_be_stored_is_refused(masters: ServerSet, holder: object) -> None:
    with Redlock(masters.urls, retry_count=0) as rl, pytest.raises(ConfigError, match="holder"):
        rl.lock("bad-holder", holder=holder)  # type: ignore[arg-type]


def test_a_with_block_refused_names_the_holder(rl: Redlock) -> None:
    """``with lock:`` that fails says who holds the resource (one more round, on failure only)."""
    held = rl.lock("named", ttl=10, holder='{"task":"abc","name":"charge","host":"w3","pid":4411}')
    assert take(held)
    try:
        with (
            pytest.raises(LockNotAcquired, match="held by task charge abc on w3 pid 4411") as caught,
            rl.lock("named", ttl=10, blocking=False),
        ):
            pass
        assert caught.value.holder.startswith("task charge abc on w3 pid 4411")
    finally:
        held.release()


@pytest.mark.timeout(30)
def test_a_reentrant_locks_holder_is_read_as_a_plain_locks(masters: ServerSet) -> None:
    """A reentrant lock's key is a hash, which a GET is refused (WRONGTYPE): read that way, a
    contender learned nothing of its holder, and a lock_reentrant task's duplicate that should
    have been skipped (lock_contended="skip") was retried and ran after it."""
    with Redlock(masters.urls, retry_count=0) as mine, Redlock(masters.urls, retry_count=0) as other:
        lock = mine.lock("held-reentrant", ttl=10, holder='{"task":"t-2"}', reentrant=True)
        with lock, lock:  # entered twice: still one token on each master
            assert other.holder("held-reentrant") == '{"task":"t-2"}'
        assert other.holder("held-reentrant") is None
