"""Markers beside a held lock key, on real masters: an owner's marker waits on its own side key
while another holds the lock key, answers the owner's next placement, never sits on both keys,
is deleted by the same step in which its run takes the lock key over, and is put back by an
attempt of that run that no quorum granted."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_redlock import Redlock
from celery_redlock.lock import admin, markers
from celery_redlock.lock.holder import HolderRecord
from celery_redlock.testing import RedisServer, ServerSet
from tests.onmasters import pttls, set_on

from .conftest import take, take_everywhere


def at(masters: ServerSet, indexes: range | list[int]) -> list[RedisServer]:
    return [masters[i] for i in indexes]


pytestmark = pytest.mark.one_binary


@pytest.fixture
def rl(masters: ServerSet) -> Iterator[Redlock]:
    """The core ``rl`` with a request_timeout a loaded host keeps: these tests read and count
    what every master holds (a late reply reads as absent, a late grant as a refusal); where a
    marker sits is the subject here, not how fast a master answers."""
    with Redlock(masters.urls, retry_count=0, request_timeout=1.0) as instance:
        yield instance


def marker(task: str, owner: str = "task-b") -> str:
    return markers.new_value(HolderRecord(task=task, name=owner, queued=True).to_text())


@pytest.mark.timeout(30)
def test_a_marker_waits_beside_another_holder_and_its_run_takes_the_key_over(rl: Redlock) -> None:
    side = markers.side_key(rl.key_prefix, "res", "task-b")
    other = rl.lock("res", ttl=10, holder="a run of task A")
    take_everywhere(other)  # held on every master: what each one answers is counted below
    assert other.token is not None
    first = marker("b1")

    refused = markers.place(rl, "res", side, first, 10)
    assert refused.value is None and refused.holder == other.token and refused.beside is None
    # Set beside only while the lock key still holds what was read there.
    assert markers.place_beside(rl, "res", side, first, 10, "someone since").value is None
    placed = markers.place_beside(rl, "res", side, first, 10, other.token)
    assert placed.value == first and placed.key == side

    # The owner's next placement finds its own marker, whether the lock key is held or free; it
    # never puts a second marker of the owner on the lock key.
    for _ in range(2):
        again = markers.place(rl, "res", side, marker("b2"), 10)
        assert again.value is None and again.beside == first
        other.release()
    assert rl.holder("res") is None
    # Another owner is no duplicate of it.
    elsewhere = markers.side_key(rl.key_prefix, "res", "task-c")
    assert markers.place(rl, "res", elsewhere, marker("c1", "task-c"), 10).value is not None
    assert markers.place(rl, "res", side, marker("b3"), 10).beside == first
    (task_c,) = {v for v in rl.read_everywhere(f"{rl.key_prefix}res") if v is not None}
    markers.drop(rl, "res", task_c.decode())

    # The run takes the free lock key and deletes its side marker in the same step.
    run = markers.HandoverLock(rl, "res", 10, marker=first, side=side)
    assert take(run)
    assert rl.read_everywhere(side) == [None] * len(rl.masters)
    assert run.token is not None and rl.holder("res") == run.token.partition("|")[2]
    run.release()


@pytest.mark.timeout(30)
def test_drop_deletes_a_marker_wherever_it_waits_and_nothing_else(rl: Redlock) -> None:
    side = markers.side_key(rl.key_prefix, "gone", "task-b")
    holder = rl.lock("gone", ttl=10)
    assert holder.acquire(blocking=False) and holder.token is not None
    value = marker("b1")
    assert markers.place_beside(rl, "gone", side, value, 10, holder.token).value == value
    markers.drop(rl, "gone", value, side)
    assert rl.read_everywhere(side) == [None] * len(rl.masters)
    assert holder.owned() and rl.holder("gone") == ""  # the lock key's holder is left alone
    holder.release()


@pytest.mark.timeout(30)
def test_keep_extends_a_marker_only_while_it_is_there(rl: Redlock) -> None:
    value = marker("k1")
    side = markers.side_key(rl.key_prefix, "kept", "task-b")
    placed = markers.place(rl, "kept", side, value, 2.0)
    assert placed.value == value and placed.key is not None
    assert markers.keep(rl, placed.key, value, 60.0)[0]
    kept = markers.published(value)
    assert kept != value and rl.holder("kept") == kept.partition("|")[2]  # marked published
    assert not markers.keep(rl, placed.key, value, 60.0)[0]  # the placed form is no longer there
    assert markers.keep(rl, placed.key, kept, 30.0)[0]  # replaces the TTL left, as any extension
    left = [m.pttl for m in admin.show(rl, "kept").masters]
    assert all(p is not None and 25 < p <= 30 for p in left), left
    markers.drop(rl, "kept", value)  # either form
    assert not markers.keep(rl, placed.key, kept, 60.0)[0]  # gone: not brought back
    assert rl.holder("kept") is None


@pytest.mark.timeout(30)
def test_a_takeover_no_quorum_granted_leaves_its_marker_beside_the_key(
    rl: Redlock, masters: ServerSet
) -> None:
    """A run's attempt to take its key over that only a minority granted replaced its marker
    there (HANDOVER deletes it from the side key): retracted, it must put the marker back, or a
    few such attempts (the run and another task's run splitting the masters each time the key is
    freed) leave fewer than a quorum marked while the message still waits, and its task's next
    publish is accepted: a duplicate (CI: two messages of one task and key queued at once)."""
    side = markers.side_key(rl.key_prefix, "split", "task-b")
    key = f"{rl.key_prefix}split"
    other = rl.lock("split", ttl=10, holder="a run of task A")
    take_everywhere(other)  # held on every master: what each one answers is counted below
    assert other.token is not None
    record = HolderRecord(name="task-b", ttl=30.0, queued=True)
    first = markers.new_value(record.to_text(task="b1", since=time.time()))
    holder = markers.place(rl, "split", side, first, 10).holder
    assert holder == other.token
    assert markers.place_beside(rl, "split", side, first, 10, holder).key == side
    assert markers.keep(rl, side, first, 10)[0]  # its publish returned: kept, as published
    kept = markers.published(first)
    run = markers.HandoverLock(rl, "split", 10, marker=first, side=side)

    # The key is free on two masters, then on a third one (the others held it meanwhile): each
    # attempt is granted by a minority only.
    for free in ([0, 1], [2]):
        set_on(at(masters, free), key, None)
        assert not run.acquire(blocking=False)
        assert sorted(vote.kind for vote in run.last_votes) == sorted(
            ["yes"] * len(free) + ["held"] * (5 - len(free))
        )
        assert rl.read_everywhere(side) == [kept.encode()] * 5, "the marker was not put back beside the key"
        # ... for no longer than it had left.
        assert all(0 < pttl <= 30_000 for pttl in pttls(masters, side))
        set_on(at(masters, free), key, other.token)

    # The task's next publish is refused by its waiting marker, as before the attempts.
    again = markers.place(
        rl, "split", side, markers.new_value(record.to_text(task="b2", since=time.time())), 10
    )
    assert again.value is None and again.beside == kept
    other.release()
    assert take(run)
    assert rl.read_everywhere(side) == [None] * 5
    run.release()


@pytest.mark.timeout(30)
def test_a_takeover_granted_by_a_quorum_deletes_its_marker_where_the_key_was_held(
    rl: Redlock, masters: ServerSet
) -> None:
    """A run that takes its key over on a quorum while another holder still has it on the other
    masters (its release on its way) must not leave its marker beside the key there: its message
    is running, and a few such copies left on a minority by runs that follow one another answer
    every later publish of the task with its own marker on some masters while the others are
    free, so no round reaches a quorum either way, and each publish is refused for the marker's
    whole TTL (CI: every publisher of a burst refused for its publish window)."""
    side = markers.side_key(rl.key_prefix, "tidy", "task-b")
    key = f"{rl.key_prefix}tidy"
    other = rl.lock("tidy", ttl=10, holder="a run of task A")
    take_everywhere(other)
    assert other.token is not None
    record = HolderRecord(name="task-b", ttl=30.0, queued=True)
    first = markers.new_value(record.to_text(task="b1", since=time.time()))
    assert markers.place_beside(rl, "tidy", side, first, 10, other.token).key == side
    assert markers.keep(rl, side, first, 10)[0]

    # A's release has reached three masters: the run takes the key on them, and the two that
    # still hold A's token refuse it.
    set_on(at(masters, [0, 1, 2]), key, None)
    run = markers.HandoverLock(rl, "tidy", 10, marker=first, side=side)
    assert run.acquire(blocking=False), run.last_error
    assert sorted(vote.kind for vote in run.last_votes) == ["held", "held", "yes", "yes", "yes"]
    deadline = time.monotonic() + 5
    while rl.read_everywhere(side) != [None] * 5:
        assert time.monotonic() < deadline, f"the marker stayed beside the key: {rl.read_everywhere(side)}"
        time.sleep(0.01)
    assert rl.read_everywhere(key)[3:] == [other.token.encode()] * 2, "another holder's key was touched"
    run.release()
    set_on(at(masters, [3, 4]), key, None)

    # The task's next publish is placed at once: nothing of the run's message is left to split it.
    again = markers.new_value(record.to_text(task="b2", since=time.time()))
    placed = markers.place(rl, "tidy", side, again, 10)
    assert placed.value == again, placed.votes
    markers.drop(rl, "tidy", again)
