"""Review of c19fa6e: what ``_place_again`` counts as "a vote split between publishers".

The rule is "a quorum of masters answered": any round in which at least a quorum answered and
no value holds a quorum is tried on for the whole PUBLISH_WINDOW. docs/enqueue.md says masters
that do not answer are refused "after 8 tries". A master that does not answer, beside another
holder that then has only a minority of the *answering* masters, is not a split between
publishers: nobody's later round can win it while that master stays silent.
"""

from __future__ import annotations

import time
import types

import pytest

from celery_redlock.celery import enqueue
from celery_redlock.errors import LockNotAcquired
from celery_redlock.lock import markers
from celery_redlock.lock.holder import HolderRecord
from celery_redlock.lock.redlock import Redlock
from celery_redlock.lock.state import lock_key
from celery_redlock.testing import ServerSet

REQUEST_TIMEOUT = 0.2
# PLACE_ATTEMPTS rounds, each bounded by the request timeout, and the jittered delays between
# them (at most PLACE_RETRY_DELAY * k before try k + 1), plus a loaded host's allowance.
EIGHT_TRIES = (
    enqueue.PLACE_ATTEMPTS * REQUEST_TIMEOUT
    + sum(enqueue.PLACE_RETRY_DELAY * k for k in range(1, enqueue.PLACE_ATTEMPTS))
    + 1.0
)


def _marker(task: types.SimpleNamespace, who: str) -> str:
    record = HolderRecord(name=task.name, host="h", pid=1, ttl=30.0, queued=True)
    return markers.new_value(record.to_text(task=who, since=time.time(), publish="p"))


@pytest.mark.timeout(60)
def test_another_holder_behind_a_silent_master_is_refused_after_eight_tries_not_the_window() -> None:
    """Another task's run holds the key on masters 0, 1, 2 (a quorum of 5); master 2 is paused.
    Each round: 0 and 1 answer "held" (a minority, no agreed holder), 3 and 4 grant (a minority),
    2 is silent. Four masters answered, so _place_again calls it a split between publishers and
    tries on for PUBLISH_WINDOW (5 s), though it is a master not answering: refused after 8
    tries, as documented."""
    task = types.SimpleNamespace(name="review30-split")
    with ServerSet(5) as servers, Redlock(servers.urls, request_timeout=REQUEST_TIMEOUT) as rl:
        key = lock_key(rl.key_prefix, "held-behind-silent")
        other = "f" * 40 + "|a run of another task"
        for server in list(servers)[:3]:
            assert server.client().set(key, other, px=60_000)
        servers[2].pause()
        try:
            start = time.monotonic()
            with pytest.raises(LockNotAcquired) as refused:
                enqueue._place(task, rl, "held-behind-silent", _marker(task, "new"), 30.0)
            waited = time.monotonic() - start
        finally:
            servers[2].resume()
        kinds = [vote.kind for vote in refused.value.votes]
        assert kinds[2] in ("timeout", "error") and kinds[:2] == ["held", "held"], kinds
        assert waited < EIGHT_TRIES, (
            f"refused after {waited:.1f} s and {refused.value.attempts} tries (documented: 8 tries "
            f"for masters that do not answer, about {EIGHT_TRIES:.1f} s here)"
        )
