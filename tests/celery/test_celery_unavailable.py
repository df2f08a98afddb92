"""No quorum because the masters do not answer is unavailability, not contention.

The invariant: a run whose lock attempt was refused by masters that failed or did not answer is
never skipped or failed as a duplicate (nobody was shown to hold the lock). It retries, within
its lock retry budget, and is then failed with an error naming the masters; the worker says at
start which masters do not answer; an eager call gives up within ``EAGER_UNAVAILABLE_WAIT``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
from celery import Celery
from conftest import HERE, ROOT, app_env, records, wait_until

from celery_redlock import LockNotAcquired, RedlockTask, is_skipped
from celery_redlock.celery.task import EAGER_UNAVAILABLE_WAIT
from celery_redlock.testing import CeleryWorker, RedisServer, free_port


@pytest.mark.timeout(120)
def test_masters_that_do_not_answer_delay_work_but_never_drop_it(
    lockapp: Any, broker: RedisServer, tag: str
) -> None:
    ports = [free_port() for _ in range(3)]  # nothing listens on them yet
    urls = [f"redis://127.0.0.1:{port}/0" for port in ports]
    queue = f"q-down-{tag}"
    env = app_env(broker.url, broker.url, urls, queue)
    servers: list[RedisServer] = []
    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(
            CeleryWorker("lockapp", pool="solo", queues=[queue], env=env, pythonpath=[str(HERE), str(ROOT)])
        )
        # Said at start, naming each master that did not answer.
        said = worker.wait_for_log(r"3 of 3 masters did not answer at start: [^\n]*", timeout=10).group(0)
        assert all(str(port) in said for port in ports), said

        # Skip mode: no holder was shown, so the run is not skipped; it retries, at WARNING.
        skipping = lockapp.hold_or_skip.apply_async((tag, 0.0, tag), queue=queue)
        line = worker.wait_for_log(
            rf"{skipping.id}\]: lock res:{tag} unavailable: no quorum[^\n]*", timeout=20
        ).group(0)
        # What every master said: none answered, so none granted and none named a holder.
        assert all(str(port) in line for port in ports), line
        assert "0 granted, 0 held by another run, quorum 2" in line, line
        assert not skipping.ready(), f"ended {skipping.state}: {skipping.result!r}"

        # A bounded retry budget ends in an error naming the masters, not a skip or a hang.
        bounded = lockapp.bounded.apply_async((f"{tag}-b", tag), queue=queue)
        with pytest.raises(LockNotAcquired) as caught:
            bounded.get(timeout=30)
        assert all(str(port) in str(caught.value) for port in ports), str(caught.value)
        assert not caught.value.contended

        # The masters come up: the skip-mode run, still retrying, now runs its body once.
        for port in ports:
            servers.append(stack.enter_context(RedisServer(port=port)))
        outcome = skipping.get(timeout=60)
        assert not is_skipped(outcome), outcome
        ran = [r for r in records(lockapp, tag) if r.get("task_id") == skipping.id]
        assert len(ran) == 1, ran


def test_an_eager_run_with_no_master_answering_fails_soon_naming_them(tag: str) -> None:
    ports = [free_port() for _ in range(3)]
    app = Celery("eagerdown", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(redlock_masters=[f"redis://127.0.0.1:{p}/0" for p in ports], redlock_retry_backoff=0.05)

    @app.task(base=RedlockTask, lock_key="x:<n>", lock_contended="skip", name="eagerdown.job")
    def job(n: int) -> int:
        return n

    started = time.monotonic()
    result = job.apply((1,))
    took = time.monotonic() - started
    assert result.state == "FAILURE", f"{result.state}: {result.result!r}"
    assert isinstance(result.result, LockNotAcquired)
    assert all(str(port) in str(result.result) for port in ports)
    # The bound, plus one attempt's connects (refused at once on loopback) and scheduling slack.
    assert took < EAGER_UNAVAILABLE_WAIT + 1.5, took


def test_contended_and_unavailable_are_told_apart_by_the_votes() -> None:
    from celery_redlock.errors import Vote

    def error(*kinds: str) -> LockNotAcquired:
        votes = [Vote(f"m{i}", kind) for i, kind in enumerate(kinds)]  # type: ignore[arg-type]
        return LockNotAcquired("r", votes, quorum=len(kinds) // 2 + 1)

    assert error("held", "held", "held", "timeout", "error").contended  # 3 held deny 3 of 5
    # The failing master could have made the quorum: unavailability, retried, never skipped.
    assert not error("held", "held", "yes", "yes", "error").contended
    assert error("held", "held", "held", "yes", "yes").contended
    assert not error("held", "yes", "yes", "timeout", "error").contended  # the silent ones decided
    assert not error("error", "error", "error").contended
    assert error("held", "held", "error").contended
    assert not error("held", "error", "timeout").contended
    assert error("held", "error", "timeout").unavailable_masters == ["m1: error", "m2: timeout"]


def test_the_worker_start_probe_is_quiet_when_every_master_answers(
    lockapp: Any, broker: RedisServer, redlock_masters: Any, tag: str
) -> None:
    queue = f"q-up-{tag}"
    env = app_env(broker.url, broker.url, redlock_masters.urls, queue)
    with CeleryWorker(
        "lockapp", pool="solo", queues=[queue], env=env, pythonpath=[str(HERE), str(ROOT)]
    ) as w:
        lockapp.hold.apply_async((tag, 0.0, tag), queue=queue).get(timeout=20)
        assert "did not answer at start" not in w.log_text()
    wait_until(lambda: records(lockapp, tag), 5, "the record")
