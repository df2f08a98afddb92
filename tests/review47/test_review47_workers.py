"""review47: progress and release on real threads and prefork workers (three masters, a broker).
Sequential work on one key must never find a finished run's lock."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

import pytest
from celery import chain

from celery_redlock import Redlock
from celery_redlock.celery.tracer import SKIPPED


def _free_at_once(other: Redlock, key: str) -> bool:
    """Whether another client's acquire, started now, is not refused by a holder of the key (an
    attempt that failed on late answers alone, a loaded host, is no such refusal)."""
    lock = other.lock(f"r47:{key}", ttl=5.0)
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return lock.last_error is None or not lock.last_error.held_by_other


def _free_within(other: Redlock, key: str, seconds: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if _free_at_once(other, key):
            return time.monotonic() - started
        time.sleep(0.02)
    return None


@pytest.mark.timeout(180)
def test_chain_of_ten_same_key_links_skips_none(worker47: Any, r47: Any, other47: Redlock) -> None:
    _, queue = worker47
    for round_ in range(3):
        key = f"chain-{uuid.uuid4().hex[:8]}"
        result = chain(
            *(r47.app.tasks["r47.link"].si(key, i).set(queue=queue) for i in range(10))
        ).apply_async(queue=queue)
        value = result.get(timeout=60)
        assert not (isinstance(value, dict) and value.get(SKIPPED)), (
            f"round {round_}: last link skipped: {value}"
        )
        runs = [e for e in r47.events(key) if e["event"] == "run"]
        assert len(runs) == 10, f"round {round_}: {len(runs)} of 10 links ran: {value}"
        assert _free_at_once(other47, key)


@pytest.mark.timeout(180)
def test_delay_get_loop_in_fail_mode_never_finds_the_last_holder(
    worker47: Any, r47: Any, other47: Redlock
) -> None:
    _, queue = worker47
    key = f"loop-{uuid.uuid4().hex[:8]}"
    task = r47.app.tasks["r47.failing_fast"]
    refused_after = []
    for i in range(25):
        assert task.apply_async((key,), queue=queue).get(timeout=30) == key, f"call {i}"
        if not _free_at_once(other47, key):  # a client acting on the result at once
            refused_after.append(i)
    assert not refused_after, f"the lock was still held right after calls {refused_after} returned"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["r47.boom", "r47.ignored", "r47.rejected", "r47.retried"])
def test_every_ending_releases(worker47: Any, r47: Any, other47: Redlock, name: str) -> None:
    _, queue = worker47
    for _ in range(3):
        key = f"{name}-{uuid.uuid4().hex[:8]}"
        result = r47.app.tasks[name].apply_async((key,), queue=queue)
        if name in ("r47.boom", "r47.retried"):
            with contextlib.suppress(ValueError):  # the body's own error, or the retries'
                result.get(timeout=30)
        else:  # no result stored: wait for the body to have run
            deadline = time.monotonic() + 30
            while not [e for e in r47.events(key) if e["event"] == "run"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        took = _free_within(other47, key, 5.0)
        assert took is not None, f"{name}: lock r47:{key} (ttl 30 s) still held 5 s after the run ended"
        runs = [e for e in r47.events(key) if e["event"] == "run"]
        assert len(runs) == (3 if name == "r47.retried" else 1), runs


@pytest.mark.timeout(60)
def test_eager_runs_release(r47: Any, other47: Redlock) -> None:
    for name in ("r47.failing_fast", "r47.boom", "r47.retried", "r47.link"):
        key = f"eager-{uuid.uuid4().hex[:8]}"
        args = (key, 1) if name == "r47.link" else (key,)
        r47.app.tasks[name].apply(args)
        assert _free_at_once(other47, key), f"{name} eager left its lock held"
