"""An extension never revives a key that expired on a master (DESIGN: "compare-and-pexpire ...
can never revive a key that expired or belongs to another token"), on real masters.

Found by the mutation run (tests/mutations): an EXTEND script that sets the key where it is
absent passed every test, because the one test of an expired lock lets the holder's own
validity run out too, and a holder whose validity has run out sends no extension at all. A key
can expire on the masters while its holder still counts validity: on a master whose clock runs
fast (outside the lock's assumptions, but what an operator's bad NTP does), or on one restarted
empty. The extension then must count that master as lost, not write the key back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.lock import scripts
from celery_redlock.testing import RedisServer, ServerError, ServerSet
from celery_redlock.testing.servers import faketime_library

from .conftest import take

pytestmark = [pytest.mark.one_binary, pytest.mark.timeout(30)]

RATE = 10.0  # the fast masters' clock speed: a 2 s key lives 0.2 s of real time there
TTL = 2.0


def holds(server: RedisServer, key: str) -> bool:
    client = server.client()
    try:
        return bool(client.exists(key))
    finally:
        client.close()


def test_the_extend_script_creates_no_key_and_leaves_another_tokens_alone(masters: ServerSet) -> None:
    client = masters[0].client()
    try:
        key = "redlock:extend-script"
        assert client.eval(scripts.EXTEND.source, 1, key, "mine", 60_000) == 0
        assert client.exists(key) == 0, "an extension of an absent key created it"
        client.set(key, "other", px=5_000)
        assert client.eval(scripts.EXTEND.source, 1, key, "mine", 60_000) == 0
        assert client.get(key) == b"other" and client.pttl(key) <= 5_000
        client.set(key, "mine", px=1_000)
        assert client.eval(scripts.EXTEND.source, 1, key, "mine", 60_000) == 1
        assert 1_000 < client.pttl(key) <= 60_000
    finally:
        client.close()


@pytest.fixture
def three_fast() -> Iterator[tuple[ServerSet, ServerSet]]:
    try:
        faketime_library()
    except ServerError as exc:
        pytest.skip(str(exc))
    with ServerSet(2) as normal, ServerSet(3, clock_rate=RATE) as fast:
        yield normal, fast


def test_a_key_expired_on_a_majority_is_not_revived_by_the_extension(
    three_fast: tuple[ServerSet, ServerSet],
) -> None:
    normal, fast = three_fast
    with Redlock([*normal.urls, *fast.urls], retry_count=0) as rl:
        lock = rl.lock("extend-expired", ttl=TTL)
        assert take(lock), lock.last_error
        deadline = time.monotonic() + 5
        while any(holds(server, lock.key) for server in fast):
            assert time.monotonic() < deadline, "the fast masters never expired the key"
            time.sleep(0.01)
        # Expired on masters 2-4 by their clocks; by the holder's, well inside its validity.
        assert lock.owned() and lock.validity > 1.0, lock.validity
        assert not lock.extend(), f"extended on masters that had let the key go: {lock.last_votes}"
        assert [vote.kind for vote in lock.last_votes] == ["yes", "yes", "held", "held", "held"]
        assert not any(holds(server, lock.key) for server in fast), "the extension revived the key"
        assert lock.lost_reason and not lock.owned()
        lock.release()
        assert not any(holds(server, lock.key) for server in normal)
