"""How a release waits for its quorum: it sleeps on a poll first and reads only the links the poll
reports (Round._await_enough, linkset.sleep_on). Two ways that wait can go wrong without any
reply being miscounted, each found by planting it in an adversarial review:

- a closed link the poll keeps reporting (an answered master's connection killed while the
  release waits on paused ones) must not make the wait spin until its deadline;
- a round that could not take a parked set whole (a master closed one of its links) polls the
  pending links itself, and must still read what that poll reports.

Real masters, paused with SIGSTOP and made to close connections with CLIENT KILL.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import ServerSet

REQUEST_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def three() -> Iterator[ServerSet]:
    """Masters of this module's own: the tests pause them and kill their connections."""
    with ServerSet(3) as servers:
        yield servers


def thread_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


def kill_connections(servers: ServerSet, index: int) -> None:
    client = servers[index].client()
    try:
        client.execute_command("CLIENT", "KILL", "SKIPME", "yes", "TYPE", "normal")
    finally:
        client.close()


def held_lock(redlock: Redlock, name: str) -> object:
    for _ in range(3):  # the rounds park their links as one set, which the release then takes
        warm = redlock.lock("warm")
        assert warm.acquire(blocking=False), warm.last_error
        assert warm.release()
    lock = redlock.lock(name)
    assert lock.acquire(blocking=False), lock.last_error
    return lock


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["fast", "redis-py"])
def test_a_release_waiting_on_paused_masters_does_not_spin_on_a_closed_link(
    three: ServerSet, transport: str
) -> None:
    """Two of three masters paused: no quorum can answer, so the release waits its whole
    request timeout. Meanwhile the one master that answered closes the link (its poll then
    reports a hang-up for ever). The wait must go on sleeping: a few milliseconds of CPU, not
    the whole second."""
    with Redlock(three.urls, ttl=30.0, request_timeout=REQUEST_TIMEOUT, transport=transport) as redlock:
        lock = held_lock(redlock, "spin")
        killer = threading.Timer(0.1, kill_connections, (three, 0))
        three[1].pause()
        three[2].pause()
        try:
            killer.start()
            started, cpu = time.monotonic(), thread_cpu()
            released = lock.release()  # type: ignore[attr-defined]
            waited, used = time.monotonic() - started, thread_cpu() - cpu
        finally:
            killer.join()
            three[1].resume()
            three[2].resume()
        assert released is False
        # The paused masters' votes say they did not answer in time: no quorum had answered.
        paused = [vote.detail for vote in lock.release_votes[1:]]  # type: ignore[attr-defined]
        assert all("no reply within request_timeout" in detail for detail in paused), paused
        assert waited >= REQUEST_TIMEOUT * 0.9, waited
        assert used < 0.25 * waited, f"the release's wait used {used:.3f} s of CPU in {waited:.3f} s"


@pytest.mark.timeout(30)
def test_a_release_on_links_taken_one_by_one_returns_at_once(three: ServerSet) -> None:
    """A master closed one of the parked links (CLIENT KILL) before the release: the round
    replaces that link and sleeps on a poll of its own over the pending links. It must read what
    that poll reports and return on the quorum at once, and a contender gets the lock."""
    with (
        Redlock(three.urls, ttl=30.0, request_timeout=REQUEST_TIMEOUT) as redlock,
        Redlock(three.urls, ttl=30.0, request_timeout=REQUEST_TIMEOUT) as other,
    ):
        for trial in range(3):
            lock = held_lock(redlock, f"one-by-one-{trial}")
            kill_connections(three, trial)
            time.sleep(0.05)  # the close reaches this process before the release's round starts
            started, cpu = time.monotonic(), thread_cpu()
            assert lock.release() is True  # type: ignore[attr-defined]
            waited, used = time.monotonic() - started, thread_cpu() - cpu
            assert waited < REQUEST_TIMEOUT / 2, waited
            assert used < 0.1, used
            contender = other.lock(f"one-by-one-{trial}")
            assert contender.acquire(blocking=False), contender.last_error
            contender.release()
