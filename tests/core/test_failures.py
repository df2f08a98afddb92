"""Dead, paused and lagging masters cost a bounded time, never a hang, and never a wrong answer."""

from __future__ import annotations

import time

import pytest

from celery_redlock import LockNotAcquired, Redlock, Vote
from celery_redlock.lock.commands import PLAIN, Commands
from celery_redlock.lock.masters import BACKOFF_CAP
from celery_redlock.lock.transport.reference import NOT_WRITTEN
from celery_redlock.testing import ServerSet

from .conftest import keys_on, take

REQUEST_TIMEOUT = 0.1
# Generous slack for a loaded 2-core machine: these bounds catch hangs and hidden client
# retries (seconds), not microseconds.
SLACK = 0.5


@pytest.fixture
def fresh(masters: ServerSet) -> Redlock:
    """A Redlock whose connections are all made before any fault (the usual steady state)."""
    rl = Redlock(masters.urls, retry_count=0, request_timeout=REQUEST_TIMEOUT)
    # Every link made and answering, not a quorum of them: a master whose warm-up reply came late
    # on a loaded host would meet its fault on a new connect, and vote "error" for "timeout".
    deadline = time.monotonic() + 10
    while True:
        warm = rl.lock("warm-up", ttl=5)
        assert take(warm)
        answered = [v.kind for v in warm.last_votes] == ["yes"] * len(masters)
        warm.release()
        if answered:
            return rl
        assert time.monotonic() < deadline, warm.last_votes
        time.sleep(0.05)


def test_minority_killed_still_acquires_within_bounds(masters: ServerSet, fresh: Redlock) -> None:
    masters[0].kill()
    masters[3].kill()
    for attempt in range(5):
        lock = fresh.lock(f"minority-{attempt}", ttl=5)
        started = time.monotonic()
        assert take(lock)
        assert time.monotonic() - started < REQUEST_TIMEOUT + SLACK
        kinds = sorted(v.kind for v in lock.last_votes)
        assert kinds.count("yes") == 3 and kinds.count("error") == 2
        lock.release()
    fresh.close()


def test_majority_killed_fails_fast_naming_the_dead(masters: ServerSet, fresh: Redlock) -> None:
    dead = [masters[1], masters[2], masters[4]]
    for server in dead:
        server.kill()
    lock = fresh.lock("majority", ttl=5)
    started = time.monotonic()
    with pytest.raises(LockNotAcquired) as caught, lock:
        pass
    assert time.monotonic() - started < REQUEST_TIMEOUT * 2 + SLACK
    error = caught.value
    errored = {v.master for v in error.votes if v.kind == "error"}
    assert errored == {s.address for s in dead}
    for server in dead:
        assert server.address in str(error)
    assert not any(keys_on(masters, "redlock:majority").values())
    fresh.close()


def test_blocking_acquire_with_majority_down_is_bounded(masters: ServerSet) -> None:
    for i in (0, 1, 2):
        masters[i].kill()
    rl = Redlock(masters.urls, retry_count=3, retry_delay=0.1, request_timeout=REQUEST_TIMEOUT)
    started = time.monotonic()
    assert not rl.lock("down").acquire()
    # 4 attempts, each at most one request_timeout plus a delay under retry_delay.
    assert time.monotonic() - started < 4 * (REQUEST_TIMEOUT + 0.1) + 4 * REQUEST_TIMEOUT + SLACK
    rl.close()


def test_paused_master_costs_at_most_request_timeout(masters: ServerSet, fresh: Redlock) -> None:
    masters[2].pause()
    for attempt in range(3):
        lock = fresh.lock(f"paused-{attempt}", ttl=5)
        started = time.monotonic()
        assert take(lock)
        assert time.monotonic() - started < REQUEST_TIMEOUT + SLACK
        kinds = [v.kind for v in lock.last_votes]
        # The paused one never answers (a timeout, then "error" while its link is known dead); a
        # quorum of the rest granted (what acquired promises: one a loaded host made late may not).
        assert kinds[2] in ("timeout", "error") and kinds.count("yes") >= fresh.quorum, kinds
        lock.release()
    masters[2].resume()
    fresh.close()


def test_release_does_not_wait_for_a_paused_master(masters: ServerSet) -> None:
    """A release is sent, not waited for: a paused master costs it nothing, applies it when it
    resumes, and the connection that owes its reply serves the next lock correctly."""
    slow_timeout = 2.0
    rl = Redlock(masters.urls, retry_count=0, request_timeout=slow_timeout)
    lock = rl.lock("unwaited", ttl=30)
    assert take(lock)
    masters[1].pause()
    started = time.monotonic()
    lock.release()
    assert time.monotonic() - started < slow_timeout / 2, "the release waited for a reply"
    deadline = time.monotonic() + 5
    while any(keys_on(masters, "redlock:unwaited").values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(keys_on(masters, "redlock:unwaited").values())  # the four running masters
    masters[1].resume()
    client = masters[1].client()
    while client.exists("redlock:unwaited") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.exists("redlock:unwaited") == 0
    again = rl.lock("unwaited", ttl=30)
    assert take(again)
    assert [vote.kind for vote in again.last_votes] == ["yes"] * 5
    again.release()
    rl.close()


def test_new_connection_to_a_paused_master_is_bounded(masters: ServerSet) -> None:
    masters[0].pause()
    masters[1].pause()
    rl = Redlock(masters.urls, retry_count=0, request_timeout=REQUEST_TIMEOUT)
    started = time.monotonic()
    lock = rl.lock("cold", ttl=5)
    assert take(lock)
    # The two handshakes that cannot finish run in parallel: one timeout, not two.
    assert time.monotonic() - started < 2 * REQUEST_TIMEOUT + SLACK
    lock.release()
    rl.close()


def test_late_write_from_a_paused_master_is_retracted(masters: ServerSet, fresh: Redlock) -> None:
    """The SET a paused master receives lands when it resumes; the retraction queued behind it
    on the same connection deletes it, so no key of ours outlives the release."""
    masters[4].pause()
    lock = fresh.lock("late", ttl=30)
    assert take(lock)
    # The paused master did not answer: its reply is late (timeout), or, where an earlier
    # attempt of take() timed out there, the reference transport's lane is still waiting on that
    # reply and this attempt's SET is not written in time (error). Either way a SET of ours was
    # written to it and lands when it resumes.
    vote = lock.last_votes[4]
    assert vote.kind == "timeout" or (vote.kind == "error" and vote.detail == NOT_WRITTEN.detail), vote
    lock.release()
    masters[4].resume()
    client = masters[4].client()
    deadline = time.monotonic() + 5
    # Once the server has answered a PING on a new connection after resuming, it has executed
    # everything that was queued on the old one.
    while time.monotonic() < deadline:
        client.ping()
        if client.exists("redlock:late") == 0:
            break
        time.sleep(0.02)
    assert client.exists("redlock:late") == 0
    assert not any(keys_on(masters, "redlock:late").values())
    fresh.close()


def test_failed_acquire_with_a_paused_master_leaves_nothing(masters: ServerSet, fresh: Redlock) -> None:
    for i in (0, 1):
        masters[i].client().set("redlock:contested", "other", px=60_000)
    masters[2].pause()
    lock = fresh.lock("contested", ttl=30)
    assert not lock.acquire(blocking=False)
    masters[2].resume()
    client = masters[2].client()
    client.ping()
    deadline = time.monotonic() + 5
    while client.exists("redlock:contested") and time.monotonic() < deadline:
        time.sleep(0.02)
    values = [s.client().get("redlock:contested") for s in masters]
    assert values == [b"other", b"other", None, None, None]
    fresh.close()


def test_restarted_master_rejoins(masters: ServerSet, fresh: Redlock) -> None:
    masters[1].kill()
    masters[1].start()
    deadline = time.monotonic() + 5
    while True:  # the first round may still meet the dead connection; a later one reconnects
        lock = fresh.lock("rejoin", ttl=5)
        assert take(lock)
        yes = [v.kind for v in lock.last_votes].count("yes")
        lock.release()
        if yes == 5:
            break
        assert time.monotonic() < deadline, lock.last_votes
        time.sleep(0.05)
    fresh.close()


@pytest.mark.fast_transport(
    "a down master's background reconnect, backed off up to BACKOFF_CAP (the reference transport "
    "has no backoff: it connects again on the next round)"
)
def test_a_refused_master_rejoins_within_the_backoff_cap(masters: ServerSet, fresh: Redlock) -> None:
    """A refused master is retried off the rounds' path, backed off (so that it costs a round
    nothing while it is down): once it is back, its vote counts again within the backoff cap."""
    masters[3].kill()
    lock = fresh.lock("refused", ttl=5)
    assert take(lock)
    assert lock.last_votes[3].kind == "error"
    lock.release()
    masters[3].start()
    back = time.monotonic()
    while True:
        lock = fresh.lock("refused", ttl=5)
        assert take(lock)
        lock.release()
        if lock.last_votes[3].kind == "yes":
            break
        assert time.monotonic() - back < BACKOFF_CAP + SLACK, lock.last_votes[3]
        time.sleep(0.01)
    fresh.close()


class StallsAfterEachRound(Redlock):
    """A holder that stalls (a long GC, a SIGSTOP) after the masters answered, before it looks at
    the result: the worst moment for its idea of how long the lock is still good."""

    stall = 0.5

    def try_acquire(
        self, key: str, token: str, ttl: float, commands: Commands = PLAIN
    ) -> tuple[float, list[Vote], float]:
        result = super().try_acquire(key, token, ttl, commands)
        time.sleep(self.stall)
        return result

    def try_extend(
        self, key: str, token: str, ttl: float, commands: Commands = PLAIN
    ) -> tuple[float, list[Vote], float]:
        result = super().try_extend(key, token, ttl, commands)
        time.sleep(self.stall)
        return result


def test_validity_counts_from_before_the_round_not_from_when_it_is_read(masters: ServerSet) -> None:
    with StallsAfterEachRound(masters.urls, retry_count=0) as rl:
        lock = rl.lock("stalled", ttl=1.0)
        assert take(lock)
        # The masters expire the key 1 s after they set it; the holder lost 0.5 s of that.
        assert lock.validity < 1.0 - StallsAfterEachRound.stall, lock.validity
        assert lock.extend()
        assert lock.validity < 1.0 - StallsAfterEachRound.stall, lock.validity
        lock.release()
